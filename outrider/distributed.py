"""The tensor-parallel group and the one place its collectives run.

A `TPGroup` is what a parallel layer holds: this process's rank, the group's size, and the
collectives every parallel layer calls (all_reduce, all_gather, broadcast). Each call is
counted, with its bytes, under the mode of the forward it ran in, so /metrics and the planner
see what a decode, verify, prefill or draft forward moves across the link. The group learns
which forward is running from `forward_mode`, a function its builder hands in: the forward
context lives in layers/, above this module, and the executor's start-up
(executor/tp_workers.py `init_tensor_parallel`) hands in the context's `current_mode`.

Bytes follow the planner's convention (outrider/plan/costmodel.py): an all-reduce counts each
rank's buffer, an all-gather the gathered output, a broadcast the buffer.

A group of size 1 needs no torch.distributed: its collectives return their input and count
nothing, so a model built for one rank runs exactly as it did before tensor parallelism.

Captured CUDA graphs replay their collectives without running this Python, so a capture (and
the warm-up forwards before it) counts into a record of its own (`recording`), not the group's
counts, and every replay adds that record (`add_counts`): a replayed forward counts what it
runs, exactly as an eager one does, and capturing counts nothing.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from outrider.core import ForwardMode

# Outside any forward before the first one (weight broadcasts, start-up checks).
OTHER = "other"


def _outside_forward() -> ForwardMode | None:
    """The `forward_mode` of a group told nothing about forwards: none is ever running, so a
    collective counts under its explicit `mode`, `counting_as`'s, or the last one counted."""
    return None


@dataclass
class TPGroup:
    """One tensor-parallel group as the layers see it: this process's rank, the group's size,
    and counted collectives over `group` (a torch.distributed ProcessGroup; None for size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    # A gloo group over the same ranks for host-side control (the step header rank 0 sends,
    # start-up agreement): CPU tensors, and no time limit, since the other ranks wait there
    # between requests for as long as the engine is idle. None: `group` serves (tests).
    control: Any = None
    # Whether init_tensor_parallel started torch.distributed for this group (close() ends it).
    owns_process_group: bool = False
    # The mode of the forward running now, None outside one: collectives count under it.
    forward_mode: Callable[[], ForwardMode | None] = field(default=_outside_forward, repr=False)
    # mode -> collective -> {"calls": n, "bytes": b}
    _counts: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict, repr=False)
    _last_mode: str = field(default=OTHER, repr=False)
    _counting_as: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"tensor-parallel rank {self.rank} of size {self.size} is out of range: "
                "a rank is in [0, size)"
            )
        if self.size > 1 and self.group is None:
            raise ValueError(
                f"a tensor-parallel group of size {self.size} needs a process group: build it "
                "with init_tensor_parallel()"
            )

    @property
    def is_single(self) -> bool:
        return self.size == 1

    # --- collectives -------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it. Size 1: `x` untouched."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._count("all_reduce", x.numel() * x.element_size())
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order (the same on every rank)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self._count("all_gather", x.numel() * x.element_size() * self.size)
        if x.is_cuda:  # NCCL: one output buffer, no flattening copies (and capturable)
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(
        self, x: torch.Tensor, src: int = 0, *, mode: str | None = None, control: bool = False
    ) -> torch.Tensor:
        """Rank `src`'s `x` on every rank, written in place; returns it. `mode`: count it under
        that forward mode (a step's inputs, sent before its forward opens); `control`: over the
        control group (a CPU tensor)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._count("broadcast", x.numel() * x.element_size(), mode)
        group = self.control if control and self.control is not None else self.group
        dist.broadcast(x, src=src, group=group)
        return x

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks: each rank's memory differs, the
        block manager's count must fit them all). Over the control group; counted as "other"."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        x = torch.tensor([value], dtype=torch.int64)
        self._count("all_reduce", 8, OTHER)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.control or self.group)
        return int(x.item())

    def agree_same(self, value: int) -> bool:
        """Whether every rank passed the same `value` (the same answer on every rank, so they
        all go on or all stop). Two all-reduces over the control group, counted as "other"."""
        if self.size == 1:
            return True
        return self.agree_min(value) == -self.agree_min(-value)

    def warm_up(self, device: torch.device) -> None:
        """One eager all-reduce on `device`, waited for: NCCL creates a group's communicator at
        its first collective, and a collective first met inside a CUDA graph capture would
        create it there, where nothing runs. Call before capturing. Counted as "other"."""
        if self.size == 1:
            return
        import torch.distributed as dist

        x = torch.zeros(1, device=device)
        self._count("all_reduce", x.element_size(), OTHER)
        dist.all_reduce(x, group=self.group)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    # --- counts ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, dict[str, dict[str, int]]]]:
        """Collectives run inside count into the yielded {mode: {collective: {"calls",
        "bytes"}}}, not the group's counts: a graph's capture and its warm-up forwards serve no
        request, and what the capture ran is added at each replay (add_counts). Does not
        nest."""
        saved, last = self._counts, self._last_mode
        self._counts = recorded = {}
        try:
            yield recorded
        finally:
            self._counts, self._last_mode = saved, last

    def add_counts(self, recorded: dict[str, dict[str, dict[str, int]]], mode: str) -> None:
        """A replayed graph ran `recorded`'s collectives (what `recording` saw at its capture),
        for a forward of `mode`: they count under it, and so do collectives after it outside a
        graph (the LM head's all-gather), as after an eager forward. A few dict updates."""
        for ops in recorded.values():
            for op, c in ops.items():
                self._count(op, c["bytes"], mode, calls=c["calls"])
        if mode != OTHER:
            self._last_mode = mode

    @contextlib.contextmanager
    def counting_as(self, mode: str) -> Iterator[None]:
        """Count the collectives inside under `mode` whatever forward context they run in: a
        sharded drafter's forwards run under prefill, verify or draft attention metadata (what
        the backend needs), and all of them are draft collectives. Not nestable."""
        if self._counting_as is not None:
            raise RuntimeError(f"counting_as({mode!r}) inside counting_as({self._counting_as!r})")
        self._counting_as = mode
        try:
            yield
        finally:
            self._counting_as = None

    def _count(self, op: str, nbytes: int, mode: str | None = None, calls: int = 1) -> None:
        mode = mode or self._counting_as
        # A forward's logits are computed just after it, outside its forward context (the
        # runner's run() and the speculative step do so): collectives outside a forward count
        # under the mode of the last forward this group saw.
        if mode is None:
            current = self.forward_mode()
            key = self._last_mode if current is None else current.value
        else:
            key = mode
        if key != OTHER:
            self._last_mode = key
        slot = self._counts.setdefault(key, {}).setdefault(op, {"calls": 0, "bytes": 0})
        slot["calls"] += calls
        slot["bytes"] += nbytes

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """A snapshot: {mode: {collective: {"calls": n, "bytes": b}}}, modes as ForwardMode
        values ("decode", "verify", "prefill", "draft") or "other"."""
        return copy.deepcopy(self._counts)

    def reset_counts(self) -> None:
        self._counts.clear()
        self._last_mode = OTHER

    def close(self) -> None:
        """End torch.distributed if this group started it."""
        if self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_process_group = False


def single() -> TPGroup:
    """The group of one rank: no torch.distributed, collectives are the identity."""
    return TPGroup()


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: its share, or one replicated head when there are fewer KV heads
    than ranks."""
    return max(1, num_kv_heads // tp_size)
