"""The engine split over ranks on the CPU (gloo over loopback): LLM(tensor_parallel_size=N)
starts N - 1 rank processes, rank 0 schedules, samples and drafts, every rank runs each
forward; greedy output equals one rank's token for token, plain and speculative, and every
collective of a forward is counted."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import outrider
from outrider import LLM, SamplingParams
from outrider.config import EngineConfig, flat_sections
from outrider.loaders.hf_config import TransformerConfig
from tests.tiny import tiny_hf_config
from tests.unit.test_engine_tiny import prompts, tiny_dir  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0, max_tokens=20)
# The lossless speculative test's settings: 8-token blocks, 14 of them (preemption), prompts
# prefilled in chunks of at most 16 tokens, batches up to 16.
TIGHT = dict(
    dtype="float32", device="cpu", num_blocks=14, block_size=8, max_num_batched_tokens=16,
    max_num_seqs=16,
)  # fmt: skip
NGRAM = {"method": "ngram", "num_draft_tokens": 4, "controller": "fixed"}
REPO = Path(outrider.__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    """The environment of a subprocess running this checkout's outrider."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OUTRIDER_NUM_THREADS": "1"}


def _per_forward(counts: dict, mode: str) -> tuple[int, int]:
    """(all-reduces, all-gathers) per forward of `mode` over the run (decode and verify
    forwards all compute logits, so each gathers once)."""
    n = counts[mode]["forward"]["calls"]
    assert n > 0
    reduce_calls, gather_calls = (counts[mode][op]["calls"] for op in ("all_reduce", "all_gather"))
    assert reduce_calls % n == 0 and gather_calls % n == 0, (mode, counts[mode])
    return reduce_calls // n, gather_calls // n


@pytest.fixture(scope="module")
def tp1_outputs(tiny_dir, prompts):  # noqa: F811
    """One rank, n-gram speculation, the tight settings: 24 requests (each prompt 3 times).
    (That these equal HF transformers' greedy output is test_spec_engine's lossless test.)"""
    llm = LLM(str(tiny_dir[0]), **TIGHT, speculative=NGRAM)
    outs = [o.token_ids for o in llm.generate(prompts * 3, GREEDY)]
    assert llm.engine.scheduler.num_preemptions > 0
    return outs


@pytest.mark.slow
def test_tp2_equals_tp1_plain_ngram_eagle3_under_preemption_and_chunking(
    tiny_dir,  # noqa: F811
    prompts,  # noqa: F811
    tp1_outputs,
):
    """One TP=2 engine (4 layers, 8 heads, 2 KV heads: one per rank) serves with n-gram
    drafts, then an EAGLE-3 drafter on rank 0 (chains, then trees, whose accepted nodes' KV
    every rank moves), then plainly: each time the greedy output equals one rank's, and a
    decode or verify forward ran 2 x layers + 1 all-reduces and one all-gather."""
    from outrider.executor.drafter import Eagle3Drafter
    from tests.unit.test_spec_eagle3 import random_drafter

    layers = tiny_hf_config()["num_hidden_layers"]
    with LLM(str(tiny_dir[0]), tensor_parallel_size=2, **TIGHT, speculative=NGRAM) as llm:
        engine = llm.engine
        assert engine.runner.tp.size == 2 and len(engine._ranks.procs) == 1
        assert engine.runner.model.attention_layers()[0].num_kv_heads == 1

        def run(name: str) -> dict:
            engine.runner.reset_collective_counts()
            verifies = engine.speculator.stats.num_verify_steps
            outs = [o.token_ids for o in llm.generate(prompts * 3, GREEDY)]
            assert outs == tp1_outputs, f"{name}: TP=2 differs from TP=1"
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            if name != "plain":
                assert engine.speculator.stats.num_verify_steps > verifies, name
            return engine.runner.collective_counts()

        counts = run("ngram")
        assert _per_forward(counts, "verify") == (2 * layers + 1, 1)
        assert engine.scheduler.num_preemptions > 0
        target = engine.checkpoint.config
        engine.speculator.use_proposer(Eagle3Drafter(random_drafter(target), engine.runner))
        counts = run("eagle3 chain")
        assert _per_forward(counts, "verify") == (2 * layers + 1, 1)
        # The drafter runs on rank 0 alone: its forwards add no collective ("draft" absent).
        assert "draft" not in counts
        engine.speculator.use_proposer(Eagle3Drafter(random_drafter(target), engine.runner, 2, 2))
        counts = run("eagle3 tree")
        assert counts["other"]["broadcast"]["calls"] > 0  # headers, and the KV moves
        # A forward's inputs (tree masks included) reach the other ranks in one broadcast.
        for mode in ("prefill", "verify"):
            assert counts[mode]["broadcast"]["calls"] == counts[mode]["forward"]["calls"]
        engine.speculator.use_proposer(None)
        counts = run("plain")
        assert _per_forward(counts, "decode") == (2 * layers + 1, 1)
        assert "verify" not in counts
        # A prefill chunk that samples nothing computes no logits: fewer gathers than forwards.
        prefill = counts["prefill"]
        forwards = prefill["forward"]["calls"]
        assert prefill["all_reduce"]["calls"] == (2 * layers + 1) * forwards
        assert 0 < prefill["all_gather"]["calls"] < forwards
    codes = [p.exitcode for p in engine._ranks.procs]
    assert codes == [0] * len(codes), codes  # STOP ended the rank cleanly


def test_sizes_that_cannot_work_fail_at_start_naming_the_fix(tiny_dir, monkeypatch):  # noqa: F811
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"8 attention heads.*use tensor_parallel_size in \[1, 2"):
        LLM(str(tiny_dir[0]), tensor_parallel_size=3, dtype="float32", device="cpu")
    # torchrun's world of 3 processes cannot run TP 2 (refused before any connection).
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not match the world size 3"):
        LLM(str(tiny_dir[0]), tensor_parallel_size=2, dtype="float32", device="cpu")
    assert time.perf_counter() - t0 < 20
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig().replace(parallel={"tensor_parallel_size": 0})


def test_tensor_parallel_size_from_yaml_flags_and_options(tmp_path):
    from outrider.cli import build_parser
    from outrider.flags import engine_config
    from outrider.server.cli import configs_from_args

    yaml = tmp_path / "tp.yaml"
    yaml.write_text("parallel: {tensor_parallel_size: 4}\n")
    assert EngineConfig.from_yaml(yaml).parallel.tensor_parallel_size == 4
    assert EngineConfig.from_dict({"tensor-parallel-size": 2}).parallel.tensor_parallel_size == 2
    assert flat_sections({"tp": 3})["parallel"] == {"tensor_parallel_size": 3}
    parser = build_parser()
    for flag in ("--tensor-parallel-size", "--tp", "-tp"):
        args = parser.parse_args(["generate", "hi", flag, "2"])
        assert engine_config(args).parallel.tensor_parallel_size == 2, flag
        args = parser.parse_args(["serve", flag, "2", "--config", str(yaml)])
        _, engine = configs_from_args(args)
        assert engine.parallel.tensor_parallel_size == 2, flag  # the flag wins over the YAML
    args = parser.parse_args(["serve", "--config", str(yaml)])
    assert configs_from_args(args)[1].parallel.tensor_parallel_size == 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_equal_tp2_in_one_node(tiny_dir):  # noqa: F811
    """`outrider generate --tp 2` as two torchrun "nodes" of one process each over loopback
    prints what LLM(tensor_parallel_size=2) in one node generates."""
    model = str(tiny_dir[0])
    prompt = "the quick brown fox"
    with LLM(model, tensor_parallel_size=2, dtype="float32", device="cpu", num_blocks=64) as llm:
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    assert len(want.token_ids) > 0
    port = _free_port()
    launch = "-m torch.distributed.run --nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1 "
    launch += f"--master-port {port} --node-rank"
    generate = "-m outrider generate --tp 2 --raw --dtype float32 --device cpu --num-blocks 64 "
    generate += "--max-tokens 16 --model"
    nodes = [
        subprocess.Popen(
            [sys.executable, *launch.split(), str(rank), *generate.split(), model, prompt],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )  # fmt: skip
        for rank in range(2)
    ]
    results = []
    try:
        for node in nodes:
            results.append(node.communicate(timeout=180))
    finally:
        for node in nodes:
            node.kill()
    for rank, (node, (_, err)) in enumerate(zip(nodes, results)):
        assert node.returncode == 0, f"node {rank} failed:\n{err[-3000:]}"
    assert results[0][0] == want.text + "\n"
    assert results[1][0] == ""  # rank 1 followed rank 0 and printed nothing


KILLED_RANK_SCRIPT = """
import sys, time
from outrider import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", num_blocks=256)
print(llm.engine._ranks.procs[0].pid, flush=True)
params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
while True:
    llm.generate([[5, 6, 7, 8]] * 4, params)
"""


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_a_clear_error(tiny_dir):  # noqa: F811
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_RANK_SCRIPT, str(tiny_dir[0])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    try:
        pid = int(proc.stdout.readline())
        time.sleep(1.0)  # mid-generation
        assert proc.poll() is None
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        _, err = proc.communicate(timeout=30)
        took = time.perf_counter() - t0
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert took < 30
    assert "RankDied" in err and f"tensor-parallel rank 1 (pid {pid}) died" in err, err[-3000:]


@pytest.mark.slow
def test_default_model_tp3_equals_tp1_on_the_e2e_prompts():
    """The real default model (9 heads, 3 KV heads: one per rank) over 3 ranks generates what
    one rank does for the 12 chat prompts of the end-to-end suite."""
    from outrider.loaders.checkpoint import default_model_path
    from tests.e2e.conftest import CHAT_PROMPTS

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    params = SamplingParams(temperature=0, max_tokens=24)
    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    one = LLM(dtype="float32", device="cpu")
    want = [o.token_ids for o in one.chat(convs, params)]
    del one
    with LLM(dtype="float32", device="cpu", tensor_parallel_size=3) as llm:
        cfg: TransformerConfig = llm.engine.checkpoint.config
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
        got = [o.token_ids for o in llm.chat(convs, params)]
    assert got == want
    assert all(len(o) > 0 for o in want)
