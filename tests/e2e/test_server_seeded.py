"""Seeded sampling through `outrider serve` with the default adaptive EAGLE-3 (the drafter
shipped for the default model, fp32 on CPU): a request with a seed gives the same text alone,
inside a batch of 16 and beside a load of long streams, in the default mode and in the
deterministic mode. The controller's draft length changes with the batch, and a draw keyed by
(seed, output position) does not care (executor/sampler.py keyed_noise_no_sync)."""

from __future__ import annotations

import contextlib
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

KEY = "sk-seeded"
# (prompt, temperature, top_p, seed): the temperatures, with and without a top-p cut.
SEEDED = [
    (CHAT_PROMPTS[1], 0.8, 0.9, 11),
    (CHAT_PROMPTS[2], 1.2, 0.9, 12),
    (CHAT_PROMPTS[6], 0.8, 1.0, 13),
    (CHAT_PROMPTS[8], 1.2, 0.9, 14),
]
MAX_TOKENS = 16


@contextlib.contextmanager
def seeded_server(model: dict, num_blocks: int | None = None):
    """An engine of `model` (EngineConfig.model fields) with the default adaptive EAGLE-3
    (the shipped drafter) behind a test server -> (core, an OpenAI client of it)."""
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    config = EngineConfig().replace(model=model, speculative={"method": "eagle3"})
    if num_blocks is not None:
        config = config.replace(cache={"num_blocks": num_blocks})
    core = EngineCore(config)
    with ServerThread(ServerConfig(api_key=KEY), core) as server:
        client = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)
        client.served_model = server.state.model_name
        yield core, client
    del core, server, client
    gc.collect()  # the suite's process holds one engine at a time


@pytest.fixture(scope="module", params=[False, True], ids=["default", "deterministic"])
def served(request):
    # 256 blocks, 4,096 tokens: the 28 requests' worst case fits twice
    model = {"dtype": "float32", "device": "cpu", "deterministic": request.param}
    with seeded_server(model, num_blocks=256) as pair:
        yield pair


def _ask(client, prompt: str, temperature: float, top_p: float, seed: int | None) -> str:
    r = client.chat.completions.create(
        model=client.served_model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=temperature, top_p=top_p, seed=seed,
    )  # fmt: skip
    return r.choices[0].message.content


def test_a_seed_gives_one_text_alone_batched_and_under_load(served):
    core, client = served
    alone = [_ask(client, *case) for case in SEEDED]
    assert len(set(alone)) == len(alone)  # four requests, four texts: the seeds are used

    # Inside a batch of 16: the seeded four among twelve others, all sent at once.
    others = [(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], 1.0, 1.0, None) for i in range(12)]
    with ThreadPoolExecutor(16) as pool:
        batched = list(pool.map(lambda case: _ask(client, *case), SEEDED + others))[:4]
    assert batched == alone

    # Beside a load: eight long unseeded streams started first, the seeded four sent meanwhile.
    started = threading.Barrier(9)

    def long_stream(i: int) -> None:
        stream = client.chat.completions.create(
            model=client.served_model, messages=[{"role": "user", "content": CHAT_PROMPTS[i]}],
            max_tokens=48, temperature=1.0, stream=True,
        )  # fmt: skip
        waited = False
        try:
            for _ in stream:
                if not waited:  # this stream is being decoded: the seeded four may go
                    waited = True
                    started.wait(timeout=300)
        finally:
            if not waited:
                started.wait(timeout=300)

    with ThreadPoolExecutor(12) as pool:
        load = [pool.submit(long_stream, i) for i in range(8)]
        started.wait(timeout=300)
        loaded = list(pool.map(lambda case: _ask(client, *case), SEEDED))
        for f in load:
            f.result()
    assert loaded == alone

    steps = core.speculator.controller.snapshot()["steps"]  # steps by the k chosen
    assert core.speculator.stats.num_verify_steps > 0, steps  # it speculated at some point
