"""Paged decode attention: one query token per sequence, the same split-KV design as verify.

A decode step is the verify problem with one query token, its own K/V already in the pages and no
tree block, so it reuses both stages: `split_kv.attention_partials` over the whole sequence with the
tree split compiled out, then `lse_merge.merge_partials`.
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
    plan_splits,
)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_pages: torch.Tensor,  # [num_pages, P, Hkv, D]
    v_pages: torch.Tensor,  # [num_pages, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_pages] int32
    seq_lens: torch.Tensor,  # [B] int32, counting the query token itself
    sm_scale: float,
    max_seq_len: int,
    cfg: SplitConfig | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """Each query attends to its sequence's first `seq_lens[b]` positions.

    `max_seq_len` bounds `seq_lens` and only picks the launch shape: results are correct, and each
    sequence is spread over every split, for any lengths up to it (one CUDA graph serves them all).
    """
    check_paged_kv(q, k_pages, v_pages, block_tables, seq_lens)
    check_host_bounds(sm_scale, max_seq_len)
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError("paged decode takes one query token per sequence")
    if max_seq_len < 1:
        raise ValueError("max_seq_len must be >= 1: seq_lens count the query token itself")
    num_seqs, num_kv_heads = q.shape[0], k_pages.shape[2]
    cfg = cfg or default_config(q.shape[1] // num_kv_heads, q.shape[2])
    cu_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)  # one token each
    plan = plan_splits(num_seqs, num_kv_heads, q.shape[1] // num_kv_heads, max_seq_len, q.device, cfg)
    part_o, part_lse = attention_partials(q, k_pages, v_pages, block_tables, seq_lens, cu_q, sm_scale, plan, cfg)
    return merge_partials(part_o, part_lse, cu_q, seq_lens, plan, False, 1, q.dtype)
