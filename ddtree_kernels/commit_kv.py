"""KV commit: copy the accepted tree rows' K/V into their page slots, every layer, one launch.

After acceptance a handful of rows per layer move from the tree scratch to positions n, n+1, ... of
the session's pages; one program per (row, layer) copies that row's K and V (H_kv x D contiguous
elements each), so the whole commit costs a single launch whatever the model depth. An MLA cache has
one pool (the latent entries, no V): the same launch copies its rows alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_kv_kernel(
    k_pages_ptr, v_pages_ptr, tree_k_ptr, tree_v_ptr, src_rows_ptr, dst_slots_ptr,
    stride_pl, stride_ps, stride_tl, stride_tn,
    ROW: tl.constexpr, BLOCK: tl.constexpr, HAS_V: tl.constexpr,
):
    row = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = layer * stride_tl + tl.load(src_rows_ptr + row).to(tl.int64) * stride_tn
    dst = layer * stride_pl + tl.load(dst_slots_ptr + row).to(tl.int64) * stride_ps
    for start in range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < ROW
        tl.store(k_pages_ptr + dst + offs, tl.load(tree_k_ptr + src + offs, mask=ok), mask=ok)
        if HAS_V:
            tl.store(v_pages_ptr + dst + offs, tl.load(tree_v_ptr + src + offs, mask=ok), mask=ok)


def _check(k_pages: torch.Tensor, v_pages: torch.Tensor, tree_k: torch.Tensor, tree_v: torch.Tensor,
           src_rows: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Called with v_pages = k_pages and tree_v = tree_k when there is no V pool."""
    if k_pages.dim() != 5 or tree_k.dim() != 4:
        raise ValueError("pages must be [L, num_pages, P, Hkv, D] and tree scratch [L, N, Hkv, D]")
    if k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride():
        raise ValueError("k_pages and v_pages must share shape and strides")
    if tree_k.shape != tree_v.shape or tree_k.stride() != tree_v.stride():
        raise ValueError("tree_k and tree_v must share shape and strides")
    if tree_k.shape[0] != k_pages.shape[0] or tree_k.shape[2:] != k_pages.shape[3:]:
        raise ValueError("tree scratch and pages disagree on layers, heads or head_dim")
    if tree_k.dtype != k_pages.dtype or v_pages.dtype != k_pages.dtype or tree_v.dtype != k_pages.dtype:
        raise ValueError("pages and tree scratch must share a dtype")
    # NOTE: one row (all heads of one slot) must be contiguous, and slots must be evenly strided.
    if not (k_pages[0, 0].is_contiguous() and tree_k[0, 0].is_contiguous()):
        raise ValueError("each slot's [Hkv, D] row must be contiguous")
    if k_pages.stride(1) != k_pages.shape[2] * k_pages.stride(2):
        raise ValueError("pages of one layer must be contiguous in (page, slot)")
    if src_rows.shape != dst_slots.shape or src_rows.dim() != 1:
        raise ValueError("src_rows and dst_slots must be [M]")
    if src_rows.dtype not in (torch.int32, torch.int64) or dst_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("src_rows and dst_slots must be int32 or int64")
    if len({t.device for t in (k_pages, v_pages, tree_k, tree_v, src_rows, dst_slots)}) != 1:
        raise ValueError("all tensors must be on one device")


def commit_kv(
    k_pages: torch.Tensor,  # [L, num_pages, P, Hkv, D]
    v_pages: torch.Tensor | None,  # [L, num_pages, P, Hkv, D]; None for an MLA cache
    tree_k: torch.Tensor,  # [L, N, Hkv, D]
    tree_v: torch.Tensor | None,  # [L, N, Hkv, D]; None with v_pages
    src_rows: torch.Tensor,  # [M] rows of the tree scratch
    dst_slots: torch.Tensor,  # [M] flat slots: page * P + offset
) -> None:
    """In-place; same effect as `reference.commit_kv_reference` (or `commit_rows_reference` on K alone)."""
    if (v_pages is None) != (tree_v is None):
        raise ValueError("v_pages and tree_v must both be given or both be None")
    has_v = v_pages is not None
    v_pages, tree_v = (v_pages, tree_v) if has_v else (k_pages, tree_k)
    _check(k_pages, v_pages, tree_k, tree_v, src_rows, dst_slots)
    if src_rows.numel() == 0:
        return
    row = k_pages.shape[3] * k_pages.shape[4]
    _commit_kv_kernel[(src_rows.numel(), k_pages.shape[0])](
        k_pages, v_pages, tree_k, tree_v, src_rows, dst_slots,
        k_pages.stride(0), k_pages.stride(2), tree_k.stride(0), tree_k.stride(1),
        ROW=row, BLOCK=min(triton.next_power_of_2(row), 4096), HAS_V=has_v, num_warps=4,
    )
