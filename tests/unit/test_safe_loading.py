"""A checkpoint's files are data to check, not to trust: an index cannot point outside the model
directory, and a truncated or forged safetensors or GGUF file, or a config whose vocab_size
disagrees with the embedding, is a one-line error naming the file and the field, before any
tensor is read or anything large allocated."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from outrider.loaders.checkpoint import open_checkpoint
from tests.unit.test_loaders import VOCAB, write_gguf, write_hf_dir

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


@pytest.mark.parametrize(
    ("file", "write", "words"),
    [
        ("config.json", "{oops", ["config.json", "not valid JSON"]),
        ("config.json", "[1, 2]", ["config.json", "JSON list, not an object"]),
        ("config.json", {"hidden_size": -16}, ["config.json", "hidden_size is -16", "positive"]),
        ("config.json", {"num_attention_heads": "4"}, ["num_attention_heads is '4'"]),
        ("config.json", {"num_hidden_layers": None}, ["config.json", "lacks 'num_hidden_layers'"]),
        ("config.json", {"eos_token_id": "x"}, ["config.json", "eos_token_id x"]),
        ("tokenizer.json", "{garbage", ["tokenizer.json", "tokenizers can read"]),
        ("tokenizer.json", b"\xff\xfe", ["tokenizer.json", "valid UTF-8"]),
        ("tokenizer_config.json", "[]", ["tokenizer_config.json", "JSON list"]),
        ("tokenizer_config.json", {"chat_template": 5}, ["chat_template", "jinja string"]),
        ("tokenizer_config.json", {"eos_token": 7}, ["eos_token '7'", "token's text"]),
        ("generation_config.json", "{", ["generation_config.json", "not valid JSON"]),
    ],
)
def test_a_broken_config_or_tokenizer_file_is_named(tmp_path, file, write, words):
    write_hf_dir(tmp_path)
    path = tmp_path / file
    if isinstance(write, dict):  # merged into the file's own JSON
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **write}))
    else:
        path.write_bytes(write if isinstance(write, bytes) else write.encode())
    _raises(tmp_path, *words)


# ---- GGUF ----------------------------------------------------------------------------------
# A valid tiny GGUF (test_loaders.write_gguf, through gguf.GGUFWriter) with one field rewritten
# in place: every count, length, type and offset the reader would trust.

TOKEN_EMBD, OUTPUT = b"token_embd.weight", b"output.weight"


def _gguf(tmp_path: Path, **kwargs) -> Path:
    path = tmp_path / "m.gguf"
    write_gguf(path, **kwargs)
    return path


def _after(path: Path, name: bytes) -> int:
    """The offset just after `name`, a metadata key or tensor name, in the file's header."""
    data = path.read_bytes()
    return data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


def _patch(path: Path, offset: int, fmt: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))


def _refused(path: Path, *words: str) -> str:
    message = _raises(path, *words)
    assert str(path) in message, message
    return message


def test_a_good_tiny_gguf_still_loads(tmp_path):
    expected = write_gguf(tmp_path / "m.gguf", tied=False)
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    assert ckpt.config.vocab_size == VOCAB
    assert set(dict(ckpt.iter_tensors())) == set(expected)


def test_a_gguf_shorter_than_its_header(tmp_path):
    path = _gguf(tmp_path)
    path.write_bytes(b"GGUF\x03\x00")
    _refused(path, "truncated", "24 bytes")


def test_a_truncated_gguf_names_the_tensor_past_its_end(tmp_path):
    path = _gguf(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    _refused(path, "tensor", "data", "to end inside the file")


def test_a_gguf_cut_inside_its_metadata(tmp_path):
    path = _gguf(tmp_path)
    path.write_bytes(path.read_bytes()[:2000])
    _refused(path, "bytes left in the file")


def test_garbage_magic_and_an_unknown_version(tmp_path):
    path = _gguf(tmp_path)
    good = path.read_bytes()
    path.write_bytes(b"\x89PNG" + good[4:])
    _refused(path, "b'\\x89PNG'", "not the GGUF magic")
    path.write_bytes(good)
    _patch(path, 4, "<I", 7)
    _refused(path, "GGUF version 7", "versions 2 and 3")


@pytest.mark.parametrize(("offset", "what"), [(8, "the tensor count"), (16, "the metadata count")])
def test_a_count_the_file_cannot_hold(tmp_path, offset, what):
    path = _gguf(tmp_path)
    _patch(path, offset, "<Q", 2**60)
    _refused(path, f"{what} is 1,152,921,504,606,846,976", "at most")


def test_a_string_length_past_the_end(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, b"general.architecture") + 4, "<Q", 2**62)
    _refused(path, "metadata 'general.architecture'", "4,611,686,018,427,387,904 bytes")
    _patch(path, 24, "<Q", 2**62)  # the first key's name
    _refused(path, "the name of metadata entry 0 is 4,611,686,018,427,387,904 bytes")


def test_an_array_length_past_the_end(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, b"tokenizer.ggml.tokens") + 8, "<Q", 10**12)
    _refused(path, "the length of metadata 'tokenizer.ggml.tokens'", "1,000,000,000,000 items")
    # A byte array running past the end: gguf.GGUFReader reads nothing for each item and loops.
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
    path.write_bytes(header + struct.pack("<IIQ", 9, 0, 2**40))  # ARRAY of UINT8, 2^40 items
    _refused(path, "the length of metadata 'a' is 1,099,511,627,776 items", "at most 0")


def test_an_unknown_value_type(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, b"llama.block_count"), "<I", 99)
    _refused(path, "the value type of metadata 'llama.block_count' is 99", "types 0-12")


def test_a_tensor_offset_outside_the_file(tmp_path):
    path = _gguf(tmp_path)
    n_dims = _after(path, TOKEN_EMBD)
    _patch(path, n_dims + 4 + 2 * 8 + 4, "<Q", 2**40)
    _refused(path, "tensor 'token_embd.weight'", "to end inside the file")
    _patch(path, n_dims + 4 + 2 * 8 + 4, "<Q", 4)
    _refused(path, "data offset of tensor 'token_embd.weight' is 4", "multiple of 32")


@pytest.mark.parametrize("dim", [0, -1])
def test_zero_or_negative_dimensions(tmp_path, dim):
    path = _gguf(tmp_path)
    _patch(path, _after(path, TOKEN_EMBD) + 4 + 8, "<q", dim)
    _refused(path, f"shape of tensor 'token_embd.weight' is [256, {dim}]", "at least 1")


def test_too_many_dimensions(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, TOKEN_EMBD), "<I", 9)
    _refused(path, "dimension count of tensor 'token_embd.weight' is 9", "1 to 4")


def test_a_dtype_the_loader_does_not_know(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, TOKEN_EMBD) + 4 + 2 * 8, "<I", 200)
    _refused(path, "type of tensor 'token_embd.weight' is 200", "no GGML type")


def _rename(path: Path, key: bytes) -> None:
    """Hides metadata `key` by changing its last letter (same length, so nothing moves)."""
    data = path.read_bytes()
    i = _after(path, key) - 1
    path.write_bytes(data[:i] + b"~" + data[i + 1 :])


@pytest.mark.parametrize(
    ("key", "words"),
    [
        (b"llama.block_count", ["lacks metadata llama.block_count"]),
        (b"general.architecture", ["lacks metadata general.architecture"]),
        (b"tokenizer.ggml.tokens", ["no tokenizer.ggml.tokens"]),
    ],
)
def test_missing_required_metadata(tmp_path, key, words):
    path = _gguf(tmp_path)
    _rename(path, key)
    _refused(path, *words)


def test_metadata_of_the_wrong_kind(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, b"tokenizer.ggml.eos_token_id") + 4, "<I", 10**6)
    _refused(path, "tokenizer.ggml.eos_token_id = 1000000", "a token id in 0..299")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tokenizer.ggml.tokens": "abc"}, ["tokenizer.ggml.tokens = 'abc'", "list of strings"]),
        ({"tokenizer.ggml.token_type": [1]}, ["token_type = a list of 1", "3 integers"]),
        ({"tokenizer.ggml.scores": ["x", "y", "z"]}, ["scores", "3 numbers"]),
        ({"tokenizer.ggml.merges": [1]}, ["merges", "'left right' strings"]),
        ({"tokenizer.ggml.bos_token_id": 3}, ["bos_token_id = 3", "0..2"]),
        ({"tokenizer.ggml.unknown_token_id": -1}, ["unknown_token_id = -1"]),
        ({"tokenizer.chat_template": 5}, ["tokenizer.chat_template = 5", "a string"]),
    ],
)
def test_gguf_tokenizer_metadata_of_the_wrong_kind(fields, words):
    from outrider.loaders.tokenizer import Tokenizer

    good = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    with pytest.raises(ValueError) as e:
        Tokenizer.from_gguf_fields({**good, **fields}, "/m.gguf")
    assert "GGUF file '/m.gguf'" in str(e.value)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_a_vocab_size_that_disagrees_with_the_gguf_embedding(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, b"llama.vocab_size") + 4, "<I", 48)
    _refused(path, "'token_embd.weight' has shape [256, 300]", "llama.vocab_size is 48")


def test_an_output_matrix_of_another_vocabulary(tmp_path):
    path = _gguf(tmp_path, tied=False)
    _patch(path, _after(path, OUTPUT) + 4 + 8, "<Q", 200)
    _refused(path, "'output.weight' has [256, 200]", "differ")


def test_more_tokens_than_embedding_rows(tmp_path):
    path = _gguf(tmp_path)
    _patch(path, _after(path, TOKEN_EMBD) + 4 + 8, "<Q", 200)
    _patch(path, _after(path, b"llama.vocab_size") + 4, "<I", 200)
    _refused(path, "tokenizer.ggml.tokens lists 300 tokens", "no embedding")


def test_the_cli_exits_2_naming_the_broken_gguf(tmp_path, capsys):
    from outrider.cli import main

    path = _gguf(tmp_path)
    _patch(path, 8, "<Q", 2**60)
    assert main(["generate", "--model", str(path), "hi"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "the tensor count" in err and "Traceback" not in err
