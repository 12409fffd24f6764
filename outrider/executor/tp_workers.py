"""Starting the ranks of a tensor-parallel engine, and noticing when one dies.

Two ways in, one code path after them:
- one machine, no launcher: rank 0 (the process that builds the engine) spawns ranks
  1..N-1 with torch.multiprocessing, each opening the same checkpoint and joining over
  127.0.0.1 (gloo on CPU, NCCL on CUDA, GPU i for rank i);
- torchrun (`--nnodes`, `--node-rank`, `--nproc-per-node`): every rank runs the same command;
  torch.distributed joins from torchrun's environment, and ranks > 0 never return from the
  engine's constructor: they follow rank 0 (tp_channel.worker_loop) and exit when it stops.

A rank that dies breaks its connections, and the collective rank 0 is in raises at once
(gloo; NCCL after the collective timeout); the watchdog here also polls the processes rank 0
spawned and, when one has ended, names it: the engine's next step raises `RankDied` with that
rank and its exit code, and if rank 0 stays blocked in a collective that never returns (a
rank gone without closing its connections) the watchdog ends the process after a grace period,
so nothing hangs. Spawned ranks end themselves when rank 0's process goes away.

Every rank joins torch.distributed through `init_tensor_parallel` (NCCL on CUDA, gloo on CPU),
which builds the process's TPGroup and hands it the forward context's mode to count its
collectives under.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from outrider import env
from outrider.config import EngineConfig
from outrider.distributed import TPGroup, single
from outrider.layers.forward_context import current_mode

if TYPE_CHECKING:  # both are imported where a rank is started, not with this module
    from outrider.executor.model_runner import ModelRunner
    from outrider.loaders.checkpoint import Checkpoint

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the watchdog looks at the spawned ranks
GRACE_S = 10.0  # how long a dead rank's error may take to surface before the process ends


class RankDied(RuntimeError):
    """A tensor-parallel rank's process ended while the engine ran."""


@dataclass
class Ranks:
    """This process's place in a tensor-parallel engine: its group, and on rank 0 of a job it
    spawned, the other ranks' processes and their watchdog."""

    tp: TPGroup
    procs: list[Any] = field(default_factory=list)
    failure: str | None = None
    _closing: bool = False
    _watchdog: threading.Thread | None = None

    def start_watchdog(self) -> None:
        if self.procs:
            self._watchdog = threading.Thread(
                target=self._watch, name="outrider-tp-watchdog", daemon=True
            )
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._closing:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and not self._closing:
                    self.failure = (
                        f"tensor-parallel rank {rank} (pid {p.pid}) died with exit code "
                        f"{p.exitcode}: the engine cannot continue without it; see that "
                        "rank's log above for the cause (out of memory, a crash, a kill), "
                        "then restart"
                    )
                    log.error("%s", self.failure)
                    deadline = time.monotonic() + GRACE_S
                    while time.monotonic() < deadline and not self._closing:
                        time.sleep(POLL_S)
                    if not self._closing:  # rank 0 is stuck in a collective: end it
                        print(f"outrider: {self.failure}", file=sys.stderr, flush=True)
                        os._exit(1)
                    return
            time.sleep(POLL_S)

    def explain(self, error: BaseException) -> RankDied | None:
        """A step failed with `error` under tensor parallelism: the RankDied to raise, naming
        the rank that died when it was one this process spawned (its exit may take a moment
        to show), the collective's own error when a collective failed otherwise; the other
        ranks are ended then. None when neither (an error of rank 0's own)."""
        for p in self.procs:
            p.join(timeout=2.0 / len(self.procs))
        died = [(r, p) for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        if not died and self.failure is None and not _collective_error(error):
            return None
        if self.failure is None and died:
            rank, p = died[0]
            self.failure = (
                f"tensor-parallel rank {rank} (pid {p.pid}) died with exit code {p.exitcode}: "
                "the engine cannot continue without it; see that rank's log for the cause "
                "(out of memory, a crash, a kill), then restart"
            )
        message = self.failure or (
            f"a tensor-parallel collective failed ({error}): a rank has probably died or "
            "lost its connection; check every rank's log (torchrun prints which one ended), "
            "then restart"
        )
        self.failure = message
        self.close()
        return RankDied(message)

    def close(self, runner: ModelRunner | None = None) -> None:
        """Stop the other ranks (rank 0 sends them STOP through `runner`; after a failure the
        spawned ones are terminated), wait for spawned ones, end torch.distributed."""
        if self._closing:
            return
        self._closing = True
        if runner is not None and self.failure is None:
            try:
                runner.shutdown()
            except Exception as e:  # a rank already gone: nothing left to stop
                log.warning("tensor-parallel shutdown: %s", e)
        for p in self.procs:
            # A stopped rank exits promptly; a loaded machine (tests sharing two cores) can slow
            # its teardown, and a rank terminated here would read as one that failed.
            p.join(timeout=30 if self.failure is None else 0.1)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)
        self.tp.close()


def start_ranks(config: EngineConfig, model_path: str | None) -> Ranks:
    """This process's tensor-parallel group, starting the other ranks when no launcher did.
    model_path: the checkpoint every rank opens (None: the default model)."""
    size = config.parallel.tensor_parallel_size
    timeout = config.parallel.collective_timeout_s
    world = env.world_size()
    if size > 1 and world > 1:
        # torchrun (or a launcher like it) started every rank: join from its environment;
        # init_tensor_parallel names the fix when the world size differs from `size`. (A
        # one-rank engine under torchrun is some data-parallel job's own: it stays alone.)
        device = rank_device(config, env.local_rank())
        tp = init_tensor_parallel(size, device=device, timeout_s=timeout)
        return Ranks(tp)
    if size == 1:
        return Ranks(single())
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_spawned_rank,
            args=(rank, size, port, config, model_path, os.getpid()),
            name=f"outrider-tp-rank{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for p in procs:
        p.start()
    ranks = Ranks(single(), procs)
    ranks.start_watchdog()
    try:
        ranks.tp = init_tensor_parallel(
            size, rank=0, world_size=size, master_addr="127.0.0.1", master_port=port,
            device=rank_device(config, 0), timeout_s=timeout,
        )  # fmt: skip
    except Exception as e:
        died = ranks.explain(e) if any(p.exitcode is not None for p in procs) else None
        ranks.close()
        if died is not None:
            raise died from e
        raise
    return ranks


def init_tensor_parallel(
    tp_size: int | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    device: str | torch.device = "cpu",
    timeout_s: float = 300.0,
) -> TPGroup:
    """This process's tensor-parallel group. Unset arguments come from torchrun's environment
    (one process outside torchrun). tp_size None means the whole world; tensor parallelism
    spans every process of the job. On CUDA the process's device becomes cuda:local_rank.
    timeout_s bounds joining and each collective of the tensor-parallel group. The group's
    collectives count under the mode of the forward context they run in."""
    world = env.world_size() if world_size is None else world_size
    rank = env.rank() if rank is None else rank
    tp_size = world if tp_size is None else tp_size
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size}: use 1 or more")
    if tp_size != world:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not match the world size {world}: start "
            f"{tp_size} processes (torchrun --nnodes N --nproc-per-node M with N x M = "
            f"{tp_size}), or set tensor_parallel_size={world}"
        )
    if world == 1:
        return single()
    device = torch.device(device)
    import torch.distributed as dist

    if dist.is_initialized():  # a launcher (or the trainer) already joined the job
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is already running as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world}: pass the same rank "
                "and world size, or leave them unset"
            )
        return TPGroup(
            rank, world, dist.group.WORLD, control=_control_group(), forward_mode=current_mode
        )
    addr = master_addr or env.master_addr()
    port = master_port or env.master_port()
    if addr is None or port is None:
        raise ValueError(
            f"rank {rank} of {world} has no rendezvous address (MASTER_ADDR={addr}, "
            f"MASTER_PORT={port}): launch with torchrun, or pass master_addr and master_port"
        )
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank() if local_rank is None else local_rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TPGroup(
        rank, world, dist.group.WORLD, control=_control_group(), owns_process_group=True,
        forward_mode=current_mode,
    )  # fmt: skip


# How long a rank waits on the control group: the engine may sit idle between requests for any
# time, and a rank whose process ends breaks the connection at once (gloo raises), so the wait
# needs no limit of its own.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


def _control_group() -> Any:
    """A gloo group over the whole world, for CPU control tensors (every rank calls this at the
    same point: creating a group is collective)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)


def _collective_error(error: BaseException) -> bool:
    """Whether `error` came out of torch.distributed (gloo and NCCL raise plain RuntimeErrors
    that name their transport)."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(w in text for w in ("gloo", "nccl", "connection closed", "timed out"))


def run_worker(config: EngineConfig, checkpoint: Checkpoint, tp: TPGroup) -> None:
    """A rank > 0: its shard of the model and its KV slice, following rank 0 until it stops."""
    from outrider.executor.model_runner import ModelRunner
    from outrider.executor.tp_channel import worker_loop

    runner = ModelRunner(config, checkpoint, tp=tp)
    shard_drafter(config, runner, checkpoint)  # draft_tensor_parallel_size > 1 only
    worker_loop(runner)


def cpu_threads(size: int) -> int:
    """Torch threads per rank when the ranks share this machine's CPU cores."""
    if env.num_threads() > 0:
        return env.num_threads()
    return max(1, (os.cpu_count() or 1) // size)


def _spawned_rank(
    rank: int, size: int, port: int, config: EngineConfig, model_path: str | None, parent: int
) -> None:
    from outrider.loaders.checkpoint import open_checkpoint

    logging.basicConfig(level=env.log_level(), format=f"[rank {rank}] %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    device = rank_device(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(size))
    tp = init_tensor_parallel(
        size, rank=rank, world_size=size, master_addr="127.0.0.1", master_port=port,
        local_rank=rank, device=device, timeout_s=config.parallel.collective_timeout_s,
    )  # fmt: skip
    try:
        run_worker(config, open_checkpoint(model_path), tp)
    finally:
        tp.close()
    leave_process(0)


def leave_process(code: int = 0) -> NoReturn:
    """End a process that joined a tensor-parallel group, after its clean stop, without the
    interpreter's teardown: C++ destructors there aborted processes that had finished their
    work ("terminate called without an active exception", exit code -6), a spawned rank and a
    torchrun rank 0 alike, about once in 20 two-rank runs on a loaded machine. Output is
    flushed first; nothing else is left to run in such a process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent: int) -> None:
    """A spawned rank outlives nothing: when rank 0's process is gone, end this one."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    from outrider.device import resolve_device

    device = resolve_device(config.model.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_drafter(config: EngineConfig, runner: ModelRunner, checkpoint: Checkpoint) -> None:
    """On a rank > 0 of an engine whose drafter is split over the ranks: this rank's shard,
    loaded as rank 0 loads its own (executor/drafter.py), its aux streams kept by every target
    forward. Nothing otherwise."""
    spec = config.speculative
    if spec.method != "eagle3" or spec.draft_tensor_parallel_size == 1:
        return
    from outrider.executor.drafter import build_eagle3_drafter  # torch-heavy: lazily

    runner.set_drafter_shard(build_eagle3_drafter(spec, runner, checkpoint))
    log.info("rank %d: EAGLE-3 drafter shard, following rank 0's draft ops", runner.tp.rank)
