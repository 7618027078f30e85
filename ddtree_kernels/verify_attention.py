"""Hybrid verify attention: a long paged prefix (no mask) plus a small tree block (ancestor mask).

Two launches, both CUDA-graph capturable (every size comes from host-side upper bounds; the lengths
themselves are read on the device, so one capture replays correctly and at full speed for any lengths
up to the bounds):
1. `split_kv.attention_partials`: flash-decoding over the prefix, all query heads of a KV group and all
   tree tokens of a sequence in one tile, so each prefix K/V byte is read once; the tree block under
   its ancestor mask is one more split of the same launch;
2. `lse_merge.merge_partials`: each query row folds its partials together by log-sum-exp.

Plain decoding (trees of one row) attends its one tree key in the last prefix split instead; where the grid is
full with one split per (sequence, KV head), as at 64 sessions, that split's output is the attention output and
the merge does not run.
"""

from __future__ import annotations

import torch

from ddtree_kernels.lse_merge import merge_partials
from ddtree_kernels.split_kv import (
    SplitConfig,
    attention_partials,
    check_host_bounds,
    check_paged_kv,
    default_config,
    folds_tree,
    num_partials,
    plan_splits,
)

MAX_TREE_LEN = 256


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
    tree = (tree_k, tree_v, tree_mask)
    if num_partials(plan, True, max_tree_len) == 1:  # NOTE: plain decoding on a full grid, or no prefix: no merge
        out = q.new_empty(q.shape)
        attention_partials(q, k_pages, v_pages, block_tables, prefix_lens, cu_tree, sm_scale, plan, cfg, tree,
                           max_tree_len, out)
        return out
    part_o, part_lse = attention_partials(q, k_pages, v_pages, block_tables, prefix_lens, cu_tree, sm_scale, plan,
                                          cfg, tree, max_tree_len)
    return merge_partials(part_o, part_lse, cu_tree, prefix_lens, plan, True, max_tree_len, q.dtype,
                          folds_tree(True, max_tree_len))
