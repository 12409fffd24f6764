"""Training checkpoints without pickle: one directory per optimizer step,

    step-00000500/
        model.safetensors       the draft's state_dict (weights, d2t, t2d), fp32
        optimizer.safetensors   every optimizer state tensor, named "<param index>.<key>"
        rng.safetensors         torch CPU and CUDA generator states (uint8)
        state.json              step, data position, optimizer param_groups, config, target

written into a hidden temporary directory and renamed into place, so a crash leaves either the
whole checkpoint or none. The newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

PREFIX = "step-"
_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / "model.safetensors"))
        opt = optimizer.state_dict()
        tensors, scalars = {}, {}
        for idx, entry in opt["state"].items():
            for key, value in entry.items():
                if torch.is_tensor(value):
                    tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
                else:
                    scalars[f"{idx}.{key}"] = value
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(tmp / "rng.safetensors"))
        doc = dict(state, step=step, param_groups=opt["param_groups"], opt_scalars=scalars)
        (tmp / "state.json").write_text(json.dumps(doc, indent=1))
        if final.exists():  # a rerun reaching the same step: the new one wins
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (temporary directories are not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore model, optimizer and RNG in place; return state.json's contents."""
    path = Path(path)
    hint = (
        f"delete {str(path)!r} to resume from the previous checkpoint, or start over with "
        f"resume=False (--no-resume)"
    )
    missing = [f for f in _FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete (no {missing}): {hint}")
    try:
        state = json.loads((path / "state.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
        rng = load_file(str(path / "rng.safetensors"))
    except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt ({e}): {hint}") from e
    own = model.state_dict()
    bad = sorted(
        k for k in own.keys() | weights.keys() if k not in own or k not in weights or
        own[k].shape != weights[k].shape
    )  # fmt: skip
    if bad:
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this drafter (tensors {bad[:4]} differ): it "
            f"was made with another target or draft vocabulary size; use a new output_dir or "
            f"resume=False"
        )
    model.load_state_dict(weights)
    opt_state: dict[int, dict[str, Any]] = {}
    for name, value in opt_tensors.items():
        idx, key = name.split(".", 1)
        opt_state.setdefault(int(idx), {})[key] = value
    for name, value in state.get("opt_scalars", {}).items():
        idx, key = name.split(".", 1)
        opt_state.setdefault(int(idx), {})[key] = value
    groups = state["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    torch.set_rng_state(rng["cpu"])
    cuda_keys = sorted((k for k in rng if k != "cpu"), key=lambda k: int(k.split(".")[1]))
    cuda = [rng[k] for k in cuda_keys]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    return state
