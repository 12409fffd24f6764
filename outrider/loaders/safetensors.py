"""An HF checkpoint's weights: one model.safetensors, or shards listed by
model.safetensors.index.json. Tensors are read lazily, one at a time, in their stored dtype."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class SafetensorsCheckpoint:
    """The weight files of one HF model directory and which tensor lives in which file."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.weight_map: dict[str, Path] = self._weight_map()

    def _weight_map(self) -> dict[str, Path]:
        index = self.model_dir / _INDEX
        if index.is_file():
            with open(index) as f:
                names = json.load(f).get("weight_map") or {}
            files = {file: self.model_dir / file for file in set(names.values())}
            missing = sorted(str(p) for p in files.values() if not p.is_file())
            if missing:
                raise FileNotFoundError(
                    f"{str(index)!r} lists shards that are not there: {missing[:3]}; the download "
                    f"is incomplete, fetch the missing files"
                )
            return {name: files[file] for name, file in names.items()}
        # Without an index: model.safetensors, or unindexed shards (model-00001-of-00002...).
        # Other *.safetensors (Mistral's consolidated.safetensors) hold another naming scheme.
        files = [self.model_dir / _SINGLE] if (self.model_dir / _SINGLE).is_file() else []
        files = files or sorted(self.model_dir.glob("model-*.safetensors"))
        if not files:
            raise FileNotFoundError(self._no_weights_message())
        weight_map: dict[str, Path] = {}
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in weight_map:
                        raise ValueError(
                            f"tensor {name!r} is in both {weight_map[name].name} and {path.name}: "
                            f"the shards overlap; keep one set of files in {str(self.model_dir)!r}"
                        )
                    weight_map[name] = path
        return weight_map

    def _no_weights_message(self) -> str:
        found = sorted(
            p.name for p in self.model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")
        )
        if found:
            return (
                f"{str(self.model_dir)!r} has PyTorch pickle weights ({', '.join(found[:3])}) but "
                f"no *.safetensors: outrider does not load pickles; convert them, e.g. "
                f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                f"safe_serialization=True)"
            )
        return (
            f"{str(self.model_dir)!r} has no {_SINGLE} or {_INDEX}: pass the directory that "
            f"holds the model's *.safetensors files, or a .gguf file"
        )

    def names(self) -> list[str]:
        return list(self.weight_map)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor in the stored dtype), shard by shard so each file opens once."""
        by_file: dict[Path, list[str]] = {}
        for name, path in self.weight_map.items():
            by_file.setdefault(path, []).append(name)
        for path in sorted(by_file):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in by_file[path]:
                    yield name, f.get_tensor(name)
