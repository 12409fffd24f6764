"""The machine, as the planner sees it: what a GPU streams and computes per second, and what a
collective costs on the link between GPUs. Plain data; built-in tables with their sources, or
measured figures from a JSON file.

Collectives (n ranks, S bytes per rank's buffer), an alpha-beta model per algorithm:

    ring all-reduce   t = base + 2(n-1) * step + 2(n-1)/n * S / bus      (NCCL's ring; LL
                                                                        or Simple protocol)
    ring all-gather   t = base +  (n-1) * step +  (n-1)/n * S_out / bus
    one-shot          t = base + (n-1) * S / bus   (custom all-reduce: every rank reads its
                                                    peers' buffers; needs P2P or NVLink)

`step` is one hop's latency (a flag seen across the link), `bus` the bandwidth one rank moves
data at. The cheaper algorithm the link supports is taken, as NCCL's tuner and the engines'
custom all-reduce dispatch do, unless one is pinned.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Gpu:
    """Peak figures from the vendor's datasheet (dense tensor FLOP/s, no sparsity) and the
    fractions of them real kernels reach."""

    name: str
    mem_gbs: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense; 0: no fp8 tensor cores (fp8 weights compute in bf16)
    memory_gb: float
    sms: int = 0  # streaming multiprocessors: GEMM tiles run in waves of this many (0: no waves)
    # Fraction of peak bandwidth a weight-streaming GEMV or MoE kernel reaches: 80-90% on
    # HBM parts (Llama-3.1-8B decode on the H200 measures 77% of peak for the whole step,
    # launches included: benchmarks/results/verify_cost.json).
    mem_efficiency: float = 0.85
    # Packed INT4 (W4A16) expert bytes one SM unpacks and multiplies a second, GB/s: the grouped
    # GEMM that reads them is bound by unpacking where the memory would feed it faster. On the
    # H200 moe_fused.moe_gemm streams Kimi-K2.5's experts at 25-32% of copy bandwidth from 1
    # to 64 tokens (benchmarks/results/moe_gemm_tiles.json): 27% of 4.8 TB/s over 132 SMs.
    # INT4 experts' blocks (moe_block_gbs_per_sm) stream at no more than this times the SMs: an
    # RTX PRO 6000's 188 SMs keep up with its 1.8 TB/s. Measured on the H200 only.
    int4_unpack_gbs_per_sm: float = 9.8
    # The same for moe_fused.moe_gemv, which runs INT4 products of few rows (at most 128) one
    # GEMV a row on the CUDA cores, each row taking in its own expert's packed bytes: on the
    # H100 Kimi-K2.5's experts at 1, 4 and 16 tokens stream at 1.8-2.4 TB/s of them
    # (benchmarks/results/moe_gemm_tiles_gemv_h100.json, 60-68% of copy bandwidth): 14-18 GB/s
    # an SM. The H200's die is the H100's; other GPUs are unmeasured.
    int4_gemv_gbs_per_sm: float = 16.0
    # Other experts' bytes one SM takes into the grouped GEMM's blocks a second, GB/s:
    # moe_fused.moe_gemm reads an expert's weights once per block of its rows, memory serving the
    # first and L2 the rest (an expert's blocks run together), so where experts hold several
    # blocks the SMs' intake bounds the GEMM, not the memory. Fitted on the H100 to Moonlight's
    # verify of 64 x 8 tokens, 3.5 blocks an expert, whose device time its memory's rate left 8
    # ms short (benchmarks/results/moe_gpu_h100.json): 6.6 TB/s over 132 SMs. The H200's die
    # is the H100's; other GPUs are unmeasured.
    moe_block_gbs_per_sm: float = 50.0
    # Fraction of dense peak a bf16 GEMM reaches at the shapes of decode and verify (tens to
    # thousands of rows): 60-75% (cuBLAS at large shapes reaches ~75-80%).
    compute_efficiency: float = 0.65
    # What a kernel costs beyond its bytes or FLOPs, added to them (plan/costmodel.py): a GEMM's
    # and any other kernel's. The H200's decode graphs, profiled per kernel: cuBLAS GEMVs take
    # their bytes at ~85% of the bandwidth plus ~3.3 us (Llama-3.1-8B's gate/up projection
    # 60.4 us for 235 MB, the default model's 0.6 MB projections 3.7-3.9 us); norms, rotary,
    # the KV write and activations 1.1-2.5 us (benchmarks/results/plan_accuracy.json).
    gemm_overhead_us: float = 3.3
    kernel_overhead_us: float = 1.5
    # The host's own work in one engine step (inputs, the graph launch, the read back), paid
    # once a step where nothing overlaps it. 0: an engine that prepares step N + 1 while step N
    # runs hides it (the published figures' engines); outrider's synchronous speculative step
    # pays ~0.2-0.4 ms on the H200's host, which `outrider plan --calibrate` measures.
    step_host_us: float = 0.0
    # and each sequence's share of it (its block table, its slice of the read back: ~3.5 us a
    # row on the H200's host, for both models measured), and each token's (positions, slots,
    # ids). A line in tokens alone fitted the default model's steps and not the 8B's.
    row_host_us: float = 0.0
    token_host_us: float = 0.0
    # Host time to dispatch one kernel in an eager forward (Python, the dispatcher, the launch):
    # HF transformers' eager Llama-3.1-8B decode on this project's H200 host takes ~25 ms for
    # ~1,300 launches, ~19 us each (benchmarks/results/verify_cost.json). A property of the
    # host CPU more than the GPU; `outrider plan --calibrate` measures it with the rest.
    eager_host_us: float = 19.0
    # A GEMM of fewer rows than this runs as one GEMV a row, streaming its weights once a row:
    # MKL's fp32 GEMM on the CPU below 4 rows (the default model's [576 -> 49152] LM head on 2
    # cores: 10.1 ms at 1 row, 23.7 at 2, 35.4 at 3, 16.7 at 4, 16.2 at 8), so a verify of 2-3
    # tokens costs more than one of 4-5. `outrider plan --calibrate` measures it on the CPU.
    # 0: a GEMM reads its weights once whatever its rows (GPUs).
    gemv_rows: int = 0
    # and from those rows on, the weights' cost in one-row GEMVs: MKL packs them before it
    # multiplies (the LM head above: 1.65 at 4-8 rows).
    gemm_weight_reads: float = 1.0

    @property
    def is_cpu(self) -> bool:
        """A host CPU's profile (calibrate.cpu_profile names it "cpu (N threads)"), not a GPU."""
        return self.name.lower().startswith("cpu")

    def __post_init__(self) -> None:
        for f in ("mem_gbs", "bf16_tflops", "memory_gb"):
            if getattr(self, f) <= 0:
                raise ValueError(f"GPU {self.name!r}: {f}={getattr(self, f)} must be > 0")


# Datasheet figures. H100/H200 SXM: 3.35 / 4.8 TB/s HBM3/HBM3e, 989 TFLOP/s bf16 dense, 1979
# fp8. B200 (HGX): 8 TB/s HBM3e, 2.25 PFLOP/s bf16 dense, 4.5 fp8, 180 GB. RTX PRO 6000
# Blackwell: 96 GB GDDR7 at 1.792 TB/s, 4 PFLOP/s fp4 with sparsity -> ~504 bf16 dense, 1008
# fp8. L40S: 48 GB GDDR6 at 864 GB/s, 362 bf16 dense, 733 fp8. A100 SXM 80 GB: 2.04 TB/s
# HBM2e, 312 bf16, no fp8. SMs: H100/H200 SXM 132, B200 148 (per die pair as one device), RTX
# PRO 6000 Blackwell 188, L40S 142, A100 108.
GPUS = {
    "h200": Gpu("H200", 4800, 989, 1979, 141, 132),
    "h100": Gpu("H100", 3350, 989, 1979, 80, 132),
    "b200": Gpu("B200", 8000, 2250, 4500, 180, 148),
    "rtx-pro-6000": Gpu("RTX PRO 6000", 1792, 504, 1008, 96, 188),
    "l40s": Gpu("L40S", 864, 362, 733, 48, 142),
    "a100": Gpu("A100", 2039, 312, 0, 80, 108),
}
GPU_ALIASES = {"rtxpro6000": "rtx-pro-6000", "rtx6000": "rtx-pro-6000", "pro6000": "rtx-pro-6000"}


@dataclass(frozen=True)
class Algo:
    """One collective algorithm's alpha-beta figures on a link."""

    base_us: float  # per call: kernel start, buffers' flags
    step_us: float  # per hop of the ring (0 for one-shot)
    bus_gbs: float  # what one rank moves per second


@dataclass(frozen=True)
class Link:
    """The GPUs' interconnect. `algos` maps "ring" (and "oneshot" where peers can read each
    other's memory) to their figures; `measured` holds a measured table instead (see
    `load_link`). `channels` scales the host-memory LL ring's bandwidth (NCCL_MIN_NCHANNELS)."""

    name: str
    algos: dict[str, Algo] = field(default_factory=dict)
    p2p: bool = True
    # Links whose ring bandwidth is set per NCCL channel (through host memory, below): the
    # ring's bus_gbs is per channel and `channels` multiplies it.
    per_channel: bool = False
    channels: int = 2
    measured: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    world_size: int = 0  # the ranks a measured table was taken at (0: any)

    def with_channels(self, channels: int) -> Link:
        if channels < 1:
            raise ValueError(f"invalid NCCL channel count {channels}: use an integer >= 1")
        return dataclasses.replace(self, channels=channels)

    def all_reduce_us(self, nbytes: float, n: int, algo: str | None = None) -> float:
        return self._cost("all_reduce", nbytes, n, algo)

    def all_gather_us(self, out_bytes: float, n: int, algo: str | None = None) -> float:
        return self._cost("all_gather", out_bytes, n, algo)

    def algo_for(self, kind: str, nbytes: float, n: int) -> str:
        """The algorithm `_cost` takes: the cheapest the link supports."""
        if self.measured:
            return "measured"
        return min(self.algos, key=lambda a: self._alpha_beta(kind, a, nbytes, n))

    def _cost(self, kind: str, nbytes: float, n: int, algo: str | None) -> float:
        if n <= 1:
            return 0.0
        if self.measured:
            if self.world_size and n != self.world_size:
                raise ValueError(
                    f"link figures {self.name!r} were measured at {self.world_size} ranks, not "
                    f"{n}: measure at --tp {n} or use a built-in link"
                )
            return _interpolate(self.measured[kind], nbytes)
        if algo is not None and algo not in self.algos:
            raise ValueError(
                f"link {self.name!r} has no {algo!r} all-reduce: use one of {', '.join(self.algos)}"
            )
        return min(self._alpha_beta(kind, a, nbytes, n) for a in ([algo] if algo else self.algos))

    def _alpha_beta(self, kind: str, algo: str, nbytes: float, n: int) -> float:
        a = self.algos[algo]
        bus = a.bus_gbs * (self.channels if self.per_channel and algo == "ring" else 1)
        bus_bytes_per_us = bus * 1e3
        if algo == "oneshot":  # one exchange: base covers its two flag round trips
            moved = (n - 1) * nbytes if kind == "all_reduce" else (n - 1) / n * nbytes
            return a.base_us + moved / bus_bytes_per_us
        hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
        moved = hops / n * nbytes
        return a.base_us + hops * a.step_us + moved / bus_bytes_per_us


# NVLink (H100/H200 NVLink 4, B200 NVLink 5, through NVSwitch): NCCL's tuning tables put an
# NVLink hop at ~0.6 us; nccl-tests on 8-GPU H100 boxes show ~10-15 us for small all-reduces
# and ~360 GB/s ring bus bandwidth at large ones (NVLink 5 doubles the link: 900 GB/s a
# direction). One-shot custom all-reduce (vLLM, SGLang) reads peers over NVLink in ~5-8 us
# at decode sizes.
_NVLINK4 = {"ring": Algo(5.0, 0.6, 360.0), "oneshot": Algo(6.0, 0.0, 400.0)}
_NVLINK5 = {"ring": Algo(5.0, 0.5, 720.0), "oneshot": Algo(5.0, 0.0, 800.0)}
# PCIe with peer-to-peer: NCCL on 16 RTX PRO 6000 (Gen5, P2P) takes ~36 us for a [1, 7168]
# bf16 all-reduce and ~39 us for [12, 7168] (b12x's published TP16 measurements): ~8 us of
# start plus 30 ring hops of ~1 us, bandwidth not yet binding. Gen4 hops are slower (~1.5 us)
# and a x16 Gen4 link carries ~20 GB/s of payload, Gen5 ~40. A one-shot over PCIe P2P (IPC
# all-reduce kernels) pays one exchange, ~10 us.
_PCIE5 = {"ring": Algo(8.0, 1.0, 40.0), "oneshot": Algo(10.0, 0.0, 40.0)}
_PCIE4 = {"ring": Algo(8.0, 1.5, 20.0), "oneshot": Algo(12.0, 0.0, 20.0)}
# PCIe without P2P (P2P off or unsupported): NCCL's ring goes through host memory (its SHM
# transport), one channel being one thread block that polls 16-byte LL lines in pinned host
# memory, so each channel's throughput is set by PCIe read round trips, not by the link.
# Published measurement, 8 Blackwell PCIe GPUs (RTX 6000D), NCCL defaults (2 channels on a
# PCIe-only node: its ring search finds one ring and duplicates it): 45 us for a 4 KB
# all-reduce, 344 us for 64 KB (the SGLang b12x PCIe all-reduce proposal). Solving the ring
# formula at n = 8: 1.75 * 60 KB / 299 us -> 0.36 GB/s over 2 channels (0.18 each); 45 us -
# 1.75 * 4 KB / 0.36 GB/s = 25 us = 8 us start + 14 hops of 1.2 us. Gen4 hops: 8 RTX 4090
# (no P2P) measure 42 us for an 8-byte all-reduce (NCCL issue 1530): (42 - 8) / 14 = 2.4 us.
# Larger messages take NCCL's Simple protocol: bulk copies through host memory at what the
# host bounce sustains (8 PCIe Gen4 L20s over SHM average ~6 GB/s of bus bandwidth, NCCL
# issue 1817; Gen5 doubles it), each hop paying a fenced handshake and the proxy's progress.
# That hop cost is bounded below by the same measurement: NCCL did not find Simple cheaper
# at 64 KB, so 8 us + 14 hops + 1.75 * 64 KB / bus >= 344 us puts a hop at >= 24 us.
_PCIE5_HOST = {"ring": Algo(8.0, 1.2, 0.18), "ring-simple": Algo(8.0, 24.0, 12.0)}
_PCIE4_HOST = {"ring": Algo(8.0, 2.4, 0.18), "ring-simple": Algo(8.0, 24.0, 6.0)}

LINKS = {
    "nvlink4": Link("nvlink4", _NVLINK4),
    "nvlink5": Link("nvlink5", _NVLINK5),
    "pcie5": Link("pcie5", _PCIE5),
    "pcie4": Link("pcie4", _PCIE4),
    "pcie5-nop2p": Link("pcie5-nop2p", _PCIE5_HOST, p2p=False, per_channel=True),
    "pcie4-nop2p": Link("pcie4-nop2p", _PCIE4_HOST, p2p=False, per_channel=True),
}
LINK_ALIASES = {
    "nvlink": "nvlink4",
    "pcie": "pcie5",
    "pcie5-p2p": "pcie5",
    "pcie4-p2p": "pcie4",
    "pcie5-no-p2p": "pcie5-nop2p",
    "pcie4-no-p2p": "pcie4-nop2p",
}


def _key(text: str) -> str:
    return text.strip().lower().replace("_", "-").replace(" ", "-")


def load_gpu(gpu: str) -> Gpu:
    """A built-in GPU by name, or a JSON file of Gpu's fields (measured figures; a
    `calibration` key, what `outrider plan --calibrate` measured, is read by people only)."""
    key = _key(gpu)
    key = GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    if gpu.endswith(".json"):
        d = _read_json(gpu, "GPU figures")
        d.pop("calibration", None)
        if "kernel_floor_us" in d:
            raise ValueError(
                f"{gpu} is a profile of the cost model before per-kernel overheads (it has "
                "kernel_floor_us): run `outrider plan --calibrate` again to make a new one"
            )
        try:
            return Gpu(**d)
        except TypeError as e:
            fields = ", ".join(f.name for f in dataclasses.fields(Gpu))
            raise ValueError(f"{gpu}: {e}; a GPU file holds the fields {fields}") from None
    raise ValueError(f"unknown GPU {gpu!r}: {_near(key, GPUS)}or a JSON file of measured figures")


def calibrated_dtype(gpu: str | None) -> str | None:
    """The dtype a `--calibrate` profile's steps ran in ("fp32"), or None for a built-in or
    a file without a calibration."""
    if not gpu or not gpu.endswith(".json"):
        return None
    return _read_json(gpu, "GPU figures").get("calibration", {}).get("dtype")


def load_link(link: str) -> Link:
    """A built-in link by name, or a JSON file of measured collective times:

        {"name": "8x-pcie5", "world_size": 8,
         "all_reduce": [[bytes, us], ...], "all_gather": [[out_bytes, us], ...]}

    (what `outrider bench comm` writes); times between sizes are interpolated linearly."""
    key = _key(link)
    key = LINK_ALIASES.get(key, key)
    if key in LINKS:
        return LINKS[key]
    if link.endswith(".json"):
        d = _read_json(link, "link figures")
        tables = {}
        for kind in ("all_reduce", "all_gather"):
            rows = d.get(kind)
            if not rows or not all(isinstance(r, list | tuple) and len(r) == 2 for r in rows):
                raise ValueError(
                    f"{link} needs {kind!r}: a list of [bytes, microseconds] pairs, measured "
                    "at the sizes decode and verify use (outrider bench comm writes them)"
                )
            tables[kind] = tuple(sorted((int(b), float(us)) for b, us in rows))
        return Link(
            str(d.get("name", link)), measured=tables, world_size=int(d.get("world_size", 0))
        )
    raise ValueError(
        f"unknown link {link!r}: {_near(key, {**LINKS, **LINK_ALIASES})}or a JSON file of "
        "measured figures"
    )


def _near(key: str, table: dict) -> str:
    near = difflib.get_close_matches(key, list(table), n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"{hint}use one of {', '.join(t for t in table if t in GPUS or t in LINKS)} "


def _read_json(path: str, what: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"no {what} file at {path!r}: pass a built-in name or an existing file")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds no JSON object of {what}")
    return d


def _interpolate(table: tuple[tuple[int, float], ...], x: float) -> float:
    """Linear in bytes between measured sizes; past the ends, the nearest segment's line."""
    sizes = [b for b, _ in table]
    if len(table) == 1:
        return table[0][1]
    i = min(max(bisect.bisect_left(sizes, x), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return max(y, min(y0, y1) if x < x0 else 0.0)
