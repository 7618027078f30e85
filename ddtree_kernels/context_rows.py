"""A DFlash commit's rows stored into one layer's slot rings, one launch per layer.

A commit projects its N rows' context K/V for every layer at once (one GEMM), then each layer normalises and
rotates the keys and writes K, V and the position into ring row `position % C` of the row's slot
(`modeling.dflash.LayerContext`). In torch that is a norm/RoPE kernel, a remainder and three index_put launches
per layer; here one program per row does all of it, K normalised and rotated on its way to the ring by the same
helper as the target's norm/RoPE kernel (so the same rounding points).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_kernels.fused_layer_ops import _norm_rope_heads


@triton.jit
def _store_rows_kernel(
    k_ptr, v_ptr, weight_ptr, cos_ptr, sin_ptr,  # [N, Hkv, D] x2 (rows may be strided); [D]; [N, D] x2
    keys_ptr, values_ptr, ring_positions_ptr,  # [slots, R, Hkv, D] x2 (same strides); [slots, C] int64
    slots_ptr, positions_ptr,  # [N] int64 each
    eps, capacity, num_heads,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_cn, stride_slot, stride_row, stride_head, stride_pos,
    HALF: tl.constexpr, HEADS_P2: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    position = tl.load(positions_ptr + token)
    ring = position % capacity
    dst = slot * stride_slot + ring * stride_row
    _norm_rope_heads(k_ptr + token * stride_kn, stride_kh, weight_ptr, eps, cos_ptr + token * stride_cn,
                     sin_ptr + token * stride_cn, keys_ptr + dst, stride_head, num_heads, HALF, HEADS_P2, NORM)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, 2 * HALF)[None, :]
    ok = heads < num_heads
    v = tl.load(v_ptr + token * stride_vn + heads * stride_vh + dims, mask=ok)
    tl.store(values_ptr + dst + heads * stride_head + dims, v, mask=ok)
    tl.store(ring_positions_ptr + slot * stride_pos + ring, position)


def store_context_rows(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor | None, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       ring_positions: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """In place: for each row i, keys[slots[i], positions[i] % C] = rope(norm(k[i])) (no norm when k_weight is
    None), values[...] = v[i], ring_positions[slots[i], positions[i] % C] = positions[i]; C =
    ring_positions.shape[1]. k, v: [N, Hkv, D] with contiguous heads; cos, sin: [N, D]; slots, positions: [N]
    int64. Rows are stored in parallel: two rows aimed at one ring row leave either."""
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or keys.shape[2:] != k.shape[1:] or values.shape != keys.shape:
        raise ValueError("k and v must be [N, Hkv, D] and the rings [slots, R, Hkv, D] of the same heads")
    if keys.stride() != values.stride() or keys.stride(3) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("the rings must share strides, and every head's D values must be contiguous")
    if cos.shape != (num_tokens, head_dim) or sin.stride() != cos.stride() or cos.stride(1) != 1:
        raise ValueError("cos and sin must be [N, D] alike")
    if slots.shape != (num_tokens,) or positions.shape != (num_tokens,) or ring_positions.stride(1) != 1:
        raise ValueError("slots and positions must be [N], ring_positions [slots, C] with contiguous rows")
    if num_tokens:
        _store_rows_kernel[(num_tokens,)](
            k, v, k_weight if k_weight is not None else k, cos, sin, keys, values, ring_positions, slots, positions,
            eps, ring_positions.shape[1], num_heads,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), keys.stride(0), keys.stride(1),
            keys.stride(2), ring_positions.stride(0),
            HALF=head_dim // 2, HEADS_P2=triton.next_power_of_2(num_heads), NORM=k_weight is not None, num_warps=4,
        )
