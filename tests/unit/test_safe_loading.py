"""A checkpoint's files are data to check, not to trust: an index cannot point outside the model
directory, and a truncated or forged safetensors file, or a config whose vocab_size disagrees
with the embedding, is a one-line error naming the file and the field, before any tensor is
read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from outrider.loaders.checkpoint import open_checkpoint
from tests.unit.test_loaders import write_hf_dir

INDEX = "model.safetensors.index.json"
SHARD = "model-00001-of-00002.safetensors"


def _point_index_at(model_dir: Path, shard: str) -> None:
    index = json.loads((model_dir / INDEX).read_text())
    index["weight_map"] = {n: shard if f == SHARD else f for n, f in index["weight_map"].items()}
    (model_dir / INDEX).write_text(json.dumps(index))


def _raises(model_dir: Path, *words: str) -> str:
    with pytest.raises(ValueError) as e:
        open_checkpoint(model_dir)
    message = str(e.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


def test_a_good_tiny_checkpoint_still_loads(tmp_path):
    weights = write_hf_dir(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    loaded = dict(ckpt.iter_tensors())
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[n], w) for n, w in weights.items())


def test_shards_inside_subfolders_and_symlinked_shards_load(tmp_path):
    # The HF cache keeps every file as a symlink to ../../blobs/<hash>.
    model = tmp_path / "snapshot"
    write_hf_dir(model)
    (tmp_path / "blobs").mkdir()
    (model / SHARD).rename(tmp_path / "blobs" / "abc")
    (model / SHARD).symlink_to(Path("..") / "blobs" / "abc")
    (model / "sub").mkdir()
    shard2 = "model-00002-of-00002.safetensors"
    (model / shard2).rename(model / "sub" / shard2)
    index = json.loads((model / INDEX).read_text())
    index["weight_map"] = {
        n: f"sub/{f}" if f == shard2 else f for n, f in index["weight_map"].items()
    }
    (model / INDEX).write_text(json.dumps(index))
    assert len(dict(open_checkpoint(model).iter_tensors())) == 7


@pytest.mark.parametrize(
    "shard",
    ["../outside/x.safetensors", "sub/../../outside/x.safetensors", "/etc/hostname", "."],
)
def test_an_index_cannot_name_a_shard_outside_the_model_directory(tmp_path, shard):
    model = tmp_path / "model"
    write_hf_dir(model)
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"x": torch.zeros(2)}, outside / "x.safetensors")
    (model / SHARD).unlink()
    _point_index_at(model, shard)
    _raises(model, INDEX, repr(shard), "inside")


def _write_raw(path: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _single(tmp_path: Path) -> Path:
    """A tiny checkpoint in one model.safetensors, the file the tests then break."""
    weights = write_hf_dir(tmp_path)
    for shard in tmp_path.glob("model*.safetensors*"):
        shard.unlink()
    save_file(weights, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def test_a_truncated_file_names_the_tensor_past_its_end(tmp_path):
    path = _single(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    _raises(tmp_path, str(path), "data_offsets", "past the end", "truncated")


def test_a_file_shorter_than_its_header_length(tmp_path):
    path = _single(tmp_path)
    path.write_bytes(b"\x01\x02")
    _raises(tmp_path, str(path), "truncated", "header length")


@pytest.mark.parametrize("length", [2**63, 10**6])
def test_a_huge_header_length_is_checked_against_the_file_size(tmp_path, length):
    path = _single(tmp_path)
    _write_raw(path, {}, length=length)
    _raises(tmp_path, str(path), f"header length {length}", "past the end")


def test_a_garbage_header(tmp_path):
    path = _single(tmp_path)
    _write_raw(path, b"\xff\xfe not json at all")
    _raises(tmp_path, str(path), "not JSON")
    _write_raw(path, [1, 2])
    _raises(tmp_path, str(path), "not a JSON object")
    _write_raw(path, {"w": {"dtype": "F32", "shape": [2]}})
    _raises(tmp_path, str(path), "'w'", "data_offsets")


def test_offsets_past_the_end_or_disagreeing_with_the_shape(tmp_path):
    path = _single(tmp_path)
    _write_raw(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    _raises(tmp_path, str(path), "'w'", "data_offsets [0, 16]", "past the end")
    _write_raw(path, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8)
    _raises(tmp_path, str(path), "'w'", "data_offsets [0, 8]", "shape [4]")


def test_an_index_entry_missing_from_its_shard(tmp_path):
    write_hf_dir(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"]["model.ghost.weight"] = SHARD
    (tmp_path / INDEX).write_text(json.dumps(index))
    _raises(tmp_path, INDEX, "'model.ghost.weight'", SHARD)


def test_a_vocab_size_that_disagrees_with_the_embedding_rows(tmp_path):
    write_hf_dir(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 48}))
    _raises(tmp_path, "config.json", "vocab_size 48", "embed_tokens.weight", "[64, 16]")
