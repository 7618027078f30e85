"""Fold the partials of `split_kv.attention_partials` into the attention output by log-sum-exp.

One program per (query token, query head, block of BLOCK_D columns) reads that row's partials as one
[BLOCK_S, BLOCK_D] tile: all splits' loads are in flight at once instead of one after another, and the grid is
wide (tokens x heads x column blocks), so the merge costs about one read of the partials, which the partials
stage has just left in L2. MLA's 512-wide rows take four column blocks (a program per whole row had to stream
its [S, 512] fp32 partials 16 splits at a time, one tile after another).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_kernels.split_kv import SplitPlan, split_chunk_len

MAX_BLOCK_S = 64  # partials per tile; more take several tiles
MAX_BLOCK_D = 128  # columns per program: a wider row is cut into column blocks, each its own program


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, cu_q_ptr, prefix_lens_ptr, out_ptr,  # [S, N, Hq, D], [S, N, Hq], ..., [N, Hq, D]
    num_splits,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln, stride_on, stride_oh,
    NUM_Q_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_TREE: tl.constexpr, FOLDED_TREE: tl.constexpr,
):
    row = tl.program_id(0)  # token within the sequence x query heads
    seq = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + seq)
    if row >= (tl.load(cu_q_ptr + seq + 1) - q_start) * NUM_Q_HEADS:
        return
    token = q_start + row // NUM_Q_HEADS
    head = row % NUM_Q_HEADS
    prefix_len = tl.load(prefix_lens_ptr + seq)
    # NOTE: the partials stage's own chunks: only the splits that held keys wrote partials (none if num_splits == 0).
    prefix_splits = tl.minimum(tl.cdiv(prefix_len, split_chunk_len(prefix_len, num_splits, BLOCK_N)), num_splits)
    if FOLDED_TREE:  # NOTE: the last prefix split also holds the tree: split 0 holds it alone without a prefix
        prefix_splits = tl.maximum(prefix_splits, 1)
    tree_split = num_splits if HAS_TREE else -1
    last = tl.maximum(prefix_splits, tree_split + 1)
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)

    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    for s0 in range(0, last, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        used = (splits < prefix_splits) | (splits == tree_split)
        lse = tl.load(part_lse_ptr + splits * stride_ls + token * stride_ln + head, mask=used, other=float("-inf"))
        o = tl.load(part_o_ptr + splits[:, None] * stride_ps + token * stride_pn + head * stride_ph + dims[None, :],
                    mask=used[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a tile may hold no used split
        weight = tl.math.exp2(lse - m_safe)
        alpha = tl.math.exp2(m_i - m_safe)
        acc = acc * alpha + tl.sum(o * weight[:, None], 0)
        l_i = l_i * alpha + tl.sum(weight, 0)
        m_i = m_new
    tl.store(out_ptr + token * stride_on + head * stride_oh + dims, (acc / l_i).to(out_ptr.dtype.element_ty))


def merge_partials(
    part_o: torch.Tensor,  # [S, N, Hq, D] fp32
    part_lse: torch.Tensor,  # [S, N, Hq] fp32
    cu_q: torch.Tensor,  # [B + 1] int32
    prefix_lens: torch.Tensor,  # [B] int32
    plan: SplitPlan,
    has_tree: bool,
    max_q_len: int,
    out_dtype: torch.dtype,
    folded_tree: bool = False,
) -> torch.Tensor:  # [N, Hq, D] in out_dtype
    """The attention output of every query row from its prefix splits and tree partial, when `has_tree`: its own,
    or, `folded_tree`, the last prefix split's (`split_kv.folds_tree`)."""
    _, num_tokens, num_q_heads, head_dim = part_o.shape
    out = part_o.new_empty(num_tokens, num_q_heads, head_dim, dtype=out_dtype)
    assert head_dim & (head_dim - 1) == 0, f"merge_partials: head_dim {head_dim} is not a power of 2"
    block_d = min(head_dim, MAX_BLOCK_D)
    grid = (max_q_len * num_q_heads, cu_q.shape[0] - 1, head_dim // block_d)
    if num_tokens == 0 or grid[0] == 0:
        return out
    _merge_kernel[grid](
        part_o, part_lse, cu_q, prefix_lens, out, plan.num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, BLOCK_D=block_d, BLOCK_N=plan.block_n,
        BLOCK_S=min(MAX_BLOCK_S, triton.next_power_of_2(part_o.shape[0])),
        HAS_TREE=has_tree and not folded_tree, FOLDED_TREE=folded_tree,
        num_warps=2,  # NOTE: one [BLOCK_S, <= 128] tile: 2 warps beat 4 (kernel_tuning.md, section 3)
    )
    return out
