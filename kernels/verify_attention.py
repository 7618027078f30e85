"""Hybrid verify attention: a long paged prefix (no mask) plus a small tree block (ancestor mask).

Two launches, both CUDA-graph capturable (every size comes from host-side upper bounds; the lengths
themselves are read on the device, so one capture replays correctly and at full speed for any lengths
up to the bounds):
1. `split_kv.prefix_partials`: flash-decoding over the prefix, all query heads of a KV group and all
   tree tokens of a sequence in one tile, so each prefix K/V byte is read once;
2. `_tree_merge_kernel`: each small tile of query rows attends its tree block under the bit-packed
   ancestor mask and folds in the prefix partials by log-sum-exp. The tree block and the merge are
   both tiny next to the prefix, so fusing them costs nothing and saves a launch and a round trip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.split_kv import (
    LOG2E,
    SplitConfig,
    SplitPlan,
    check_host_bounds,
    check_paged_kv,
    default_config,
    dot_precision,
    plan_splits,
    prefix_partials,
    split_chunk_len,
)

MERGE_BLOCK_M = 16  # small row tiles: many programs share the partials' read traffic
MERGE_STAGES = 8  # partials in flight per program: the split loop is latency-bound (8: 13 us, 4: 16 us)
MAX_TREE_LEN = 256


@triton.jit
def _attend_tree_block(
    q, acc, m_i, l_i,  # q: [BLOCK_M, D]; acc: [BLOCK_M, D] fp32; m_i, l_i: [BLOCK_M]
    tree_k_ptr, tree_v_ptr, mask_rows, row_ok, q_start, q_len, t0, qk_scale, stride_tn,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax step over tree tokens [t0, t0 + BLOCK_T) under the ancestor bits."""
    cols = t0 + tl.arange(0, BLOCK_T)
    col_ok = cols < q_len
    dims = tl.arange(0, HEAD_DIM)
    kv_rows = (q_start + cols) * stride_tn
    k = tl.load(tree_k_ptr + kv_rows[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_T], unscaled
    words = tl.load(mask_rows[:, None] + cols[None, :] // 32, mask=row_ok[:, None] & col_ok[None, :], other=0)
    visible = ((words >> (cols[None, :] % 32)) & 1) != 0
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a row may see nothing in this block
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    v = tl.load(tree_v_ptr + kv_rows[:, None] + dims[None, :], mask=col_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _tree_merge_kernel(
    q_ptr, tree_k_ptr, tree_v_ptr, tree_mask_ptr, cu_q_ptr, prefix_lens_ptr,
    part_o_ptr, part_lse_ptr, out_ptr,
    qk_scale, num_splits,
    stride_qn, stride_qh, stride_tn, stride_th, stride_mn, stride_on, stride_oh,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr,
    MERGE_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1) // NUM_KV_HEADS
    kv_head = tl.program_id(1) % NUM_KV_HEADS
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len * GROUP:
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = q_start + rows // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < q_len * GROUP
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if HAS_TREE:
        q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        mask_rows = tree_mask_ptr + token * stride_mn
        tree_k = tree_k_ptr + kv_head * stride_th
        tree_v = tree_v_ptr + kv_head * stride_th
        for t0 in range(0, q_len, BLOCK_T):
            acc, m_i, l_i = _attend_tree_block(q, acc, m_i, l_i, tree_k, tree_v, mask_rows, row_ok, q_start,
                                               q_len, t0, qk_scale, stride_tn, HEAD_DIM, BLOCK_T,
                                               DOT_PRECISION)

    prefix_len = tl.load(prefix_lens_ptr + seq)
    # NOTE: the prefix stage's own chunks: only the splits that held keys wrote partials (none if num_splits == 0).
    valid_splits = tl.minimum(tl.cdiv(prefix_len, split_chunk_len(prefix_len, num_splits, BLOCK_N)), num_splits)
    for split in tl.range(valid_splits, num_stages=MERGE_STAGES):
        lse = tl.load(part_lse_ptr + split * stride_ls + token * stride_ln + head, mask=row_ok, other=0.0)
        part = split * stride_ps + token * stride_pn + head * stride_ph
        o = tl.load(part_o_ptr + part[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.math.exp2(m_i - m_new)
        beta = tl.math.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new

    out = out_ptr + token[:, None] * stride_on + head[:, None] * stride_oh + dims[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def merge_partials(
    q: torch.Tensor,  # [N, Hq, D]
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # tree_k, tree_v [N, Hkv, D]; mask [N, W]
    cu_q: torch.Tensor,  # [B + 1] int32
    prefix_lens: torch.Tensor,  # [B] int32
    part_o: torch.Tensor,  # [S, N, Hq, D] fp32
    part_lse: torch.Tensor,  # [S, N, Hq] fp32
    sm_scale: float,
    plan: SplitPlan,
    num_kv_heads: int,
    max_q_len: int,
) -> torch.Tensor:  # [N, Hq, D] in q's dtype
    """Attend the tree block (when given) and fold in the prefix partials; also the decode epilogue."""
    num_tokens, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    group = num_q_heads // num_kv_heads
    tree_k, tree_v, tree_mask = tree if tree is not None else (q, q, cu_q.view(-1, 1))
    grid = (triton.cdiv(group * max_q_len, MERGE_BLOCK_M), (cu_q.shape[0] - 1) * num_kv_heads)
    if num_tokens == 0 or grid[0] == 0:
        return out
    _tree_merge_kernel[grid](
        q, tree_k, tree_v, tree_mask, cu_q, prefix_lens, part_o, part_lse, out,
        sm_scale * LOG2E, plan.num_splits,
        q.stride(0), q.stride(1), tree_k.stride(0), tree_k.stride(1), tree_mask.stride(0),
        out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=MERGE_BLOCK_M,
        BLOCK_T=max(16, min(64, triton.next_power_of_2(max_q_len))), BLOCK_N=plan.block_n,
        HAS_TREE=tree is not None, MERGE_STAGES=MERGE_STAGES, DOT_PRECISION=dot_precision(q), num_warps=4, num_stages=2,
    )
    return out


def _check_tree(q: torch.Tensor, tree_k: torch.Tensor, tree_v: torch.Tensor, cu_tree: torch.Tensor,
                tree_mask: torch.Tensor, num_kv_heads: int, num_seqs: int, max_tree_len: int) -> None:
    expected = (q.shape[0], num_kv_heads, q.shape[2])
    if tree_k.shape != expected or tree_v.shape != expected or tree_k.stride() != tree_v.stride():
        raise ValueError(f"tree_k/tree_v must both be {list(expected)} with equal strides")
    if tree_k.dtype != q.dtype or tree_v.dtype != q.dtype or tree_k.stride(2) != 1:
        raise ValueError("tree K/V must share q's dtype and have a contiguous head_dim")
    if cu_tree.shape != (num_seqs + 1,) or cu_tree.dtype != torch.int32:
        raise ValueError("cu_tree must be [B + 1] int32")
    if tree_mask.dim() != 2 or tree_mask.shape[0] != q.shape[0] or tree_mask.dtype != torch.int32:
        raise ValueError("tree_mask must be [N, W] int32")
    if tree_mask.shape[1] * 32 < max_tree_len or tree_mask.stride(1) != 1:
        raise ValueError("tree_mask needs ceil(max_tree_len / 32) contiguous words per row")
    if max_tree_len > MAX_TREE_LEN:
        raise ValueError(f"max_tree_len {max_tree_len} > {MAX_TREE_LEN}")


def hybrid_verify_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_pages: torch.Tensor,  # [num_pages, P, Hkv, D]
    v_pages: torch.Tensor,  # [num_pages, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_pages] int32
    prefix_lens: torch.Tensor,  # [B] int32
    tree_k: torch.Tensor,  # [N, Hkv, D]
    tree_v: torch.Tensor,  # [N, Hkv, D]
    cu_tree: torch.Tensor,  # [B + 1] int32
    tree_mask: torch.Tensor,  # [N, W] int32
    sm_scale: float,
    max_prefix_len: int,
    max_tree_len: int,
    cfg: SplitConfig | None = None,
) -> torch.Tensor:  # [N, Hq, D]
    """Same result as `reference.verify_attention_reference`.

    `max_prefix_len` and `max_tree_len` are host-side upper bounds on `prefix_lens` and on the tree
    sizes in `cu_tree`: they only pick the launch shape, so nothing here waits on the GPU. The result is
    correct, and each sequence's prefix is spread over every split, for any lengths up to the bounds: a
    CUDA graph captured at `max_prefix_len = max_context` replays at the speed of the real lengths.
    """
    check_paged_kv(q, k_pages, v_pages, block_tables, prefix_lens)
    check_host_bounds(sm_scale, max_prefix_len, max_tree_len)
    num_kv_heads = k_pages.shape[2]
    _check_tree(q, tree_k, tree_v, cu_tree, tree_mask, num_kv_heads, block_tables.shape[0], max_tree_len)
    rows = q.shape[1] // num_kv_heads * max_tree_len
    cfg = cfg or default_config(rows, q.shape[2])
    plan = plan_splits(block_tables.shape[0], num_kv_heads, rows, max_prefix_len, q.device, cfg)
    part_o, part_lse = prefix_partials(q, k_pages, v_pages, block_tables, prefix_lens, cu_tree, sm_scale,
                                       plan, cfg)
    return merge_partials(q, (tree_k, tree_v, tree_mask), cu_tree, prefix_lens, part_o, part_lse, sm_scale,
                          plan, num_kv_heads, max_tree_len)
