"""The small row-wise ops of a decoder layer, each fused into one kernel (CUDA tensors).

Inside a replayed CUDA graph a decode step is bound by kernel count as much as by bytes: in plain torch
an RMSNorm or a rotary embedding is a chain of small elementwise kernels, and every layer repeats them.
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
    tl.store(out_ptr + row * stride_o + cols,
             _normed(x.to(tl.float32), weight_ptr, cols, ok, num_cols, eps, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _normed(xf, weight_ptr, cols, ok, num_cols, eps, dtype: tl.constexpr):
    """RMSNorm of one row held in fp32 ([BLOCK], zeros past num_cols), rounded to `dtype` after the norm and after
    the weight, as torch does."""
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / num_cols + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return (normed * weight).to(dtype)


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
def _norm_rope_heads(
    src, stride_sh, weight_ptr, eps, cos_ptr, sin_ptr, dst, stride_dh, num_heads,
    HALF: tl.constexpr, HEADS_P2: tl.constexpr, NORM: tl.constexpr,
):
    """Every head's row [D] of one token normalised (optionally) and rotated by the token's angles."""
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    ok = heads < num_heads
    row = src + heads * stride_sh
    lo = tl.load(row + dims, mask=ok, other=0.0).to(tl.float32)  # [H, D/2]: the two halves rotate together
    hi = tl.load(row + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    dtype = dst.dtype.element_ty
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / (2 * HALF) + eps)[:, None]
        w_lo = tl.load(weight_ptr + dims).to(tl.float32)
        w_hi = tl.load(weight_ptr + HALF + dims).to(tl.float32)
        # NOTE: torch rounds after the norm and after the weight
        lo = ((lo * rstd).to(dtype).to(tl.float32) * w_lo).to(dtype).to(tl.float32)
        hi = ((hi * rstd).to(dtype).to(tl.float32) * w_hi).to(dtype).to(tl.float32)
    cos_lo, cos_hi = tl.load(cos_ptr + dims).to(tl.float32), tl.load(cos_ptr + HALF + dims).to(tl.float32)
    sin_lo, sin_hi = tl.load(sin_ptr + dims).to(tl.float32), tl.load(sin_ptr + HALF + dims).to(tl.float32)
    out = dst + heads * stride_dh
    tl.store(out + dims, (lo * cos_lo - hi * sin_lo).to(dtype), mask=ok)
    tl.store(out + HALF + dims, (hi * cos_hi + lo * sin_hi).to(dtype), mask=ok)


@triton.jit
def _norm_rope_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, eps, num_heads,
    stride_xn, stride_xh, stride_cn, stride_on, stride_oh,
    HALF: tl.constexpr, HEADS_P2: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    _norm_rope_heads(x_ptr + token * stride_xn, stride_xh, weight_ptr, eps, cos_ptr + token * stride_cn,
                     sin_ptr + token * stride_cn, out_ptr + token * stride_on, stride_oh, num_heads,
                     HALF, HEADS_P2, NORM)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`apply_rotary(RMSNorm(x) if weight is not None else x, cos, sin)` for x [N, H, D], cos/sin [N, D]; into
    `out` (x's shape and dtype, D contiguous) when given."""
    num_tokens, num_heads, head_dim = x.shape
    _check_angles(x, cos, sin)
    out = _output_like(x, out, "x")
    if num_tokens:
        _norm_rope_kernel[(num_tokens,)](
            x, weight if weight is not None else x, cos, sin, out, eps, num_heads,
            x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            HALF=head_dim // 2, HEADS_P2=triton.next_power_of_2(num_heads), NORM=weight is not None, num_warps=4,
        )
    return out


def _output_like(x: torch.Tensor, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """`out` checked to be x's shape and dtype with a contiguous last axis (the kernels write it row by row), or a
    new such tensor."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {name}'s shape and dtype with a contiguous last axis")
    return out


@triton.jit
def _latent_entry_kernel(kv_ptr, weight_ptr, cos_ptr, sin_ptr, out_ptr, eps, stride_kn, stride_cn, stride_on,
                         LATENT: tl.constexpr, LATENT_P2: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    kv, out = kv_ptr + token * stride_kn, out_ptr + token * stride_on
    cols = tl.arange(0, LATENT_P2)
    ok = cols < LATENT
    latent = tl.load(kv + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + cols, _normed(latent, weight_ptr, cols, ok, LATENT, eps, out_ptr.dtype.element_ty), mask=ok)
    _norm_rope_heads(kv + LATENT, 0, weight_ptr, eps, cos_ptr + token * stride_cn, sin_ptr + token * stride_cn,
                     out + LATENT, 0, 1, HALF, 1, False)


def latent_entry(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`modeling.ops.TorchRowOps.latent_entry` in one launch: an MLA layer's cache entries [N, C + R] from kv_a's
    output (the RoPE columns as halves), the latent normalised and the RoPE key rotated, straight into `out` (the
    tree scratch's rows, say) when given."""
    num_tokens, width = kv.shape
    rope = cos.shape[-1]
    _check_angles(kv[:, None, -rope:], cos, sin)
    out = _output_like(kv, out, "kv")
    if num_tokens:
        latent = width - rope
        _latent_entry_kernel[(num_tokens,)](
            kv, weight, cos, sin, out, eps, kv.stride(0), cos.stride(0), out.stride(0),
            LATENT=latent, LATENT_P2=triton.next_power_of_2(latent), HALF=rope // 2, num_warps=_warps(latent))
    return out


# Up to this many tokens each program takes one head, past it one KV group's worth of heads: one head per
# program is faster for a verify step's few tokens and far slower for a prefill chunk's thousands
# (benchmarks/results/kernel_tuning.md, section 4).
PER_HEAD_MAX_TOKENS = 32


@triton.jit
def _qkv_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr, eps,
    num_heads, num_kv_heads,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cn,
    stride_qon, stride_qoh, stride_kon, stride_koh, stride_von, stride_voh,
    HALF: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
):
    """HEADS heads of one token: q heads or k heads normalised and rotated, or v heads copied. The layer's
    whole Q/K/V epilogue is one launch, with K and V written straight to where attention reads them. Axis 1
    walks q's heads, then k's, then v's, HEADS at a time (a tensor's last program may hold fewer)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS
    q_slots = tl.cdiv(num_heads, HEADS) * HEADS
    kv_slots = tl.cdiv(num_kv_heads, HEADS) * HEADS
    cos, sin = cos_ptr + token * stride_cn, sin_ptr + token * stride_cn
    if head < q_slots:
        _norm_rope_heads(q_ptr + token * stride_qn + head * stride_qh, stride_qh, q_weight_ptr, eps, cos, sin,
                         q_out_ptr + token * stride_qon + head * stride_qoh, stride_qoh, num_heads - head, HALF,
                         HEADS, NORM)
    elif head < q_slots + kv_slots:
        head -= q_slots
        _norm_rope_heads(k_ptr + token * stride_kn + head * stride_kh, stride_kh, k_weight_ptr, eps, cos, sin,
                         k_out_ptr + token * stride_kon + head * stride_koh, stride_koh, num_kv_heads - head, HALF,
                         HEADS, NORM)
    else:
        heads = head - q_slots - kv_slots + tl.arange(0, HEADS)[:, None]
        dims = tl.arange(0, 2 * HALF)[None, :]
        ok = heads < num_kv_heads
        v = tl.load(v_ptr + token * stride_vn + heads * stride_vh + dims, mask=ok)
        tl.store(v_out_ptr + token * stride_von + heads * stride_voh + dims, v, mask=ok)


def qkv_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  k_out: torch.Tensor, v_out: torch.Tensor) -> torch.Tensor:
    """`norm_rope` of q [N, Hq, D] and of k [N, Hkv, D] into k_out, and v copied into v_out, in one launch;
    returns the new q. Both norms are given or neither (Qwen3 has both, Llama neither)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_angles(q, cos, sin)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q and k norms come together")
    if not (k.shape == v.shape == k_out.shape == v_out.shape == (num_tokens, num_kv_heads, head_dim)):
        raise ValueError("k, v, k_out and v_out must all be [N, Hkv, D]")
    if any(t.stride(2) != 1 for t in (k, v, k_out, v_out)):
        raise ValueError("head_dim must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    heads = 1 if num_tokens <= PER_HEAD_MAX_TOKENS else triton.next_power_of_2(num_kv_heads)
    programs = triton.cdiv(num_heads, heads) + 2 * triton.cdiv(num_kv_heads, heads)
    if num_tokens:
        _qkv_norm_rope_kernel[(num_tokens, programs)](
            q, k, v, q_weight if q_weight is not None else q, k_weight if k_weight is not None else q, cos, sin,
            q_out, k_out, v_out, eps, num_heads, num_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
            HALF=head_dim // 2, HEADS=heads, NORM=q_weight is not None, num_warps=1 if heads == 1 else 4,
        )
    return q_out


def _check_angles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    num_tokens, _, head_dim = x.shape
    if x.stride(2) != 1 or cos.shape != (num_tokens, head_dim) or sin.stride() != cos.stride():
        raise ValueError("x must be [N, H, D] with contiguous D, cos and sin [N, D] alike")


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
