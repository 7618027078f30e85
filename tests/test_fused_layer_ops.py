"""The fused row-wise kernels against the plain-torch layer ops they replace on CUDA.

Without CUDA they run in Triton's CPU interpreter (fp32/fp16); with CUDA (`gpu`) in bf16 too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree_kernels import fused_layer_ops as fused
from modeling.layers import RMSNorm
from modeling.rope import apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(device="cpu", dtype=x.dtype)
    norm.weight.data = weight.cpu()
    return norm(x.cpu()).to(x.device)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [64, 100])
def test_rms_norm_and_add(dtype: torch.dtype, columns: int) -> None:
    gen = torch.Generator().manual_seed(columns)
    x, delta = (torch.randn(7, columns, generator=gen).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + torch.randn(columns, generator=gen) / 4).to(DEVICE, dtype)
    close(fused.rms_norm(x, weight, 1e-6), torch_norm(x, weight, 1e-6))
    total, normed = fused.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    close(normed, torch_norm(x + delta, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope(dtype: torch.dtype, with_norm: bool) -> None:
    gen = torch.Generator().manual_seed(int(with_norm))
    tokens, heads, dim = 5, 3, 32
    packed = torch.randn(tokens, heads * dim + 8, generator=gen).to(DEVICE, dtype)
    x = packed[:, :heads * dim].view(tokens, heads, dim)  # a strided view, as q_proj(x).view(...) of a slice
    weight = (1 + torch.randn(dim, generator=gen) / 4).to(DEVICE, dtype) if with_norm else None
    angles = torch.rand(tokens, dim // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    expected = apply_rotary(torch_norm(x, weight, 1e-6) if with_norm else x, cos, sin)
    close(fused.norm_rope(x, weight, 1e-6, cos, sin), expected)
    into = torch.zeros(heads, tokens, dim + 4, device=DEVICE, dtype=dtype)  # head-major rows, as MLA's q
    written = fused.norm_rope(x, weight, 1e-6, cos, sin, out=into.transpose(0, 1)[..., 4:])
    assert written.data_ptr() == into[0, 0, 4].data_ptr() and not into[..., :4].any()
    close(written, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent, rope", [(512, 64), (24, 16)])
def test_latent_entry_into_the_given_rows(dtype: torch.dtype, latent: int, rope: int) -> None:
    """An MLA entry: the latent normalised, the RoPE key rotated, written straight into the rows given (a strided
    slice of kv_a's fused output in, one layer's scratch rows out)."""
    from modeling.ops import TorchRowOps

    gen = torch.Generator().manual_seed(latent)
    tokens = 6
    packed = torch.randn(tokens, 40 + latent + rope, generator=gen).to(DEVICE, dtype)
    kv = packed[:, 40:]  # after the query's columns of the fused projection
    weight = (1 + torch.randn(latent, generator=gen) / 4).to(DEVICE, dtype)
    angles = torch.rand(tokens, rope // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    expected = torch.cat([torch_norm(kv[:, :latent], weight, 1e-6),
                          apply_rotary(kv[:, None, latent:], cos, sin)[:, 0]], dim=-1)
    scratch = torch.zeros(2, tokens + 3, 1, latent + rope, device=DEVICE, dtype=dtype)
    rows = scratch[1, :tokens, 0]
    assert fused.latent_entry(kv, weight, 1e-6, cos, sin, rows).data_ptr() == rows.data_ptr()
    close(rows, expected)
    assert not scratch[0].any() and not scratch[1, tokens:].any()
    close(TorchRowOps().latent_entry(kv.cpu(), weight.cpu(), 1e-6, cos.cpu(), sin.cpu()), expected.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens, heads, kv_heads", [(5, 4, 2), (fused.PER_HEAD_MAX_TOKENS + 3, 6, 3)])
def test_qkv_norm_rope_writes_k_and_v_in_place(dtype: torch.dtype, with_norm: bool, tokens: int, heads: int,
                                               kv_heads: int) -> None:
    """A head per program for a verify step's few tokens; a KV group's worth of heads (here 4 for 3 KV heads,
    so every tensor's last program is partly masked) for a prefill chunk."""
    gen = torch.Generator().manual_seed(7)
    dim = 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    q_weight, k_weight = ((1 + torch.randn(dim, generator=gen) / 4).to(DEVICE, dtype) if with_norm else None
                          for _ in range(2))
    angles = torch.rand(tokens, dim // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(DEVICE, dtype) for f in (torch.cos, torch.sin))
    scratch = torch.zeros(2, tokens + 3, kv_heads, dim, device=DEVICE, dtype=dtype)  # rows past N stay untouched
    got_q = fused.qkv_norm_rope(q, k, v, q_weight, k_weight, 1e-6, cos, sin, scratch[0, :tokens], scratch[1, :tokens])
    close(got_q, fused.norm_rope(q, q_weight, 1e-6, cos, sin))
    assert torch.equal(scratch[0, :tokens], fused.norm_rope(k, k_weight, 1e-6, cos, sin))
    assert torch.equal(scratch[1, :tokens], v)
    assert not scratch[:, tokens:].any()
    with pytest.raises(ValueError, match="together"):
        fused.qkv_norm_rope(q, k, v, q_weight if with_norm else k, None, 1e-6, cos, sin, scratch[0, :tokens],
                            scratch[1, :tokens])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(3, 1500, generator=gen).mul(4).to(DEVICE, dtype) for _ in range(2))
    close(fused.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_logsumexp_equals_torch_over_fp32(dtype: torch.dtype) -> None:
    """Rows wider than one tile and narrower, masked (-inf) logits, and a row with nothing but -inf."""
    from ddtree_kernels.row_logsumexp import BLOCK, logsumexp

    gen = torch.Generator().manual_seed(3)
    for columns in (100, 2 * BLOCK + 77):
        x = (8 * torch.randn(2, 3, columns, generator=gen)).to(DEVICE, dtype)
        x[0, 1, ::3] = float("-inf")
        x[1, 2] = float("-inf")
        torch.testing.assert_close(logsumexp(x), torch.logsumexp(x.float(), dim=-1), atol=1e-5, rtol=1e-6)
        assert logsumexp(x).dtype == torch.float32 and logsumexp(x)[1, 2] == float("-inf")
