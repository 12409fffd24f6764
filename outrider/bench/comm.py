"""`outrider bench comm`: what an all-reduce and an all-gather cost on this machine at the sizes
decode and verify send, under each NCCL setting worth trying, and which setting is best.

Sizes. Each row-parallel layer all-reduces its output, [tokens, hidden] in the activation
dtype, twice per layer; the vocabulary-parallel LM head all-gathers [tokens, vocab] logits once
per forward. A decode step of B sequences has B tokens, a verify of k drafts B(1 + k):

    all-reduce bytes  = hidden x B(1 + k) x dtype bytes      (each rank's buffer)
    all-gather bytes  = vocab  x B(1 + k) x dtype bytes      (the gathered output)

for every batch size and k asked (k = 0 is decode), or the --sizes given.

Candidates. NCCL reads its settings from the environment when a communicator starts, so each
candidate runs in fresh processes (one per rank, bench/comm_rank.py) with its settings in their
environment: the protocol (NCCL_PROTO), the algorithm (NCCL_ALGO), the channel count
(NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS: on links without P2P each channel adds host-memory
bandwidth), and the P2P path (NCCL_P2P_LEVEL, NCCL_P2P_DISABLE). gloo, on the CPU, has none.
A candidate that fails (a setting this NCCL refuses, a hang past the timeout) is reported and
skipped. The best is the one whose collectives cost least over one forward of each step shape
(2 x layers + 1 all-reduces and one all-gather each).

Outputs: the full result (every candidate, size, latency and bandwidth), the best candidate's
table in the form `outrider plan --link FILE` reads (hardware.load_link), and its settings as
KEY=VALUE lines for systemd's EnvironmentFile= (`outrider deploy systemd --env-file`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from outrider import env

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# name -> settings; "default" is NCCL's own choice and always runs first.
NCCL_CANDIDATES: dict[str, dict[str, str]] = {
    "default": {},
    "proto-LL": {"NCCL_PROTO": "LL"},
    "proto-LL128": {"NCCL_PROTO": "LL128"},
    "proto-Simple": {"NCCL_PROTO": "Simple"},
    "algo-Ring": {"NCCL_ALGO": "Ring"},
    "algo-Tree": {"NCCL_ALGO": "Tree"},
    "channels-4": {"NCCL_MIN_NCHANNELS": "4", "NCCL_MAX_NCHANNELS": "4"},
    "channels-8": {"NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"},
    "channels-16": {"NCCL_MIN_NCHANNELS": "16", "NCCL_MAX_NCHANNELS": "16"},
    "LL-channels-8": {"NCCL_PROTO": "LL", "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"},
    "p2p-SYS": {"NCCL_P2P_LEVEL": "SYS"},
    "p2p-off": {"NCCL_P2P_DISABLE": "1"},
}


class CommError(RuntimeError):
    """No candidate could be measured (every one failed)."""


@dataclass(frozen=True)
class CommConfig:
    """One `bench comm` run; the command's flags read their defaults from here."""

    world_size: int = 2
    device: str = "auto"  # auto: cuda when there are world_size GPUs, else cpu
    model: str = "smollm2-135m"  # a planner model: its hidden size and vocabulary set the sizes
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    ks: tuple[int, ...] = (0, 1, 3, 7)  # 0: decode
    dtype: str = "bf16"
    sizes: tuple[int, ...] = ()  # bytes; replaces the model's sizes when given
    warmup: int = 5
    iters: int = 20
    trials: int = 3
    candidates: tuple[str, ...] | None = None  # None: every NCCL_CANDIDATES entry
    extra_candidates: tuple[str, ...] = ()  # "KEY=VALUE,KEY=VALUE"
    timeout_s: float = 300.0  # per candidate

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"--world-size {self.world_size}: a collective needs 2 or more ranks")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: use auto, cpu or cuda")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype {self.dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
        for name in ("batch_sizes", "sizes"):
            bad = [v for v in getattr(self, name) if v < 1]
            if bad:
                raise ValueError(f"invalid --{name.replace('_', '-')} {bad}: use values >= 1")
        if any(k < 0 for k in self.ks):
            raise ValueError(f"invalid --k {list(self.ks)}: use k >= 0 (0 is decode)")
        for name in ("iters", "trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid --{name} {getattr(self, name)}: use 1 or more")
        unknown = [c for c in self.candidates or () if c not in NCCL_CANDIDATES]
        if unknown:
            raise ValueError(
                f"unknown candidate {unknown[0]!r}: use one of {', '.join(NCCL_CANDIDATES)}, or "
                "--candidate KEY=VALUE,... for settings of your own"
            )
        for text in self.extra_candidates:
            parse_candidate(text)


def parse_candidate(text: str) -> dict[str, str]:
    """'NCCL_PROTO=LL,NCCL_MIN_NCHANNELS=8' -> {'NCCL_PROTO': 'LL', 'NCCL_MIN_NCHANNELS': '8'}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.startswith("NCCL_") or not key.replace("_", "").isalnum():
            raise ValueError(
                f"--candidate {text!r}: {part!r} is not an NCCL_NAME=VALUE setting; write e.g. "
                "NCCL_PROTO=LL,NCCL_MIN_NCHANNELS=8"
            )
        out[key] = value
    if not out:
        raise ValueError(f"--candidate {text!r} sets nothing: write e.g. NCCL_PROTO=LL")
    return out


@dataclass(frozen=True)
class Shape:
    """One step shape and the collectives its forward sends."""

    batch: int
    k: int
    all_reduce_bytes: int
    all_gather_bytes: int

    @property
    def tokens(self) -> int:
        return self.batch * (1 + self.k)


def step_shapes(hidden: int, vocab: int, cfg: CommConfig) -> list[Shape]:
    """Every (batch, k) asked, with its all-reduce and all-gather bytes."""
    b = DTYPE_BYTES[cfg.dtype]
    return [
        Shape(n, k, hidden * n * (1 + k) * b, vocab * n * (1 + k) * b)
        for n in cfg.batch_sizes
        for k in sorted(set(cfg.ks))
    ]


@dataclass
class Measured:
    """One candidate's figures: {kind: [[bytes, us], ...]}, or why it failed."""

    name: str
    settings: dict[str, str]
    tables: dict[str, list[list[float]]] = field(default_factory=dict)
    error: str | None = None
    score_us: float = float("inf")


def resolve_device(cfg: CommConfig) -> str:
    """cpu or cuda; one GPU a rank, on this machine."""
    if cfg.device == "cpu":
        return "cpu"
    import torch

    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" and gpus < cfg.world_size:
        raise ValueError(
            f"--device cuda with --world-size {cfg.world_size} needs one GPU a rank, and this "
            f"machine has {gpus}: use --world-size {gpus} or less, or --device cpu (gloo)"
        )
    return "cuda" if gpus >= cfg.world_size else "cpu"


def candidates_for(device: str, cfg: CommConfig) -> list[tuple[str, dict[str, str]]]:
    """What to try: gloo has no settings (the defaults alone); NCCL the chosen candidates."""
    if device == "cpu":
        return [("default", {})]
    names = cfg.candidates if cfg.candidates is not None else tuple(NCCL_CANDIDATES)
    out = [("default", {})] + [(n, NCCL_CANDIDATES[n]) for n in names if n != "default"]
    out += [(t, parse_candidate(t)) for t in cfg.extra_candidates]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_candidate(
    name: str, settings: dict[str, str], device: str, ar: list[int], ag: list[int], cfg: CommConfig
) -> Measured:
    """Start world_size ranks with `settings` in their environment and collect rank 0's table.
    A port taken between probing and binding is retried once on another."""
    m = Measured(name, settings)
    with tempfile.TemporaryDirectory(prefix="outrider-comm-") as tmp:
        out = Path(tmp) / "result.json"
        for _attempt in range(2):
            spec = {
                "world_size": cfg.world_size, "master_addr": "127.0.0.1",
                "master_port": _free_port(), "device": device, "dtype": cfg.dtype,
                "all_reduce": ar, "all_gather": ag, "warmup": cfg.warmup, "iters": cfg.iters,
                "trials": cfg.trials, "out": str(out),
            }  # fmt: skip
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            error = _run_ranks(spec_path, settings, cfg)
            if error is None or "address already in use" not in error.lower():
                break
        if error is None and out.is_file():
            d = json.loads(out.read_text())
            m.tables = {k: d[k] for k in ("all_reduce", "all_gather")}
            m.settings = {**settings}
        else:
            m.error = error or "rank 0 wrote no result"
    return m


def _run_ranks(spec_path: Path, settings: dict[str, str], cfg: CommConfig) -> str | None:
    """None when every rank exits 0; else the first failure's last lines."""
    environ = env.child_environment(settings)
    cmd = [sys.executable, "-m", "outrider.bench.comm_rank", str(spec_path)]
    procs = [
        subprocess.Popen(
            [*cmd, str(r)],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(cfg.world_size)
    ]
    deadline = time.monotonic() + cfg.timeout_s
    failure = None
    for rank, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return f"timed out after {cfg.timeout_s:g} s (raise --timeout, or drop the candidate)"
        if p.returncode and failure is None:
            tail = "\n".join(text.strip().splitlines()[-6:])
            failure = f"rank {rank} exited {p.returncode}: {tail}"
            for q in procs:  # the others would wait for it until their timeout
                if q.poll() is None:
                    q.kill()
    return failure


def score(m: Measured, shapes: list[Shape], layers: int) -> float:
    """Microseconds of collectives over one forward of each shape (2 x layers + 1 all-reduces,
    one all-gather); with --sizes, the plain sum over the sizes."""
    ar, ag = (dict((int(b), us) for b, us in m.tables[k]) for k in ("all_reduce", "all_gather"))
    if not shapes:
        return sum(ar.values()) + sum(ag.values())
    return sum((2 * layers + 1) * ar[s.all_reduce_bytes] + ag[s.all_gather_bytes] for s in shapes)


def bench_comm(cfg: CommConfig, say=print) -> dict:
    """Measure every candidate; -> the full result (`best` names the winner)."""
    from outrider.plan.models import load_model

    model = load_model(cfg.model)
    device = resolve_device(cfg)
    shapes = [] if cfg.sizes else step_shapes(model.hidden_size, model.vocab_size, cfg)
    elem = DTYPE_BYTES[cfg.dtype]
    # Sizes a rank can hold exactly: whole elements, an all-gather's split evenly.
    ar = sorted({_round(s, elem) for s in cfg.sizes} or {s.all_reduce_bytes for s in shapes})
    ag = sorted(
        {_round(s, elem * cfg.world_size) for s in cfg.sizes}
        or {_round(s.all_gather_bytes, elem * cfg.world_size) for s in shapes}
    )
    shapes = [
        Shape(s.batch, s.k, s.all_reduce_bytes, _round(s.all_gather_bytes, elem * cfg.world_size))
        for s in shapes
    ]
    backend = "nccl" if device == "cuda" else "gloo"
    tried = candidates_for(device, cfg)
    if device == "cpu":
        say("gloo on CPU: NCCL settings do not apply, so there are no candidates; measuring "
            "gloo's defaults")  # fmt: skip
    results = []
    for name, settings in tried:
        say(f"[comm] {name}: {' '.join(f'{k}={v}' for k, v in settings.items()) or 'defaults'}")
        m = run_candidate(name, settings, device, ar, ag, cfg)
        if m.error is None:
            m.score_us = score(m, shapes, model.num_layers)
            say(f"[comm]   {m.score_us / 1e3:.3f} ms of collectives over the step shapes")
        else:
            say(f"[comm]   failed: {m.error}")
        results.append(m)
    good = [m for m in results if m.error is None]
    if not good:
        raise CommError(
            f"no candidate ran on {cfg.world_size} ranks over {backend}: {results[0].error}"
        )
    best = min(good, key=lambda m: m.score_us)
    return {
        "backend": backend,
        "device": device,
        "world_size": cfg.world_size,
        "dtype": cfg.dtype,
        "model": model.name,
        "shapes": [
            {
                "batch": s.batch,
                "k": s.k,
                "tokens": s.tokens,
                "all_reduce_bytes": s.all_reduce_bytes,
                "all_gather_bytes": s.all_gather_bytes,
            }
            for s in shapes
        ],  # fmt: skip
        "candidates": [_candidate_json(m, cfg.world_size) for m in results],
        "best": best.name,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv),
    }


def _round(nbytes: int, unit: int) -> int:
    return max(unit, -(-nbytes // unit) * unit)


def _candidate_json(m: Measured, n: int) -> dict:
    rows = {}
    for kind, table in m.tables.items():
        # nccl-tests' bus bandwidth: what each rank's link carries (ring all-reduce sends
        # 2(n-1)/n of the buffer, all-gather (n-1)/n of the output).
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        rows[kind] = [
            {"bytes": int(b), "us": round(us, 3), "algbw_gbs": _sig(b / us / 1e3),
             "busbw_gbs": _sig(factor * b / us / 1e3)} for b, us in table
        ]  # fmt: skip
    out = {"name": m.name, "settings": m.settings, "error": m.error, **rows}
    out["score_us"] = None if m.error else round(m.score_us, 2)
    return out


def _sig(x: float) -> float:
    """Four significant figures: a slow link's GB/s is still told apart from zero."""
    return float(f"{x:.4g}")


def link_json(result: dict) -> dict:
    """The best candidate's figures as `outrider plan --link FILE` reads them."""
    best = next(c for c in result["candidates"] if c["name"] == result["best"])
    return {
        "name": f"measured-{result['backend']}-{result['world_size']}x-{result['device']}",
        "world_size": result["world_size"],
        "all_reduce": [[r["bytes"], r["us"]] for r in best["all_reduce"]],
        "all_gather": [[r["bytes"], r["us"]] for r in best["all_gather"]],
        "settings": best["settings"],
        "created": result["created"],
    }


def env_text(result: dict) -> str:
    """The best settings as KEY=VALUE lines (systemd EnvironmentFile= syntax)."""
    best = next(c for c in result["candidates"] if c["name"] == result["best"])
    head = (
        f"# Collective settings from `outrider bench comm` ({result['backend']}, "
        f"{result['world_size']} ranks, {result['created']}).\n"
    )
    if result["backend"] == "gloo":
        return head + "# gloo on CPU: NCCL settings do not apply; nothing to set.\n"
    default = next(c for c in result["candidates"] if c["name"] == "default")
    if not best["settings"]:
        return head + "# NCCL's defaults measured best; nothing to set.\n"
    lines = [head]
    if default["score_us"] is not None:
        lines.append(
            f"# '{best['name']}': {best['score_us'] / 1e3:.3f} ms of collectives over the step "
            f"shapes, against {default['score_us'] / 1e3:.3f} ms with NCCL's defaults.\n"
        )
    lines += [f"{k}={v}\n" for k, v in best["settings"].items()]
    return "".join(lines)


def write_outputs(
    result: dict, out_dir: Path, link_path: Path | None, env_path: Path | None
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    link_path = link_path or out_dir / "link.json"
    env_path = env_path or out_dir / "comm.env"
    paths = [out_dir / "comm.json", link_path, env_path]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    link_path.write_text(json.dumps(link_json(result), indent=1) + "\n")
    env_path.write_text(env_text(result))
    return paths


def summary(result: dict) -> str:
    """The best candidate's table, one line per size."""
    best = next(c for c in result["candidates"] if c["name"] == result["best"])
    lines = [f"best: {best['name']} ({result['backend']}, {result['world_size']} ranks)"]
    for kind in ("all_reduce", "all_gather"):
        lines.append(f"{kind.replace('_', '-'):>11}  {'bytes':>10}  {'us':>9}  {'busbw GB/s':>10}")
        lines += [
            f"{'':>11}  {r['bytes']:>10}  {r['us']:>9.1f}  {r['busbw_gbs']:>10.3f}"
            for r in best[kind]
        ]
    return "\n".join(lines)
