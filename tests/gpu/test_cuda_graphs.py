"""CUDA graph replay gives exactly what eager execution gives (fp32): decode at several padded
batch sizes, chain VERIFY when the backend supports graphs for it, and steps with prompt chunks
beside decode rows (PREFILL graphs)."""

from __future__ import annotations

import pytest

from outrider import LLM, SamplingParams
from outrider.bench.datasets import GROUNDED, OPEN
from outrider.core import ForwardMode

pytestmark = pytest.mark.gpu

CONVS = [[{"role": "user", "content": p}] for p in OPEN[:5] + GROUNDED[:2]]
PARAMS = SamplingParams(temperature=0, max_tokens=40)


def _outputs(batch_sizes=(1, 3, 7), prefill_replays: list | None = None, **kw) -> list[list[int]]:
    llm = LLM(dtype="float32", device="cuda", gpu_memory_utilization=0.15, **kw)
    outs = []
    for n in batch_sizes:  # 3 and 7 replay graphs padded to 4 and 8
        outs += [o.token_ids for o in llm.chat(CONVS[:n], PARAMS)]
    if kw.get("cuda_graphs"):
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    if prefill_replays is not None:
        graphs = llm.engine.runner.graphs
        prefill_replays.append(0 if graphs is None else graphs.replays[ForwardMode.PREFILL])
    return outs


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_decode_graphs_equal_eager(backend):
    common = dict(attention_backend=backend, cuda_graph_max_batch=8)
    assert _outputs(cuda_graphs=True, **common) == _outputs(cuda_graphs=False, **common)


def test_verify_graphs_equal_eager():
    spec = {"method": "ngram", "controller": "fixed", "num_draft_tokens": 4}
    common = dict(attention_backend="triton", cuda_graph_max_batch=8, speculative=spec)
    graphed = _outputs(cuda_graphs=True, **common)
    assert graphed == _outputs(cuda_graphs=False, **common)


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_graphs_equal_eager(mixed):
    # Chunks of at most 48 tokens: every prompt is computed over several steps, beside the
    # decode rows of the requests whose prompts are done (the server's mixed steps, graphed
    # only with cuda_graph_mixed_prefill); each batch's first step holds prompts alone.
    common = dict(attention_backend="triton", cuda_graph_max_batch=8, max_num_batched_tokens=48)
    replays: list[int] = []
    graphed = _outputs(
        cuda_graphs=True, cuda_graph_mixed_prefill=mixed, prefill_replays=replays, **common
    )
    assert replays[0] > 0  # steps with prompt chunks replayed PREFILL graphs
    off: list[int] = []
    eager = _outputs(cuda_graphs=True, cuda_graph_prefill_tokens=0, prefill_replays=off, **common)
    assert off == [0]
    assert graphed == eager == _outputs(cuda_graphs=False, **common)
