"""One rank of `outrider bench comm`: joins the group the way the engine does
(`init_tensor_parallel`: gloo on CPU, NCCL on CUDA), times the engine's own counted collectives
(TPGroup.all_reduce, TPGroup.all_gather) at each size, and rank 0 writes what every rank saw.

    python -m outrider.bench.comm_rank SPEC.json RANK

SPEC.json (written by bench/comm.py): world_size, master_addr, master_port, device, dtype,
all_reduce and all_gather sizes in bytes (an all-reduce's buffer on each rank, an all-gather's
gathered output: the planner's convention), warmup, iters, trials, out (rank 0's result file).
The NCCL settings under test arrive as this process's environment, which NCCL reads itself.

A size's time is `iters` back-to-back calls divided by `iters` (as nccl-tests times them), the
device synchronized around them; of `trials` such runs the median, and of the ranks the
slowest, since a collective ends when its last rank does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from outrider.executor.tp_workers import init_tensor_parallel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU-GPU sync point: the timer must see the kernels end


def _time_us(op, device: torch.device, warmup: int, iters: int, trials: int, barrier) -> float:
    for _ in range(warmup):
        op()
    runs = []
    for _ in range(trials):
        _sync(device)
        barrier()  # every rank starts the run together
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        _sync(device)
        runs.append((time.perf_counter() - t0) * 1e6 / iters)
    return sorted(runs)[len(runs) // 2]


def measure(spec: dict, rank: int) -> dict | None:
    """Run this rank's part; rank 0 returns {"all_reduce": [[bytes, us], ...], "all_gather":
    [...], "backend": ..., "device_name": ...}, the others None."""
    world = spec["world_size"]
    device = torch.device(spec["device"] if spec["device"] == "cpu" else f"cuda:{rank}")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    tp = init_tensor_parallel(
        world, rank=rank, world_size=world, local_rank=rank, device=device,
        master_addr=spec["master_addr"], master_port=spec["master_port"], timeout_s=120,
    )  # fmt: skip
    import torch.distributed as dist

    dtype = DTYPES[spec["dtype"]]
    elem = torch.tensor([], dtype=dtype).element_size()
    args = (device, spec["warmup"], spec["iters"], spec["trials"], dist.barrier)
    out: dict = {"all_reduce": [], "all_gather": []}
    try:
        for nbytes in spec["all_reduce"]:
            # Zeros: summed again and again they stay finite, whatever the dtype.
            x = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=device)
            us = _time_us(lambda x=x: tp.all_reduce(x), *args)
            out["all_reduce"].append([x.numel() * elem, us])
        for nbytes in spec["all_gather"]:
            x = torch.zeros(max(1, nbytes // (elem * world)), dtype=dtype, device=device)
            us = _time_us(lambda x=x: tp.all_gather(x), *args)
            out["all_gather"].append([x.numel() * elem * world, us])
        # The slowest rank's time: a collective ends when its last rank does.
        for kind in ("all_reduce", "all_gather"):
            t = torch.tensor([us for _, us in out[kind]], dtype=torch.float64, device=device)
            if t.numel():
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                out[kind] = [[b, float(us)] for (b, _), us in zip(out[kind], t.tolist())]
    finally:
        tp.close()
    if rank != 0:
        return None
    out["backend"] = "nccl" if device.type == "cuda" else "gloo"
    out["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    result = measure(spec, rank)
    if result is not None:
        Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
