"""A request never outgrows the KV cache silently: the engine's max_model_len is capped by what
the pool holds for one request (an explicit max_model_len the pool cannot hold fails at start),
a request whose prompt + max_tokens cannot fit is refused before it runs (400 from the server),
and one that fits runs to its last token, preempting the others when the pool is short.

The tiny checkpoint here is test_engine_tiny's with a 2048-token context, so a 64-block pool of
16-token blocks (1024 tokens) is the binding limit, as in the report that found this."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from outrider import LLM, SamplingParams
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (fixture)

POOL = 64 * 16  # num_blocks=64 of the default block_size 16


@pytest.fixture(scope="module")
def long_dir(tiny_dir, tmp_path_factory):  # noqa: F811
    """The same weights and tokenizer with max_position_embeddings 2048 (rotary extends)."""
    path = tmp_path_factory.mktemp("tiny-llama-2k")
    for f in tiny_dir[0].iterdir():
        shutil.copy(f, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def llm(long_dir):
    return LLM(str(long_dir), dtype="float32", device="cpu", num_blocks=64)


def _idle(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return not llm.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_default_context_is_capped_by_the_pool(long_dir, tiny_dir, caplog):  # noqa: F811
    with caplog.at_level(logging.WARNING, logger="outrider.engine.engine"):
        llm = LLM(str(long_dir), dtype="float32", device="cpu", num_blocks=64)
    assert llm.engine.max_model_len == POOL
    assert llm.engine.scheduler.max_model_len == POOL
    assert llm.engine.runner.max_model_len == 2048  # runner buffers keep the model's size
    lowered = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(lowered) == 1 and "2048" in lowered[0] and str(POOL) in lowered[0]
    # The model's own 512 tokens bind when the pool holds more: nothing is lowered.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="outrider.engine.engine"):
        small = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64)
    assert small.engine.max_model_len == 512 and not caplog.records
    # Refusals name the bound: the pool, the model or the configuration.
    assert "all the KV cache holds" in llm.engine.context.context
    assert small.engine.context.context == "the context is 512 tokens (the model's max_model_len)"


def test_explicit_max_model_len_beyond_the_pool_fails_at_start(long_dir):
    with pytest.raises(ValueError) as e:
        LLM(str(long_dir), dtype="float32", device="cpu", num_blocks=64, max_model_len=2048)
    msg = str(e.value)
    assert "max_model_len=2048" in msg and str(POOL) in msg and "num_blocks" in msg
    fits = LLM(str(long_dir), dtype="float32", device="cpu", num_blocks=64, max_model_len=POOL)
    assert fits.engine.max_model_len == POOL
    with pytest.raises(ValueError, match=r"\(max_model_len, as configured\).*raise max_model_len"):
        fits.generate([[42] * POOL], SamplingParams(max_tokens=1))


def test_a_prompt_past_the_context_is_refused_and_generation_stops_at_its_end(llm):
    """Offline, as in vLLM's LLM: a prompt that leaves no room is refused (nothing half-ran);
    prompt + max_tokens past the context generates up to the context's end, the whole context
    the pool really holds (before the cap: 24 of 100 tokens under a reported 2048), and says
    "length". The server refuses such a request instead (test below)."""
    with pytest.raises(ValueError, match="context is 1024 tokens, all the KV cache holds") as e:
        llm.generate([[42] * POOL], SamplingParams(max_tokens=1))
    assert "64 blocks of 16 tokens" in str(e.value) and "cpu_kv_bytes" in str(e.value)
    assert _idle(llm)
    over = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    out = llm.generate([[42] * 1000], over)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == POOL - 1000
    out = llm.generate([[42] * 1000], SamplingParams(temperature=0, max_tokens=None))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == POOL - 1000
    assert _idle(llm)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_request_that_exactly_fits_completes_beside_others(long_dir, speculative):
    """924 + 100 tokens fill the whole context; three other requests share the 64-block pool
    with it, so someone is preempted, yet every request gets all its tokens, and the long one
    the same tokens it gets alone."""
    spec = {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"}
    llm = LLM(
        str(long_dir), dtype="float32", device="cpu", num_blocks=64,
        speculative=spec if speculative else None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    long_prompt = torch.randint(3, 512, (POOL - 100,), generator=g).tolist()
    others = [torch.randint(3, 512, (300,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    alone = llm.generate([long_prompt], params)[0]
    outs = llm.generate([long_prompt, *others], params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.finish_reason == "length" and len(o.token_ids) == 100 for o in outs)
    assert outs[0].token_ids == alone.token_ids
    assert _idle(llm)


def test_server_refuses_with_400_and_reports_the_effective_context(long_dir):
    import httpx

    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    core = EngineCore(
        EngineConfig().replace(
            model={"model": str(long_dir), "dtype": "float32", "device": "cpu"},
            cache={"num_blocks": 64},
        )
    )
    with ServerThread(ServerConfig(), core) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        models = c.get("/models").json()["data"]
        assert [m["max_model_len"] for m in models] == [POOL]
        body = {"prompt": [42] * 1000, "max_tokens": 100, "ignore_eos": True}
        r = c.post("/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "max_tokens=100" in err["message"] and str(POOL) in err["message"]
        assert "all the KV cache holds" in err["message"]  # the bound is the pool, not the model
        r = c.post("/completions", json={**body, "max_tokens": 24})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 24
