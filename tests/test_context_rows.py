"""The DFlash commit's store kernel (ddtree_kernels/context_rows.py) against the torch path it replaces on CUDA:
per-head RMSNorm and RoPE of the keys, then `LayerContext.store`.

Without CUDA the kernel runs in Triton's CPU interpreter (fp32/fp16); with CUDA in bf16. The rings start as NaN,
so a row stored in the wrong place, or a ring row overwritten that no commit row names, shows.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_kernels.context_rows import store_context_rows
from modeling.dflash import LayerContext
from modeling.ops import TorchRowOps

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on CPU machines")
DTYPES = [pytest.param(torch.float32, marks=cpu_only), pytest.param(torch.float16, marks=cpu_only),
          pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def nan_rings(slots: int, capacity: int, spare: int, heads: int, dim: int, dtype: torch.dtype) -> LayerContext:
    shape = (slots, capacity + spare, heads, dim)
    return LayerContext(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
                        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
                        torch.full((slots, capacity), -1, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normed", [True, False])
def test_stored_rows_match_norm_rope_and_store(dtype: torch.dtype, normed: bool) -> None:
    """Rows of three slots, one ring wrapping around, K and V as strided views of one projection of all layers."""
    generator = torch.Generator().manual_seed(0)
    layers, heads, dim, capacity, spare = 3, 4, 32, 8, 4

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    slots = torch.tensor([0, 2, 2, 2, 1, 2], device=DEVICE)
    positions = torch.tensor([3, 6, 7, 8, 0, 9], device=DEVICE)  # slot 2 wraps: 8 and 9 land in rows 0 and 1
    kv = rand(len(slots), layers, 2, heads, dim)
    k, v = kv[:, 1, 0], kv[:, 1, 1]
    weight = (1 + 0.2 * rand(dim)) if normed else None
    angles = torch.rand(len(slots), dim // 2, generator=generator).to(DEVICE) * 6.28
    cos, sin = (f(torch.cat([angles, angles], dim=1)).to(dtype) for f in (torch.cos, torch.sin))

    got, expected = nan_rings(3, capacity, spare, heads, dim, dtype), nan_rings(3, capacity, spare, heads, dim, dtype)
    store_context_rows(k, v, weight, 1e-6, cos, sin, got.keys, got.values, got.positions, slots, positions)
    rotated = TorchRowOps().norm_rope(k, weight, 1e-6, cos, sin)
    expected.store(slots, positions % capacity, positions, rotated, v)

    assert torch.equal(got.positions, expected.positions)
    held = torch.nn.functional.pad(expected.positions >= 0, (0, spare))
    assert got.keys[~held].isnan().all() and got.values[~held].isnan().all()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.keys[held], expected.keys[held], atol=atol, rtol=rtol)
    torch.testing.assert_close(got.values[held], expected.values[held], atol=0, rtol=0)


def test_mismatched_shapes_are_refused() -> None:
    rings = nan_rings(2, 4, 2, 2, 8, torch.float32)
    k = torch.zeros(3, 2, 8, device=DEVICE)
    cos = torch.zeros(3, 8, device=DEVICE)
    index = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="same heads"):
        store_context_rows(k, k[:, :1], None, 0.0, cos, cos, rings.keys, rings.values, rings.positions, index, index)
    with pytest.raises(ValueError, match=r"\[N\]"):
        store_context_rows(k, k, None, 0.0, cos, cos, rings.keys, rings.values, rings.positions, index[:2], index)
