"""The small row-wise ops of a decoder layer, each fused into one kernel (CUDA tensors).

Inside a replayed CUDA graph a decode step is bound by kernel count as much as by bytes: in plain torch
an RMSNorm is six kernels and a rotary embedding five, so a 36-layer step ran ~2000 small kernels.
These keep torch's rounding points where they matter (the normalised row is cast to the model dtype
before the weight multiplies it, as HF checkpoints were trained) and compute everything else in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, out_ptr, sum_ptr, eps, num_cols,
    stride_x, stride_d, stride_o, stride_s,
    BLOCK: tl.constexpr, ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # NOTE: the residual sum is rounded to the model dtype first, as `x + delta` in torch is
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    normed = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("the last axis must be contiguous")
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`modeling.layers.RMSNorm` over the last axis of x ([..., C])."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows, weight, out, out, eps, rows.shape[1], rows.stride(0), rows.stride(0), out.stride(0),
            out.stride(0), BLOCK=triton.next_power_of_2(rows.shape[1]), ADD=False, num_warps=_warps(rows.shape[1]),
        )
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) for [N, C] rows: the residual add and the next norm in one pass."""
    if x.dim() != 2 or delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError("x and delta must be [N, C] of one dtype")
    total, out = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, delta, weight, out, total, eps, x.shape[1], x.stride(0), delta.stride(0), out.stride(0),
            total.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]), ADD=True, num_warps=_warps(x.shape[1]),
        )
    return total, out


@triton.jit
def _norm_rope_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, eps, num_heads,
    stride_xn, stride_xh, stride_cn, stride_on, stride_oh,
    HALF: tl.constexpr, HEADS_P2: tl.constexpr, NORM: tl.constexpr,
):
    """One token: every head's row [D] normalised (optionally) and rotated by the token's angles."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    ok = heads < num_heads
    row = x_ptr + token * stride_xn + heads * stride_xh
    lo = tl.load(row + dims, mask=ok, other=0.0).to(tl.float32)  # [H, D/2]: the two halves rotate together
    hi = tl.load(row + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / (2 * HALF) + eps)[:, None]
        w_lo = tl.load(weight_ptr + dims).to(tl.float32)
        w_hi = tl.load(weight_ptr + HALF + dims).to(tl.float32)
        dtype = out_ptr.dtype.element_ty  # NOTE: torch rounds after the norm and after the weight
        lo = ((lo * rstd).to(dtype).to(tl.float32) * w_lo).to(dtype).to(tl.float32)
        hi = ((hi * rstd).to(dtype).to(tl.float32) * w_hi).to(dtype).to(tl.float32)
    angles = cos_ptr + token * stride_cn + dims
    cos_lo, cos_hi = tl.load(angles).to(tl.float32), tl.load(angles + HALF).to(tl.float32)
    angles = sin_ptr + token * stride_cn + dims
    sin_lo, sin_hi = tl.load(angles).to(tl.float32), tl.load(angles + HALF).to(tl.float32)
    out = out_ptr + token * stride_on + heads * stride_oh
    tl.store(out + dims, (lo * cos_lo - hi * sin_lo).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF + dims, (hi * cos_hi + lo * sin_hi).to(out_ptr.dtype.element_ty), mask=ok)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary(RMSNorm(x) if weight is not None else x, cos, sin)` for x [N, H, D], cos/sin [N, D]."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or cos.shape != (num_tokens, head_dim) or sin.stride() != cos.stride():
        raise ValueError("x must be [N, H, D] with contiguous D, cos and sin [N, D] alike")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _norm_rope_kernel[(num_tokens,)](
            x, weight if weight is not None else x, cos, sin, out, eps, num_heads,
            x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            HALF=head_dim // 2, HEADS_P2=triton.next_power_of_2(num_heads), NORM=weight is not None, num_warps=4,
        )
    return out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, num_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds here
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for [N, I] rows."""
    if gate.dim() != 2 or up.shape != gate.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("gate and up must be [N, I] with contiguous rows")
    out = torch.empty_like(gate)
    block = 1024
    if gate.shape[0]:
        _silu_mul_kernel[(gate.shape[0], triton.cdiv(gate.shape[1], block))](
            gate, up, out, gate.shape[1], gate.stride(0), up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        )
    return out


def _warps(columns: int) -> int:
    return 8 if columns >= 4096 else 4 if columns >= 1024 else 1
