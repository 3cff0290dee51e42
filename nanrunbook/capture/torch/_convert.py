"""Torch tensors as the bytes safetensors stores; registered with the writer on import."""

from __future__ import annotations

import sys
from typing import Any

import torch

from nanrunbook.capture.writer import register_converter
from nanrunbook.dtypes import TORCH_DTYPES
from nanrunbook.tensors.safetensors_write import RawTensor

__all__ = [
    "TORCH_DTYPES",
    "as_checkable",
    "dtype_name",
    "safetensors_dtype",
    "tensor_bytes",
    "tensor_to_raw",
]


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def safetensors_dtype(dtype: Any) -> str | None:
    """The safetensors name of a torch dtype (``torch.float16`` -> ``"F16"``), if any."""
    return TORCH_DTYPES.get(dtype_name(dtype))


def tensor_to_raw(tensor: Any) -> RawTensor:
    """A tensor's stored bits, little-endian, as safetensors holds them.

    The tensor is detached and copied to host memory (CUDA and other devices
    included); conjugate and negative views are resolved, sparse tensors made
    dense, non-contiguous ones packed. A ``float4_e2m1fn_x2`` tensor of shape
    ``(..., n)`` holds ``2n`` F4 elements and is stored as F4 of shape
    ``(..., 2n)`` (a 0-dim one as ``(2,)``). Raises TypeError for a dtype
    safetensors has no name for (complex128, quantized...) or a tensor without
    data (meta device).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = safetensors_dtype(tensor.dtype)
    if dtype is None:
        raise TypeError(f"no safetensors dtype for torch dtype {dtype_name(tensor.dtype)!r}")
    if tensor.device.type == "meta":
        raise TypeError("a meta tensor has no data to capture")
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
    shape = tuple(int(d) for d in t.shape)
    if dtype == "F4":
        shape = (*shape[:-1], 2 * shape[-1]) if shape else (2,)
    # reshape(-1) first: a 0-dim tensor cannot be viewed as bytes of another width.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    if sys.byteorder == "big" and t.element_size() > 1:
        import numpy as np

        unit = 4 if dtype == "C64" else t.element_size()
        data = np.frombuffer(data, dtype=f">u{unit}").astype(f"<u{unit}").tobytes()
    return RawTensor(dtype, shape, data)


def tensor_bytes(tensor: Any) -> tuple[str, tuple[int, ...], Any]:
    """dtype name, shape and a buffer of the stored bytes, without a copy when the
    tensor already holds them (on the CPU, contiguous, little-endian host): for
    reading now, as a digest does; what must outlive later writes to the tensor
    takes :func:`tensor_to_raw`'s copy."""
    t = tensor.detach() if isinstance(tensor, torch.Tensor) else tensor
    plain = (
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and (sys.byteorder == "little" or t.element_size() == 1)
        and safetensors_dtype(t.dtype) not in (None, "F4")
    )
    if not plain:
        raw = tensor_to_raw(tensor)
        return raw.dtype, raw.shape, raw.data
    dtype = safetensors_dtype(t.dtype)
    assert dtype is not None
    return (
        dtype,
        tuple(int(d) for d in t.shape),
        t.reshape(-1).view(torch.uint8).numpy().data,
    )


register_converter(torch.Tensor, tensor_to_raw)


def as_checkable(tensor: Any) -> Any:
    """A tensor whose dtype torch's isfinite/isnan support (fp8 widened exactly)."""
    t = tensor.detach()
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).float()
    if t.is_floating_point() and t.element_size() == 1:
        return t.float()
    return t
