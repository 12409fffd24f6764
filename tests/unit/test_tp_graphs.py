"""CUDA graphs under tensor parallelism, the parts the CPU can check: the step header names the
graph rank 0 replays and a rank > 0 replays that same key on the inputs rank 0 sent (its static
buffers then hold what rank 0's hold); every rank plans the same captures and ranks that do not
agree stop; a capture counts nothing and each replay counts what the graph runs. (Capturing a
real graph needs a GPU: tests/gpu/test_tp_graphs_cuda.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from outrider.config import EngineConfig
from outrider.core import ForwardMode, Request, SamplingParams, ScheduledBatch, ScheduledSeq
from outrider.distributed import TPGroup
from outrider.executor import tp_channel, tp_graphs
from outrider.executor.cuda_graph import GraphKey, GraphRunner
from outrider.executor.inputs import build_inputs
from outrider.executor.model_runner import ModelRunner
from outrider.executor.spec_step import SpecStep
from outrider.layers.attn_backends.base import get_backend
from outrider.layers.forward_context import (
    AttentionMetadata,
    ForwardContext,
    current_mode,
    forward_context,
)
from outrider.loaders.checkpoint import open_checkpoint
from outrider.speculative.base import SeqDrafts
from outrider.speculative.tree_batch import TreeShape
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (fixture)

BLOCK, MAX_BLOCKS, SCRATCH = 4, 8, 20
HIDDEN, LAYERS = 16, 3
# What one captured decode or verify forward of a 3-layer model runs: 2 all-reduces a layer
# and the embedding's (the LM head's all-gather follows outside a target graph).
RECORDED = {"decode": {"all_reduce": {"calls": 2 * LAYERS + 1, "bytes": 4096}}}


class Wire(TPGroup):
    """Rank 0 of two whose broadcasts are kept, not sent: what the other rank would receive."""

    def __init__(self) -> None:
        super().__init__(rank=0, size=2, group=object())
        self.sent: list[torch.Tensor] = []

    def broadcast(self, x, src=0, *, mode=None, control=False):
        self._count("broadcast", x.numel() * x.element_size(), mode)
        self.sent.append(x.clone())
        return x


class OtherRank(TPGroup):
    """A rank that holds `other` where this one holds its value, for agree_min."""

    def __init__(self, other: int) -> None:
        super().__init__(rank=1, size=2, group=object())
        self.other = other

    def agree_min(self, value: int) -> int:
        return min(value, self.other if value >= 0 else -self.other)


class Agreeing(TPGroup):
    """Rank 1 of two that agrees with itself: no other rank runs here."""

    def agree_min(self, value: int) -> int:
        return value


class FakeGraph:
    """Stands in for a captured torch.cuda.CUDAGraph: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class StubModel(torch.nn.Module):
    """What the graph runners and a follower read of a model: its device, and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _seqs(rows: list[tuple[list[int], int, list[int]]], drafts: bool = False) -> list:
    """ScheduledSeqs computing (tokens, start position, block ids) each, greedy."""
    out = []
    for ids, start, blocks in rows:
        req = Request(prompt_token_ids=[1], params=SamplingParams(temperature=0))
        d = SeqDrafts.chain(ids[1:]) if drafts else None
        out.append(ScheduledSeq(req, list(ids), start, blocks, True, d))
    return out


def _graph_runner(tp: TPGroup) -> GraphRunner:
    runner = GraphRunner(
        StubModel(), get_backend("torch_ref"), max_blocks=MAX_BLOCKS, scratch_block=SCRATCH,
        block_size=BLOCK, batch_sizes=(1, 2, 4), tokens_per_seq=(1, 3), tp=tp,
    )  # fmt: skip
    for key in runner.capture_keys():  # "captured": a fake graph over real output buffers
        hidden = torch.zeros(runner.inputs.input_ids.shape[0], HIDDEN)
        runner.graphs[key] = (FakeGraph(), (hidden, None), RECORDED)
    return runner


def _header(wire: Wire) -> list[int]:
    header = wire.sent[0].tolist()
    assert len(header) == tp_channel.HEADER
    return header


def test_a_decode_step_names_its_graph_and_the_other_rank_replays_it_on_the_same_inputs():
    wire = Wire()
    rank0 = _graph_runner(wire)
    batch = ScheduledBatch(
        ForwardMode.DECODE, _seqs([([5], 6, [3, 7]), ([9], 13, [1, 2, 4, 11]), ([4], 2, [0])])
    )
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    key = rank0.can_run(inputs)
    assert key == GraphKey(ForwardMode.DECODE, 4, 1)  # 3 sequences replay the graph of 4
    sender = tp_channel.StepSender(wire)
    graph = (tp_channel.TARGET_GRAPH, key.mode, key.batch, key.tokens_per_seq)
    sender.forward(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices, graph)
    rank0.replay(key, inputs)

    header = _header(wire)
    assert header[0] == tp_channel.FORWARD
    assert header[7:] == [tp_channel.TARGET_GRAPH, list(ForwardMode).index(key.mode), 4, 1]
    follower = _graph_runner(TPGroup(rank=1, size=2, group=object()))
    runner = SimpleNamespace(graphs=follower, tp=follower.tp, model=StubModel(), spec_step=None)
    tp_channel._forward(runner, lambda shape, dtype: wire.sent[1], *header[1:])

    # The same key replayed once, on static buffers equal to rank 0's (padding rows included).
    assert [k for k, (g, _, _) in follower.graphs.items() if g.replays] == [key]
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"):
        mine, theirs = getattr(follower.inputs, name), getattr(rank0.inputs, name)
        assert torch.equal(mine[: key.batch + 1], theirs[: key.batch + 1]), name
    assert torch.equal(follower.inputs.block_tables[:4], rank0.inputs.block_tables[:4])
    assert follower.inputs.block_tables[3, 0] == SCRATCH  # the padding row
    # Each replay counts the graph's collectives under the forward's mode, once per replay.
    assert follower.tp.counts() == RECORDED
    assert wire.counts()["decode"]["all_reduce"] == RECORDED["decode"]["all_reduce"]
    assert sender.forwards == {"decode": 1}


def test_an_eager_forward_says_so_and_the_other_rank_runs_it_eagerly():
    wire = Wire()
    batch = ScheduledBatch(ForwardMode.PREFILL, _seqs([([5, 6, 7], 0, [3])]))
    inputs = build_inputs(batch, BLOCK, torch.device("cpu"))
    tp_channel.StepSender(wire).forward(inputs.input_ids, inputs.positions, inputs.attn, None)
    assert _header(wire)[7:] == [tp_channel.EAGER, 0, 0, 0]


def _spec_step(tp: TPGroup, sender=None, tree: TreeShape | None = None) -> SpecStep:
    drafter = object() if tree is not None else None  # a tree step needs one; none drafts here
    return SpecStep(
        StubModel(), get_backend("torch_ref"), drafter, max_k=3, block_size=BLOCK,
        max_blocks=MAX_BLOCKS, scratch_block=SCRATCH, max_positions=256, batch_sizes=(1, 2, 4),
        sender=sender, tp=tp, tree=tree, kv_pool=object(),
    )  # fmt: skip


def test_a_verify_step_sends_its_loaded_buffers_and_the_other_rank_replays_that_graph():
    wire = Wire()
    rank0 = _spec_step(wire, tp_channel.StepSender(wire))
    follower = _spec_step(TPGroup(rank=1, size=2, group=object()))
    # k = 2: the verify graphs of (padded 4, k 2); rank 0 drafts nothing here (n-gram).
    for step in (rank0, follower):
        step.graphs.captured[(4, 2, 0)] = (FakeGraph(), None, None, RECORDED)
    seqs = _seqs([([5, 6, 7], 6, [3, 7]), ([9, 8], 13, [1, 2, 4, 11]), ([4, 1, 2], 2, [0])], True)
    rank0.run_no_sync(ScheduledBatch(ForwardMode.VERIFY, seqs), 2, 0)

    header = _header(wire)
    assert header[7:] == [tp_channel.SPEC_GRAPH, list(ForwardMode).index(ForwardMode.VERIFY), 4, 3]
    runner = SimpleNamespace(graphs=None, tp=follower.tp, model=StubModel(), spec_step=follower)
    tp_channel._forward(runner, lambda shape, dtype: wire.sent[1], *header[1:])
    assert follower.graphs.captured[(4, 2, 0)][0].replays == 1
    n = 4 * 3
    for name in ("input_ids", "positions", "slot_mapping"):
        assert torch.equal(getattr(follower.inputs, name)[:n], getattr(rank0.inputs, name)[:n])
    assert torch.equal(follower.inputs.seq_lens[:4], rank0.inputs.seq_lens[:4])
    assert torch.equal(follower.inputs.block_tables[:4], rank0.inputs.block_tables[:4])
    assert follower.tp.counts()["verify"] == RECORDED["decode"]
    assert wire.counts()["verify"]["all_reduce"] == RECORDED["decode"]["all_reduce"]


def test_a_follower_without_the_graph_stops_naming_it():
    follower = _spec_step(TPGroup(rank=1, size=2, group=object()))
    with pytest.raises(RuntimeError, match=r"batch 4, k 2.*did not capture.*cuda_graphs=False"):
        ids = torch.zeros(12, dtype=torch.int64)
        tables = torch.zeros(4, 2, dtype=torch.int32)
        follower.graphs.replay_sent(2, ids, ids, ids, torch.zeros(4, dtype=torch.int32), tables)


def test_a_follower_builds_rank0s_step_without_a_drafter_and_keeps_its_shard(tiny_dir):  # noqa: F811
    """A rank > 0 on rank 0's CAPTURE: a step at rank 0's draft lengths that drafts nothing
    (rank 0 drafts), no step for trees; a split drafter's shard and its aux streams stay."""
    path = str(tiny_dir[0])
    config = EngineConfig.from_dict({
        "model": path, "device": "cpu", "dtype": "float32", "num_blocks": 14, "block_size": 8,
        "speculative": {"method": "ngram", "num_draft_tokens": 3},
    })  # fmt: skip
    runner = ModelRunner(config, open_checkpoint(path), tp=Agreeing(rank=1, size=2, group=object()))
    shard = SimpleNamespace(aux_layers=(0, 1, 2))
    runner.set_drafter_shard(shard)
    runner.follow_capture((3, 1), spec=True, tree_nodes=0)
    assert runner.spec_ks == (1, 3)
    assert runner.spec_step.drafter is None and runner.spec_step.aux_layers == ()
    assert runner.drafter is shard and runner.aux_layers == (0, 1, 2)
    assert runner.graphs is None  # none on the CPU, and the ranks agreed on none
    runner.follow_capture((), spec=True, tree_nodes=5)
    assert runner.spec_step is None and runner.spec_ks == (5,)
    assert runner.drafter is shard and runner.aux_layers == (0, 1, 2)


def test_every_rank_plans_the_same_captures_from_the_capture_header():
    """Rank 0's speculative step (draft lengths 1, 3) and the one a rank > 0 builds from the
    CAPTURE header list the same graphs; trees under tensor parallelism capture none."""
    wire = Wire()
    ks = (1, 3)
    tp_channel.StepSender(wire).capture(ks, spec=True, tree_nodes=0)
    op, spec, mask, tree, nodes = _header(wire)[:5]
    assert (op, spec, tree, nodes) == (tp_channel.CAPTURE, 1, 0, 0)
    assert tp_channel.ks_from_mask(mask) == ks
    steps = [_spec_step(wire), _spec_step(TPGroup(rank=1, size=2, group=object()))]
    rank0 = tp_graphs.plan(_graph_runner(wire), steps[0].graphs, ks)
    other = TPGroup(rank=1, size=2, group=object())
    mine = tp_graphs.plan(_graph_runner(other), steps[1].graphs, tp_channel.ks_from_mask(mask))
    assert mine == rank0
    assert rank0[0] == ("target", "verify", 4, 3) and rank0[-1] == ("verify", 1, 1)
    tree = _spec_step(other, tree=TreeShape(3, 2, 2))
    assert tp_graphs.plan(_graph_runner(other), tree.graphs, (3,)) == mine[:6]
    with pytest.raises(ValueError, match="num_draft_tokens <= 62"):
        tp_channel.ks_mask((4, 63))


def test_ranks_that_would_capture_different_graphs_all_stop():
    keys = [("target", "decode", 4, 1)]
    fingerprint = __import__("zlib").crc32(repr(keys).encode())
    tp_graphs.agree(OtherRank(fingerprint), keys)  # the same: no error
    with pytest.raises(RuntimeError, match="do not agree.*cuda_graphs=False"):
        tp_graphs.agree(OtherRank(fingerprint + 1), keys)


def test_a_capture_counts_nothing_and_each_replay_counts_its_collectives():
    tp = TPGroup(rank=0, size=2, group=object(), forward_mode=current_mode)
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(ForwardMode.DECODE, empty, empty, empty, empty.view(0, 0), [], [])
    with tp.recording() as recorded:
        with forward_context(ForwardContext(meta, None)):
            for _ in range(2 * LAYERS + 1):
                tp._count("all_reduce", 64)
        tp._count("all_gather", 128)  # the LM head, after the forward: its mode still
    assert tp.counts() == {}
    assert recorded == {
        "decode": {
            "all_reduce": {"calls": 7, "bytes": 448},
            "all_gather": {"calls": 1, "bytes": 128},
        }
    }
    for _ in range(3):
        tp.add_counts(recorded, "verify")
    assert tp.counts() == {
        "verify": {
            "all_reduce": {"calls": 21, "bytes": 1344},
            "all_gather": {"calls": 3, "bytes": 384},
        }
    }
    tp._count("all_gather", 128)  # outside any forward: the replayed forward's mode
    assert tp.counts()["verify"]["all_gather"]["calls"] == 4
