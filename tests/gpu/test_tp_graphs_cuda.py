"""CUDA graphs under tensor parallelism, on GPUs.

- One GPU: NCCL collectives of the kinds TPGroup issues (an in-place all-reduce, an all-gather
  into one buffer) captured inside CUDA graphs that share a memory pool, after one eager
  warm-up collective, replay with new inputs and give the right sums, also when eager
  collectives ran between captures (the NCCL watchdog then has work to look at). A world of one
  rank: the model itself cannot be tested this way, since a group of size 1 skips its
  collectives (TPGroup returns the input untouched), as every layer does at tp 1.
- Two GPUs or more: LLM(tensor_parallel_size=2) over NCCL with graphs on serves greedy fp32
  output equal to one rank's eager output, plainly, with n-gram drafts, and with an EAGLE-3
  drafter on rank 0 (chains replay the verify graph on both ranks; trees verify eagerly); plain
  decode forwards are all graph replays and chain verifies mostly (a batch that mixes in a
  prefill chunk runs eagerly), and a forward counts 2 x layers + 1 all-reduces and one
  all-gather, as eagerly.

Run on a GPU machine (a graph replay waits on its collectives with no time limit: bound it):

    timeout 900 python -m pytest -q tests/gpu/test_tp_graphs_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from outrider.layers.forward_context import current_mode
from tests.benchmarks import load_benchmark
from tests.tiny import tiny_hf_config

pytestmark = pytest.mark.gpu

# head_dim 64 (the Triton kernels' common case), 4 KV heads: 2 per rank at TP 2.
SHAPE = tiny_hf_config(
    hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
    vocab_size=2048, num_hidden_layers=4, max_position_embeddings=1024,
)  # fmt: skip
NGRAM = {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"}


def test_nccl_collectives_replay_inside_captured_graphs(tmp_path):
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        warm = torch.zeros(1, device=dev)
        dist.all_reduce(warm)  # TPGroup.warm_up: the communicator exists before any capture
        torch.cuda.synchronize()
        x = torch.zeros(4, 8, device=dev)

        def step(scale: float) -> torch.Tensor:
            y = x * scale
            dist.all_reduce(y)  # TPGroup.all_reduce: in place
            out = torch.empty((1, *y.shape), dtype=y.dtype, device=dev)
            dist.all_gather_into_tensor(out, y)  # TPGroup.all_gather on CUDA
            return torch.cat(list(out.unbind(0)), dim=-1) + 1

        pool, graphs = None, []
        for scale in (2.0, 3.0):  # largest first into one pool, as the runners capture
            for _ in range(2):
                step(scale)  # warm-ups, eager
            dist.all_reduce(torch.ones(16, device=dev))  # eager work left for the watchdog
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                result = step(scale)
            pool = pool or graph.pool()
            graphs.append((scale, graph, result))
        for value in (1.0, 5.0, -2.0):
            x.fill_(value)
            for scale, graph, result in graphs:
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(result, torch.full_like(result, scale * value + 1))
    finally:
        dist.destroy_process_group()


def _per_forward(counts: dict, mode: str) -> tuple[int, int]:
    n = counts[mode]["forward"]["calls"]
    reduces, gathers = (counts[mode][op]["calls"] for op in ("all_reduce", "all_gather"))
    assert reduces % n == 0 and gathers % n == 0, (mode, counts[mode])
    return reduces // n, gathers // n


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"TP=2 needs 2 GPUs of one host; this one has {torch.cuda.device_count()}",
)
def test_tp2_graphs_equal_tp1_eager_plain_ngram_eagle3(tmp_path):
    from outrider import LLM, SamplingParams
    from outrider.executor.drafter import Eagle3Drafter
    from tests.unit.test_spec_eagle3 import random_drafter

    tp_gpu = load_benchmark("tp_gpu.py")  # the benchmark's own model writer: the same run
    path = str(tp_gpu.write_random_model(SHAPE, tmp_path))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (5, 33)]
    prompts += [[7, 8, 9, 10] * 6, [11, 12, 13] * 9, [40] * 3]  # repeats: n-gram drafts at once
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    opts = dict(
        dtype="float32", device="cuda", attention_backend="triton", num_blocks=256,
        max_model_len=512, cuda_graph_max_batch=8,
    )  # fmt: skip
    with LLM(path, **opts, cuda_graphs=False) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    layers = SHAPE["num_hidden_layers"]

    with LLM(path, **opts, cuda_graphs=True, tensor_parallel_size=2, speculative=NGRAM) as llm:
        engine, runner = llm.engine, llm.engine.runner
        assert runner.tp.size == 2 and runner.graphs is not None and runner.graphs.graphs
        eager: dict[str, int] = {}

        def hook(*_):  # module hooks run for eager forwards only, never inside a replay
            mode = current_mode().value
            eager[mode] = eager.get(mode, 0) + 1

        handle = runner.model.register_forward_pre_hook(hook)

        def run(name: str) -> dict:
            runner.reset_collective_counts()
            eager.clear()
            verifies = engine.speculator.stats.num_verify_steps
            got = [o.token_ids for o in llm.generate(prompts, params)]
            assert got == want, f"{name}: TP=2 with graphs differs from TP=1 eager"
            if name != "plain":
                assert engine.speculator.stats.num_verify_steps > verifies, name
            return runner.collective_counts()

        def mostly_replayed(counts: dict) -> None:
            assert runner.spec_step.graphs, "the verify graphs were not captured"
            assert 2 * eager.get("verify", 0) < counts["verify"]["forward"]["calls"], eager

        counts = run("ngram")
        mostly_replayed(counts)
        assert _per_forward(counts, "verify") == (2 * layers + 1, 1)

        target = engine.checkpoint.config
        engine.speculator.use_proposer(
            Eagle3Drafter(random_drafter(target).to(runner.device), runner)
        )
        counts = run("eagle3 chain")
        mostly_replayed(counts)
        assert _per_forward(counts, "verify") == (2 * layers + 1, 1)
        assert "draft" not in counts  # the drafter and its graph run on rank 0 alone

        tree = Eagle3Drafter(random_drafter(target).to(runner.device), runner, 2, 2)
        engine.speculator.use_proposer(tree)
        counts = run("eagle3 tree")  # verified eagerly under tensor parallelism
        assert _per_forward(counts, "verify") == (2 * layers + 1, 1)

        engine.speculator.use_proposer(None)
        counts = run("plain")
        assert eager.get("decode", 0) == 0, eager  # every decode replayed its graph
        assert _per_forward(counts, "decode") == (2 * layers + 1, 1)
        handle.remove()
    codes = [p.exitcode for p in engine._ranks.procs]
    assert codes == [0] * len(codes), codes
