"""Writes a safetensors file from raw little-endian bytes, in capture order.

The reference writer (``safetensors.serialize``) takes raw pointers, reorders
tensors and has no F6 dtypes; this writer takes bytes for every dtype of the
spec and pads the header with spaces to 8 bytes, as the reference does.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from nanrunbook.dtypes import DTYPES
from nanrunbook.records import element_count
from nanrunbook.tensors.safetensors import U64_MAX

__all__ = ["RawTensor", "safetensors_chunks", "safetensors_header"]


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One tensor as safetensors stores it: dtype name, shape, little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        dtype = DTYPES.get(self.dtype)
        if dtype is None:
            raise ValueError(f"unknown safetensors dtype {self.dtype!r}")
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape!r} is not a tuple of integers >= 0")
        elements = element_count(self.shape, U64_MAX)
        if elements is None:
            raise ValueError(f"shape {self.shape!r} holds more elements than a file can")
        expected = dtype.nbytes(elements)
        if expected is None:
            raise ValueError(f"{elements} {self.dtype} elements do not fill whole bytes")
        if expected != len(self.data):
            raise ValueError(
                f"{self.dtype}{list(self.shape)} takes {expected} bytes, got {len(self.data)}"
            )


def safetensors_header(entries: Iterable[tuple[str, str, Sequence[int], int]]) -> bytes:
    """The file's first bytes, before any tensor data: the header length and the
    padded header, for ``(name, dtype, shape, nbytes)`` in file order (the data
    follows back to back, so the offsets need only the sizes)."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        if name in header or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is repeated or reserved")
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def safetensors_chunks(tensors: Sequence[tuple[str, RawTensor]]) -> Iterator[bytes]:
    """The file's bytes, in pieces: length, padded header, then each tensor's data."""
    yield safetensors_header((name, t.dtype, t.shape, len(t.data)) for name, t in tensors)
    for _, tensor in tensors:
        yield tensor.data
