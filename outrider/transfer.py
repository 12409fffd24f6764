"""Host <-> device copies that never wait on the stream: shared by the executor, the engine's
steps run ahead and the speculative algorithms (which import nothing from the executor)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def to_device_no_sync(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a device tensor without waiting on the stream: a pageable host->GPU copy
    synchronises, a pinned non-blocking one does not."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


_ALIGN = 16  # bytes: each packed part starts where a kernel's pointer may assume alignment
_NP = {torch.int64: np.int64, torch.int32: np.int32}


def to_device_packed(parts, device: torch.device) -> list[torch.Tensor]:
    """[(values, dtype)] (int64 or int32; a list, nested lists of one length, or an array) ->
    device tensors in those dtypes and shapes, through one pinned host buffer and one copy
    (to_device_no_sync costs a pinned allocation and a copy each: ~15 us of host time apiece,
    seven a step for build_inputs). Each tensor is a view of one fresh device buffer, its part
    starting 16-byte aligned; nothing is reused, so a step's inputs may be held as long as
    wanted. Never waits on the stream."""
    arrays = [np.asarray(v, dtype=_NP[dt]) for v, dt in parts]
    starts, total = [], 0
    for a in arrays:
        starts.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    cuda = device.type == "cuda"
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=cuda)
    raw = host.numpy()
    for a, start in zip(arrays, starts):
        raw[start : start + a.nbytes].view(a.dtype)[:] = a.reshape(-1)
    buf = host if device.type == "cpu" else host.to(device, non_blocking=cuda)
    return [
        buf[start : start + a.nbytes].view(dt).view(a.shape)
        for a, start, (_, dt) in zip(arrays, starts, parts)
    ]


class StagedUpload:
    """Many small int64 host arrays -> the device in one copy: packed into one pinned host
    buffer, copied once, handed back as views of one device buffer. A step's inputs cost one
    transfer instead of a pinned allocation and a copy each (~15 us of host time apiece).

    The pinned buffer is rewritten only after the copy that last read it has run (an event):
    callers need not sync. Buffers grow, never shrink."""

    def __init__(self, device: torch.device, capacity: int = 4096) -> None:
        self.device = device
        self._done = torch.cuda.Event() if device.type == "cuda" else None
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=cuda)
        self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device) if cuda else None

    def send(self, parts) -> list[torch.Tensor]:
        """parts: NumPy int arrays (any shape) -> int64 device tensors of the same shapes, views
        of one buffer valid until the next send."""
        sizes = [p.size for p in parts]
        total = sum(sizes)
        if self._done is not None:
            self._done.synchronize()  # the last copy has read the host buffer
        if total > self._host.numel():
            self._alloc(max(total, 2 * self._host.numel()))
        host = self._host.numpy()
        off = 0
        for p, n in zip(parts, sizes):
            host[off : off + n] = p.reshape(-1)
            off += n
        if self._dev is None:  # the CPU: the host buffer is the device's
            buf = self._host[:total]
        else:
            buf = self._dev[:total]
            buf.copy_(self._host[:total], non_blocking=True)
            self._done.record()
        out, off = [], 0
        for p, n in zip(parts, sizes):
            out.append(buf[off : off + n].view(p.shape))
            off += n
        return out


class HostCopy:
    """A device tensor on its way to the host. On CUDA the copy into pinned memory is queued
    now, where the stream stands, and an event marks it: `tolist` then waits for the work
    queued before it alone, not for steps launched since (a plain `.tolist()` after the next
    step's launch would queue its copy behind that step and wait for it too). On the CPU the
    tensor is the host's."""

    def __init__(self, t: torch.Tensor) -> None:
        self.device = t
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> torch.Tensor:
        """The values on the host, once the work queued before the copy has run."""
        if self.event is None:
            return self.device
        self.event.synchronize()  # CPU-GPU sync point: this copy and what was queued before it
        return self.host

    def tolist(self) -> list:
        return self.wait().tolist()


_SIDE: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device, made on first use


@contextlib.contextmanager
def beside(after: torch.cuda.Event | None) -> Iterator[None]:
    """Work queued inside runs on a side stream of the current device, after the work `after`
    marks alone, not behind what the main stream was given since (a step launched ahead): a
    read inside waits for that work, not for the step. None: the current stream, as is (the
    CPU, or nothing in flight)."""
    if after is None:
        yield
        return
    device = torch.device("cuda", torch.cuda.current_device())
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE[device] = torch.cuda.Stream(device)
    stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield
