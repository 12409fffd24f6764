"""The only reader of os.environ: OUTRIDER_* knobs, typed."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r}: use 1/0, true/false, yes/no or on/off")


def num_threads() -> int:
    """OUTRIDER_NUM_THREADS: torch CPU threads; 0 keeps torch's own choice."""
    return _int("OUTRIDER_NUM_THREADS", 0)


def default_model() -> str | None:
    """OUTRIDER_MODEL: a checkpoint to use when none is given (else the embedded default)."""
    return os.environ.get("OUTRIDER_MODEL") or None


def hf_hub_cache() -> str:
    """Hugging Face's hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub (XDG_CACHE_HOME moves ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def step_profile_dir() -> str | None:
    """OUTRIDER_STEP_PROFILES: where speculative step profiles are kept between starts (default
    $XDG_CACHE_HOME/outrider/step_profiles, i.e. ~/.cache/...); "off" (or 0) measures every
    start and keeps nothing."""
    raw = os.environ.get("OUTRIDER_STEP_PROFILES", "")
    if raw.lower() in ("off", "0", "false", "no"):
        return None
    if raw:
        return raw
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "outrider", "step_profiles")


LOG_FORMAT = "[outrider] %(levelname)s %(name)s: %(message)s"  # the CLI's, and an engine process's


def log_level() -> str:
    return os.environ.get("OUTRIDER_LOG_LEVEL", "WARNING").upper()


def fused_kernels() -> bool:
    """OUTRIDER_FUSED_KERNELS: 0 turns the fused Triton norm/rotary/SiLU kernels off on CUDA
    (the PyTorch ops run instead), to bisect a numerical difference."""
    return _bool("OUTRIDER_FUSED_KERNELS", True)


def cpu_packed_weights() -> bool:
    """OUTRIDER_CPU_PACKED_WEIGHTS: 0 keeps the CPU's GEMMs on the dense weights (F.linear's
    MKL path, no second copy of each weight: layers/cpu_gemm.py)."""
    return _bool("OUTRIDER_CPU_PACKED_WEIGHTS", True)


def progress(default: bool) -> bool:
    """OUTRIDER_PROGRESS: 1 shows start-up progress bars (loading, graph capture) on stderr, 0
    hides them; unset: `default` (the caller's: stderr is a terminal)."""
    return _bool("OUTRIDER_PROGRESS", default)


def notify_socket() -> str | None:
    """NOTIFY_SOCKET: systemd's readiness socket (set by systemd for Type=notify units)."""
    return os.environ.get("NOTIFY_SOCKET") or None


def watchdog_usec() -> int | None:
    """WATCHDOG_USEC: systemd's watchdog timeout in microseconds (set for units with
    WatchdogSec=); None when unset or 0."""
    return _int("WATCHDOG_USEC", 0) or None


def watchdog_pid() -> int | None:
    """WATCHDOG_PID: the process systemd's watchdog is meant for; None when unset (then it
    is meant for whichever process reads WATCHDOG_USEC)."""
    return _int("WATCHDOG_PID", 0) or None


def world_size() -> int:
    """WORLD_SIZE: processes in a torchrun job; 1 outside torchrun."""
    return _int("WORLD_SIZE", 1)


def rank() -> int:
    """RANK: this process's global rank in a torchrun job; 0 outside torchrun."""
    return _int("RANK", 0)


def local_rank() -> int:
    """LOCAL_RANK: this process's rank on its host (its GPU index); 0 outside torchrun."""
    return _int("LOCAL_RANK", 0)


def master_addr() -> str | None:
    """MASTER_ADDR: the host of rank 0's rendezvous in a torchrun job; None outside torchrun."""
    return os.environ.get("MASTER_ADDR") or None


def master_port() -> int | None:
    """MASTER_PORT: the port of rank 0's rendezvous in a torchrun job; None outside torchrun."""
    return _int("MASTER_PORT", 0) or None


def child_environment(overrides: dict[str, str]) -> dict[str, str]:
    """This process's environment with `overrides` set, for a child process (the ranks of
    `outrider bench comm` get the NCCL settings under test this way)."""
    return {**os.environ, **overrides}


def thread_profile() -> str | None:
    """OUTRIDER_THREAD_PROFILE: a file where `outrider serve` writes, at shutdown, the sampled
    stacks of its threads (outrider/server/stack_sampler.py); unset: no sampling."""
    return os.environ.get("OUTRIDER_THREAD_PROFILE") or None
