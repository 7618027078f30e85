"""The skinny-M GEMM against F.linear, and the layers that route few-row CUDA inputs through it.

Without CUDA the kernel runs in Triton's CPU interpreter (fp16); with CUDA in bf16 too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ddtree_kernels import skinny_gemm
from modeling.layers import MLP, FusedLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def operands(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, weight, b


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 F.linear rounded once to x's dtype: the value every correct kernel approximates."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 32])
@pytest.mark.parametrize(("n", "k"), [(96, 320), (128, 256)])  # (32, 64) and (64, 256) tiles
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool) -> None:
    x, weight, b = operands(rows, n, k, dtype, bias)
    assert skinny_gemm.fits(x, weight)
    close(skinny_gemm.linear(x, weight, b), exact_linear(x, weight, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 21])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_linear_matches_the_unfused_projection(dtype: torch.dtype, rows: int, bias: bool) -> None:
    x, weight, b = operands(rows, 2 * 96, 128, dtype, bias, seed=rows)
    gate, up = exact_linear(x, weight, b).chunk(2, dim=-1)
    expected = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    assert skinny_gemm.fits(x, weight, gated=True)
    close(skinny_gemm.silu_mul_linear(x, weight, b), expected)


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    """Verify (16 rows) and decode (1 row) must see identical projections for speculative decoding to match
    plain decoding token for token."""
    dtype = DTYPES[-1]
    x, weight, _ = operands(16, 128, 256, dtype, bias=False)
    alone = torch.cat([skinny_gemm.linear(x[i:i + 1], weight) for i in range(16)])
    assert torch.equal(skinny_gemm.linear(x, weight), alone)


def test_fits_names_what_it_takes() -> None:
    x, weight, _ = operands(4, 128, 256, torch.float16, bias=False)
    assert skinny_gemm.fits(x, weight)
    assert not skinny_gemm.fits(torch.cat([x] * 9), weight)  # 36 rows: cuBLAS is as fast
    assert not skinny_gemm.fits(x[:0], weight)
    assert not skinny_gemm.fits(x.float(), weight.float())
    assert not skinny_gemm.fits(x, weight[:24])  # 24 output columns tile by no block
    assert not skinny_gemm.fits(x[:, :200], weight[:, :200])  # K = 200: no block divides it
    assert not skinny_gemm.fits(x.t().contiguous().t(), weight)  # columns not contiguous
    assert not skinny_gemm.fits(x, weight[:127], gated=True)  # odd rows cannot split into gate and up
    with pytest.raises(ValueError, match="do not fit the skinny GEMM"):
        skinny_gemm.linear(torch.cat([x] * 9), weight)


@pytest.mark.gpu
def test_mlp_on_cuda_matches_the_cpu_layer() -> None:
    """The fused gate/up + SiLU kernel and the down projection, as the layer calls them on a verify step."""
    config = SimpleNamespace(hidden_size=256, intermediate_size=512, mlp_bias=False)  # what MLP reads
    torch.manual_seed(0)
    mlp = MLP(config).to(torch.bfloat16)
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        torch.nn.init.normal_(linear.weight, std=0.05)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    expected = mlp(x)
    mlp.to("cuda")
    mlp.gate_up = FusedLinear(mlp.gate_proj, mlp.up_proj)
    torch.testing.assert_close(mlp(x.cuda()).cpu().float(), expected.float(), atol=2e-2, rtol=2e-2)
