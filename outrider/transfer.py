"""Host -> device copies that never wait on the stream: shared by the executor and the
speculative algorithms (which import nothing from the executor)."""

from __future__ import annotations

import torch


def to_device_no_sync(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values -> a device tensor without waiting on the stream: a pageable host->GPU copy
    synchronises, a pinned non-blocking one does not."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
