"""An HF checkpoint's weights: one model.safetensors, or shards listed by
model.safetensors.index.json. Tensors are read lazily, one at a time, in their stored dtype."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Bytes per element of the safetensors dtypes whose size is whole bytes (F4 and friends pack).
_DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64"), 8),
}


class SafetensorsCheckpoint:
    """The weight files of one HF model directory and which tensor lives in which file."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.weight_map: dict[str, Path] = self._weight_map()
        # Every header is checked against its file before safetensors maps it, so a truncated
        # or forged file is an error naming it, not a crash or a read past its end.
        headers = {path: read_header(path) for path in sorted(set(self.weight_map.values()))}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, path in self.weight_map.items():
            if name not in headers[path]:
                raise ValueError(
                    f"{str(self.model_dir / _INDEX)!r} weight_map puts tensor {name!r} in "
                    f"{path.name}, whose header does not hold it: re-download the checkpoint"
                )
            self.shapes[name] = headers[path][name]

    def check_vocab_rows(self, vocab_size: int, config_file: Path) -> None:
        """Fail when the embedding or lm_head rows disagree with the config's vocab_size: the
        model would load them cut or padded, then refuse or misread every prompt."""
        for name, shape in self.shapes.items():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")) and shape[:1] != (
                vocab_size,
            ):
                raise ValueError(
                    f"{str(config_file)!r} has vocab_size {vocab_size}, but tensor {name!r} in "
                    f"{str(self.weight_map[name])!r} has shape {list(shape)}: the config and the "
                    "weights are of different models; fix vocab_size or use matching files"
                )

    def _weight_map(self) -> dict[str, Path]:
        index = self.model_dir / _INDEX
        if index.is_file():
            names = self._index_entries(index)
            files = {file: self._shard_path(index, file) for file in set(names.values())}
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
            for name in read_header(path):
                if name in weight_map:
                    raise ValueError(
                        f"tensor {name!r} is in both {weight_map[name].name} and {path.name}: "
                        f"the shards overlap; keep one set of files in {str(self.model_dir)!r}"
                    )
                weight_map[name] = path
        return weight_map

    def _index_entries(self, index: Path) -> dict[str, str]:
        try:
            names = json.loads(index.read_text()).get("weight_map") or {}
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{str(index)!r} is not a JSON object: {e}; re-download it") from None
        bad = next(((n, f) for n, f in names.items() if not isinstance(f, str)), None)
        if not isinstance(names, dict) or bad:
            raise ValueError(
                f"{str(index)!r} weight_map entry {bad!r} is not tensor name -> shard file name: "
                "re-download the index"
            )
        return names

    def _shard_path(self, index: Path, file: str) -> Path:
        """The shard `file` names, which must lie inside the model directory: an index is data
        from wherever the checkpoint came from, and must not open ../x or /etc/x. Checked on
        the path as written, not Path.resolve(): in the HF cache every shard is a symlink to
        ../../blobs/<hash>, outside the snapshot directory."""
        root = Path(os.path.abspath(self.model_dir))
        path = Path(os.path.abspath(root / file))  # normalizes .. without following links
        if Path(file).is_absolute() or not path.is_relative_to(root) or path == root:
            raise ValueError(
                f"{str(index)!r} weight_map lists shard {file!r}, which is {str(path)!r}: shards "
                f"must be files inside {str(root)!r}; the index is corrupt or forged"
            )
        return path

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


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, checked against the file: the
    header length fits the file, the header is a JSON object, and every tensor's data_offsets
    lie inside the file and match its dtype and shape."""
    size = path.stat().st_size
    where = f"safetensors file {str(path)!r} ({size} bytes)"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"{where} is truncated: it has no 8-byte header length; re-download it"
            )
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(
                f"{where} has header length {length}, past the end of the file: it is truncated "
                "or not a safetensors file; re-download it"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{where} has a header that is not JSON ({e}): re-download it") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where} has a header that is not a JSON object: re-download it")
    data = size - 8 - length
    shapes: dict[str, tuple[int, ...]] = {}
    for name, info in header.items():
        if name != "__metadata__":
            shapes[name] = _check_entry(where, name, info, data)
    return shapes


def _check_entry(where: str, name: str, info: Any, data: int) -> tuple[int, ...]:
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        shape = tuple(int(d) for d in shape)
    except (TypeError, KeyError, ValueError):
        raise ValueError(
            f"{where}: tensor {name!r} has header entry {str(info)[:200]}, not "
            "{dtype, shape, data_offsets: [begin, end]}; re-download it"
        ) from None
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise ValueError(
            f"{where}: tensor {name!r} has data_offsets {[begin, end]}; re-download it"
        )
    if end > data:
        raise ValueError(
            f"{where}: tensor {name!r} has data_offsets {[begin, end]}, past the end of the "
            f"file's {data} data bytes: the file is truncated; re-download it"
        )
    itemsize = _DTYPE_BYTES.get(dtype)
    if itemsize is not None and (end - begin) != itemsize * math.prod(shape):
        raise ValueError(
            f"{where}: tensor {name!r} has data_offsets {[begin, end]} ({end - begin} bytes), "
            f"but dtype {dtype} and shape {list(shape)} take {itemsize * math.prod(shape)}; "
            "the header is corrupt, re-download the file"
        )
    return shape
