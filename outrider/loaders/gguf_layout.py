"""A GGUF file's layout checked against the file itself, before gguf.GGUFReader maps it.

The reader trusts every count, length and offset it reads: a truncated or forged file sends it
past the end of the file, looping over a forged array length (or growing a list without end),
or mapping tensors that are not there. One pass over the header here reads nothing large and
bounds every read by the file's size, so each of those is a one-line error naming the file, the
field and what was expected (~0.06 s for the default model's 49k-token vocabulary).

Layout (v2 and v3, little-endian unless the version reads byte-swapped): magic b"GGUF", u32
version, u64 tensor count, u64 metadata count; each metadata entry a string key, a u32 value
type and the value; each tensor entry a string name, u32 n_dims, n_dims x u64 dims (fastest
first), u32 GGML type, u64 offset into the data, which starts at the next multiple of
general.alignment (32) after the entries. A string is a u64 length and its UTF-8 bytes.
"""

from __future__ import annotations

import importlib.metadata
import math
import mmap
import struct
from pathlib import Path

import gguf

_GGUF_VERSION = importlib.metadata.version("gguf")
# GGUF value types (gguf.GGUFValueType): bytes of each scalar; STRING is a string, ARRAY a u32
# item type, a u64 count and the items.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NAME_BYTES = 1 << 16  # llama.cpp allows 64 for a tensor name; keys are short too
# The least bytes one metadata entry (key length, type, a one-byte value) and one tensor entry
# (name length, n_dims, type, offset) take: a count larger than the rest of the file allows is
# forged, and is refused before anything loops over it.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


def check_layout(path: Path) -> None:
    """A ValueError naming the field when the GGUF file's header does not fit the file."""
    size = path.stat().st_size
    where = f"GGUF file {str(path)!r} ({size:,} bytes)"
    if size < 24:
        raise ValueError(
            f"{where} is truncated: a GGUF header (magic, version, tensor and metadata counts) "
            "takes 24 bytes; re-download it"
        )
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _Walk(buf, size, where).check()


class _Walk:
    """One pass over a GGUF header: every read is bounded by the file's size."""

    def __init__(self, buf: mmap.mmap, size: int, where: str) -> None:
        self.buf, self.size, self.where, self.pos = buf, size, where, 0
        self.order = "<"

    def fail(self, field: str, found: str, expected: str) -> ValueError:
        return ValueError(
            f"{self.where}: {field} is {found}, expected {expected}: the file is truncated or "
            "corrupt; re-download it, or re-convert it with llama.cpp's convert_hf_to_gguf.py"
        )

    def take(self, n: int, field: str) -> int:
        """The offset of the next `n` bytes, which must lie inside the file."""
        if n > self.size - self.pos:
            raise self.fail(
                field,
                f"{n:,} bytes at offset {self.pos:,}",
                f"at most the {self.size - self.pos:,} bytes left in the file",
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def number(self, code: str, field: str) -> int:
        fmt = struct.Struct(self.order + code)
        return fmt.unpack_from(self.buf, self.take(fmt.size, field))[0]

    def name(self, field: str) -> str:
        """A metadata key or tensor name: short text, read (the rest is only skipped)."""
        n = self.number("Q", f"the length of {field}")
        if n > _MAX_NAME_BYTES:
            raise self.fail(
                f"the length of {field}", f"{n:,} bytes", f"at most {_MAX_NAME_BYTES:,}"
            )
        raw = self.buf[self.take(n, f"{field} ({n:,} bytes long)") : self.pos]
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise self.fail(field, f"{raw[:40]!r}", "UTF-8 text") from None

    def skip_string(self, field: str) -> None:
        self.take(self.number("Q", f"the length of {field}"), field)

    def check(self) -> None:
        magic = bytes(self.buf[:4])
        if magic != b"GGUF":
            raise ValueError(
                f"{self.where} starts with {magic!r}, not the GGUF magic b'GGUF': it is not a "
                "GGUF file (or not a whole one); pass a .gguf from llama.cpp's converter"
            )
        self.pos = 4
        version = self.number("I", "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine, as GGUFReader also reads
            self.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in (2, 3):
            raise ValueError(
                f"{self.where} has GGUF version {version}: outrider reads versions 2 and 3; "
                "re-convert the model with a current llama.cpp"
            )
        n_tensors = self.number("Q", "the tensor count")
        n_kv = self.number("Q", "the metadata count")
        left = self.size - self.pos
        for count, least, what in (
            (n_tensors, _MIN_TENSOR_BYTES, "tensor count"),
            (n_kv, _MIN_KV_BYTES, "metadata count"),
        ):
            if count * least > left:
                most = f"at most {left // least:,} in the {left:,} bytes after the header"
                raise self.fail(f"the {what}", f"{count:,}", most)
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        keys: set[str] = set()
        for i in range(n_kv):
            key = self.name(f"the name of metadata entry {i}")
            if key in keys:
                raise self.fail(f"metadata entry {i}", f"a second {key!r}", "each key once")
            keys.add(key)
            kind = self.number("I", f"the value type of metadata {key!r}")
            if key == "general.alignment":
                if kind != _UINT32:
                    raise self.fail(f"the value type of {key!r}", str(kind), f"{_UINT32} (uint32)")
                alignment = self.number("I", key)
                if alignment == 0 or alignment & (alignment - 1):
                    raise self.fail(key, str(alignment), "a power of two")
            else:
                self.value(f"metadata {key!r}", kind)
        tensors = [self.tensor(i) for i in range(n_tensors)]
        data = self.pos + -self.pos % alignment  # tensor data starts aligned after the header
        names: set[str] = set()
        for name, offset, nbytes in tensors:
            if name in names:
                raise self.fail(f"tensor {name!r}", "listed twice", "each tensor once")
            names.add(name)
            if offset % alignment:
                raise self.fail(
                    f"the data offset of tensor {name!r}",
                    f"{offset:,}",
                    f"a multiple of {alignment}",
                )
            if data + offset + nbytes > self.size:
                raise self.fail(
                    f"the data of tensor {name!r}",
                    f"{nbytes:,} bytes at offset {data + offset:,}",
                    f"to end inside the file's {self.size:,} bytes",
                )

    def value(self, field: str, kind: int, in_array: bool = False) -> None:
        if kind in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[kind], field)
        elif kind == _STRING:
            self.skip_string(field)
        elif kind == _ARRAY and not in_array:
            item = self.number("I", f"the item type of {field}")
            count = self.number("Q", f"the length of {field}")
            least = _SCALAR_BYTES.get(item, 8)  # a string takes at least its u64 length
            if count * least > self.size - self.pos:
                raise self.fail(
                    f"the length of {field}",
                    f"{count:,} items",
                    f"at most {(self.size - self.pos) // least:,} in the bytes left in the file",
                )
            if item in _SCALAR_BYTES:
                self.take(count * least, field)
            elif item == _STRING:
                for _ in range(count):
                    self.skip_string(f"an item of {field}")
            else:
                self.value(f"an item of {field}", item, in_array=True)  # names the bad type
        else:
            raise self.fail(
                f"the value type of {field}",
                f"{kind}{' (an array inside an array)' if kind == _ARRAY else ''}",
                "one of GGUF's types 0-12, arrays holding scalars or strings",
            )

    def tensor(self, i: int) -> tuple[str, int, int]:
        """(name, data offset, data bytes) of tensor entry `i`, its fields checked."""
        name = self.name(f"the name of tensor entry {i}")
        field = f"tensor {name!r}"
        n_dims = self.number("I", f"the dimension count of {field}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise self.fail(f"the dimension count of {field}", str(n_dims), f"1 to {_MAX_DIMS}")
        dims = [self.number("q", f"the dimensions of {field}") for _ in range(n_dims)]
        if any(d < 1 for d in dims):
            raise self.fail(f"the shape of {field}", str(dims), "dimensions of at least 1")
        code = self.number("I", f"the type of {field}")
        try:
            kind = gguf.GGMLQuantizationType(code)
        except ValueError:
            raise ValueError(
                f"{self.where}: the type of {field} is {code}, which is no GGML type the gguf "
                f"package {_GGUF_VERSION} knows: the file is corrupt, or quantized to a type "
                "newer than outrider reads; re-download it, or re-quantize it with llama.cpp's "
                "llama-quantize to Q8_0 or a K-quant"
            ) from None
        offset = self.number("Q", f"the data offset of {field}")
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise self.fail(
                f"the shape of {field}", str(dims), f"rows of whole {kind.name} blocks of {block}"
            )
        return name, offset, math.prod(dims) // block * block_bytes
