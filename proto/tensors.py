"""torch.Tensor <-> `ddtree.v1.Tensor` (raw little-endian bytes + dtype + shape).

Imported by the drafter and the verifier only (the gateway has no torch)."""

from __future__ import annotations

import torch

from proto import common_pb2

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int32": torch.int32, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def to_proto(tensor: torch.Tensor | None) -> common_pb2.Tensor:
    if tensor is None:
        return common_pb2.Tensor()
    tensor = tensor.detach().contiguous().cpu()
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor  # numpy has no bf16
    return common_pb2.Tensor(dtype=_NAMES[tensor.dtype], shape=list(tensor.shape), data=raw.numpy().tobytes())


def from_proto(message: common_pb2.Tensor) -> torch.Tensor | None:
    """None for an empty message; ValueError naming the problem for a malformed one."""
    if not message.dtype:
        return None
    if message.dtype not in _DTYPES:
        raise ValueError(f"tensor dtype {message.dtype!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[message.dtype]
    shape = tuple(message.shape)
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(message.data) != expected:
        raise ValueError(f"tensor data has {len(message.data)} bytes, shape {list(shape)} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(message.data), dtype=storage)
    return flat.view(dtype).reshape(shape)
