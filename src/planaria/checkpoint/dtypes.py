"""Dtype names as written in safetensors headers and manifests, and their torch dtypes."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_name", "itemsize", "torch_dtype"]

#: safetensors dtype name -> torch dtype. Only these are accepted in a manifest.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}

_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; ``ValueError`` if it cannot be stored."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors name; ``KeyError`` if unknown."""
    return DTYPES[name]


def itemsize(name: str) -> int:
    """Bytes per element of the safetensors dtype ``name``."""
    return DTYPES[name].itemsize
