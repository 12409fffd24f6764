"""Capturing the same CUDA graphs on every rank of a tensor-parallel group.

A graph's all-reduces are NCCL collectives recorded at capture: replayed, each meets the same
collective in the other ranks' replays only if every rank captured the same graphs with the
same shapes in the same order. The eager warm-up forwards before each capture run their
collectives for real, so those must pair up as well. So, at every capture (engine start, and
again when the engine changes proposer):

1. rank 0 sends CAPTURE with its speculative step's settings (draft lengths, trees); the other
   ranks build the same step, without a drafter, and the same GraphRunner from the same config
   (ModelRunner.capture_graphs on rank 0, ModelRunner.follow_capture on the others);
2. every rank lists the keys it is about to capture and the ranks agree on that list over the
   control group (gloo, on the host): ranks that differ all stop, with an error, before any
   NCCL traffic, instead of pairing mismatched collectives and hanging (`agree_on_captures`);
3. one eager all-reduce creates NCCL's communicator outside any capture (the same);
4. every rank captures: the runner's graphs largest first, then the speculative step's.

Rank 0 alone captures the drafter's graphs (the speculative step's graph 2, the drafter's DRAFT
graphs): the drafter runs on rank 0 as a group of one and reduces nothing, so nothing pairs.

At each step rank 0 names the graph it replays in the step's header (tp_channel.py) and the
other ranks replay the same one on the inputs it broadcast.
"""

from __future__ import annotations

import logging
import zlib

import torch

from outrider.distributed import TPGroup
from outrider.executor.cuda_graph import GraphRunner
from outrider.executor.spec_graphs import SpecGraphs

log = logging.getLogger(__name__)


def plan(
    graphs: GraphRunner | None, spec_graphs: SpecGraphs | None, ks: tuple[int, ...]
) -> list[tuple]:
    """Every graph a rank is about to capture, in order, as plain tuples: ("target", mode,
    padded batch, tokens per sequence) then ("verify", padded batch, k)."""
    if graphs is None:
        return []
    keys: list[tuple] = [
        ("target", k.mode.value, k.batch, k.tokens_per_seq) for k in graphs.capture_keys()
    ]
    if spec_graphs is not None:
        keys += [("verify", b, k) for b, k in spec_graphs.keys(ks)]
    return keys


def agree(tp: TPGroup, keys: list[tuple]) -> None:
    """Raise on every rank unless every rank is about to capture `keys`."""
    fingerprint = zlib.crc32(repr(keys).encode())  # stable across processes, unlike hash()
    if not tp.agree_same(fingerprint):
        raise RuntimeError(
            f"tensor-parallel rank {tp.rank} would capture {len(keys)} CUDA graphs, but the "
            "ranks do not agree on which (their configs or devices differ): start every rank "
            "with the same settings, or run with cuda_graphs=False (--enforce-eager)"
        )


def agree_on_captures(
    tp: TPGroup,
    graphs: GraphRunner | None,
    spec_graphs: SpecGraphs | None,
    ks: tuple[int, ...],
    device: torch.device,
) -> None:
    """Steps 2 and 3 on every rank of several, before any capture: the ranks agree on the graphs
    `graphs` and `spec_graphs` (None: none) are about to capture at draft lengths `ks`, and
    NCCL's communicator is created if there are any. Nothing on one rank."""
    if tp.size == 1:
        return
    keys = plan(graphs, spec_graphs, ks)
    agree(tp, keys)
    if keys:
        tp.warm_up(device)
        log.info(
            "tensor parallelism: rank %d captures %d CUDA graphs (every rank the same); "
            "drafter graphs are rank 0's alone",
            tp.rank,
            len(keys),
        )
