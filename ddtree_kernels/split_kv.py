"""Flash-decoding over a paged KV prefix plus the tree block: the partials stage of the hybrid verify attention.

One program owns one (sequence, KV head, query block, split). Its query tile packs every query head of
the KV group with every query token of the sequence (row m = token * GROUP + head in group), so each
K/V byte is read once for all of them instead of once per query head. Splits [0, num_splits) are prefix
chunks: whole numbers of KV blocks read page by page (each K/V row is HEAD_DIM contiguous elements:
coalesced), fully visible, so only the sequence's last partial block is masked. With a tree, a few
more programs per tile (TREE_BLOCK_M rows each) attend the tree block under its bit-packed ancestor
mask and write partial `num_splits`, so the tree runs beside the prefix chunks in the same launch.
Each program writes a normalised partial output and its log2-sum-exp; `lse_merge.merge_partials`
folds them together.

The host fixes only the split count (from host-side bounds, so a launch can be captured once in a CUDA
graph); each sequence cuts its own prefix into that many chunks on the device (`split_chunk_len`), so
a short prefix under a long bound still spreads over every split instead of leaving most idle.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634
# Two key blocks per split at least: at short prefixes a one-block split costs more in its partial's write and
# merge than it saves (benchmarks/results/kernel_tuning.md, section 2); long prefixes never reach the floor.
MIN_SPLIT_BLOCKS: tl.constexpr = tl.constexpr(2)
TREE_BLOCK_M = 32  # query rows per tree program (see `_tree_partial`)


@dataclass(frozen=True)
class SplitConfig:
    """Launch shape of the split-KV stage; `default_config` holds the values tuned on an H200."""

    block_m: int  # cap on query rows (tokens x heads of a KV group) per tile
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    programs_per_sm: int  # the split count aims at this many programs per SM, in one wave
    tma: bool = False  # K/V blocks through TMA descriptors where the layout allows (see `tma_descriptors`)


def default_config(rows: int, head_dim: int) -> SplitConfig:
    """Tuned on an H200 (benchmarks/results/kernel_tuning.md, section 1); tiles of at most 16 rows on an H100
    (benchmarks/results/decode_attention_h100.md).

    Plain decoding's tiles (one token's heads of a KV group) read the most keys per row: 32-key steps and four
    programs per SM keep more loads in flight (6% off a 64-session 0.6B step). Up to 64 rows the prefix stage is
    bandwidth-bound: small tiles, two programs per SM keep enough loads in flight. Past that it is compute-bound:
    128-row tiles of one warpgroup, two programs per SM, so one program's softmax overlaps the other's matmuls
    (faster than one 256-row program of 8 warps per SM). K/V blocks come through TMA wherever the pages allow it.
    """
    if rows <= 16:
        return SplitConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, programs_per_sm=4, tma=True)
    if rows <= 64:
        return SplitConfig(block_m=64, block_n=64, num_warps=4 if head_dim <= 128 else 8, num_stages=3,
                           programs_per_sm=2, tma=True)
    if head_dim <= 128:
        return SplitConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, programs_per_sm=2, tma=True)
    return SplitConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, programs_per_sm=1, tma=True)


@dataclass(frozen=True)
class SplitPlan:
    """How one launch cuts the work: derived from host-side upper bounds only (no GPU sync).

    Chunk lengths are not part of the plan: each sequence derives its own from its prefix length on the
    device (`split_chunk_len`), so one plan serves every prefix length up to the bound.
    """

    block_m: int
    num_m_blocks: int
    num_splits: int  # prefix chunks per (sequence, KV head, query block); 0 when the bound is 0
    block_n: int  # keys per inner step; chunks are whole multiples of it


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; a small stand-in for the CPU interpreter so tests still see several splits."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(
    num_seqs: int, num_kv_heads: int, rows: int, max_prefix_len: int, device: torch.device, cfg: SplitConfig
) -> SplitPlan:
    """Pick the query block and split count so the grid fills the GPU without a ragged last wave.

    `rows` bounds the query rows of one (sequence, KV head) tile: GROUP x max query tokens. The split
    count is sized for the bound `max_prefix_len`; a sequence with a shorter prefix uses the same splits
    with shorter chunks, so its time scales with its own length.
    """
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(rows)))
    num_m_blocks = triton.cdiv(rows, block_m)
    chunks = triton.cdiv(triton.cdiv(max_prefix_len, cfg.block_n), MIN_SPLIT_BLOCKS.value)  # the most a prefix fills
    tiles = max(1, num_seqs * num_kv_heads * num_m_blocks)
    slots = multiprocessor_count(device) * cfg.programs_per_sm
    num_splits = min(chunks, max(1, slots // tiles))  # 0 only without any prefix: only the tree block
    return SplitPlan(block_m, num_m_blocks, num_splits, cfg.block_n)


@triton.jit
def split_chunk_len(prefix_len, num_splits, BLOCK_N: tl.constexpr):
    """Prefix keys per split for one sequence: its KV blocks spread evenly over all `num_splits`, at least
    MIN_SPLIT_BLOCKS each (a one-block chunk costs a partial's write and merge for little work).

    Splits [0, cdiv(prefix_len, chunk)) hold keys; later ones are empty. The prefix and merge kernels
    must agree on this, so both call it.
    """
    blocks = tl.cdiv(tl.cdiv(prefix_len, BLOCK_N), tl.maximum(num_splits, 1))
    return tl.maximum(blocks, MIN_SPLIT_BLOCKS) * BLOCK_N


@triton.jit
def _attend_kv_block(
    q, acc, m_i, l_i,  # q: [BLOCK_M, D]; acc: [BLOCK_M, D] fp32; m_i, l_i: [BLOCK_M] (log2 domain)
    k, v, valid, qk_scale,  # k, v: [BLOCK_N, D]; valid: [BLOCK_N] (used when MASKED)
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax step over one block of keys."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled (scale in one FMA)
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _load_kv_block(
    k_src, v_src, table, kv_head, start, kv_end, stride_page, stride_slot, stride_kvh,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """K and V of keys [start, start + BLOCK_N) of a paged sequence, [BLOCK_N, D] each, and which are real.

    With TMA the block is one box of a page (BLOCK_N divides PAGE_SIZE and `start`), read through the
    `[num_pages * P, Hkv * D]` descriptors; otherwise a gather through per-key pointers.
    """
    offs = start + tl.arange(0, BLOCK_N)
    valid = offs < kv_end
    if USE_TMA:
        page = tl.load(table + start // PAGE_SIZE)
        row = page * PAGE_SIZE + start % PAGE_SIZE
        k = k_src.load([row, kv_head * HEAD_DIM])
        v = v_src.load([row, kv_head * HEAD_DIM])
        if MASKED:  # NOTE: slots past the sequence hold stale (maybe non-finite) values: 0 * NaN is NaN
            v = tl.where(valid[:, None], v, 0.0)
    else:
        dims = tl.arange(0, HEAD_DIM)
        page = tl.load(table + offs // PAGE_SIZE, mask=valid if MASKED else None,
                       other=0 if MASKED else None).to(tl.int64)
        rows = page * stride_page + (offs % PAGE_SIZE) * stride_slot + kv_head * stride_kvh  # [BLOCK_N]
        k = tl.load(k_src + rows[:, None] + dims[None, :], mask=valid[:, None] if MASKED else None,
                    other=0.0 if MASKED else None)
        v = tl.load(v_src + rows[:, None] + dims[None, :], mask=valid[:, None] if MASKED else None,
                    other=0.0 if MASKED else None)
    return k, v, valid


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
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_own_key(
    q, acc, m_i, l_i,  # q: [BLOCK_M, D]; acc: [BLOCK_M, D] fp32; m_i, l_i: [BLOCK_M]
    k_rows, v_rows, row_ok, qk_scale,  # k_rows, v_rows: [BLOCK_M] pointers to each row's own key and value
    HEAD_DIM: tl.constexpr,
):
    """Online-softmax step over each row's own key, always visible (a one-row tree: plain decoding), in registers:
    a dot would need shared memory beside the prefix loop's buffers, and fewer programs would fit an SM."""
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(k_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * qk_scale
    m_new = tl.maximum(m_i, s)
    p = tl.math.exp2(s - m_new)
    alpha = tl.math.exp2(m_i - m_new)
    v = tl.load(v_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    return acc * alpha[:, None] + p[:, None] * v.to(tl.float32), m_new, l_i * alpha + p


@triton.jit
def _query_tile(q_ptr, rows, q_start, kv_head, num_rows, stride_qn, stride_qh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Query rows of one KV group (row = token * GROUP + head in group): the tile, its tokens, heads, validity."""
    token = q_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < num_rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qn + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    return q, token, head, row_ok


@triton.jit
def _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, split, token, head, row_ok,
                   stride_ps, stride_pn, stride_ph, stride_ls, stride_ln, HEAD_DIM: tl.constexpr):
    """The normalised partial output and its log2-sum-exp."""
    dims = tl.arange(0, HEAD_DIM)
    out_rows = split * stride_ps + token * stride_pn + head * stride_ph
    tl.store(part_o_ptr + out_rows[:, None] + dims[None, :], acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(part_lse_ptr + split * stride_ls + token * stride_ln + head, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _tree_partial(
    q_ptr, tree_k_ptr, tree_v_ptr, tree_mask_ptr, part_o_ptr, part_lse_ptr, m_block, sub, split, kv_head, q_start,
    q_len, qk_scale, stride_qn, stride_qh, stride_tn, stride_th, stride_mn,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, TREE_M: tl.constexpr,
    BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One tree program: TREE_M rows of the tile attend their tree block under the ancestor bits. The tile's
    rows spread over several such programs: the tree block's latency then hides under the prefix splits."""
    rows = m_block * BLOCK_M + sub * TREE_M + tl.arange(0, TREE_M)
    q, token, head, row_ok = _query_tile(q_ptr, rows, q_start, kv_head, q_len * GROUP, stride_qn, stride_qh,
                                         GROUP, HEAD_DIM)
    acc = tl.zeros([TREE_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([TREE_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([TREE_M], dtype=tl.float32)
    mask_rows = tree_mask_ptr + token * stride_mn
    tree_k = tree_k_ptr + kv_head * stride_th
    tree_v = tree_v_ptr + kv_head * stride_th
    for t0 in range(0, q_len, BLOCK_T):
        acc, m_i, l_i = _attend_tree_block(q, acc, m_i, l_i, tree_k, tree_v, mask_rows, row_ok, q_start,
                                           q_len, t0, qk_scale, stride_tn, HEAD_DIM, BLOCK_T, DOT_PRECISION)
    _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, split, token, head, row_ok,
                   stride_ps, stride_pn, stride_ph, stride_ls, stride_ln, HEAD_DIM)


@triton.jit
def _prefix_partial(
    q_ptr, k_src, v_src, table, part_o_ptr, part_lse_ptr, m_block, split, kv_head, q_start, num_rows,
    kv_start, kv_end, qk_scale, stride_qn, stride_qh, stride_page, stride_slot, stride_kvh,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
    tree_k_ptr, tree_v_ptr, with_own_key, stride_tn, stride_th,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """A prefix split: the tile's rows attend keys [kv_start, kv_end), all visible; then, `with_own_key`, each
    row its own token's key (a folded one-row tree, see `_partials_kernel`)."""
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q, token, head, row_ok = _query_tile(q_ptr, rows, q_start, kv_head, num_rows, stride_qn, stride_qh,
                                         GROUP, HEAD_DIM)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    full_end = kv_start + (kv_end - kv_start) // BLOCK_N * BLOCK_N
    for start in range(kv_start, full_end, BLOCK_N):
        k, v, valid = _load_kv_block(k_src, v_src, table, kv_head, start, kv_end, stride_page, stride_slot,
                                     stride_kvh, PAGE_SIZE, BLOCK_N, HEAD_DIM, False, USE_TMA)
        acc, m_i, l_i = _attend_kv_block(q, acc, m_i, l_i, k, v, valid, qk_scale, False, DOT_PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):  # the sequence's partial last block, if any
        k, v, valid = _load_kv_block(k_src, v_src, table, kv_head, start, kv_end, stride_page, stride_slot,
                                     stride_kvh, PAGE_SIZE, BLOCK_N, HEAD_DIM, True, USE_TMA)
        acc, m_i, l_i = _attend_kv_block(q, acc, m_i, l_i, k, v, valid, qk_scale, True, DOT_PRECISION)
    if with_own_key:
        own = token * stride_tn + kv_head * stride_th
        acc, m_i, l_i = _attend_own_key(q, acc, m_i, l_i, tree_k_ptr + own, tree_v_ptr + own, row_ok, qk_scale,
                                        HEAD_DIM)
    _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, split, token, head, row_ok,
                   stride_ps, stride_pn, stride_ph, stride_ls, stride_ln, HEAD_DIM)


@triton.jit
def _partials_kernel(
    q_ptr, k_src, v_src, block_tables_ptr, prefix_lens_ptr, cu_q_ptr,  # k_src/v_src: pages or descriptors
    tree_k_ptr, tree_v_ptr, tree_mask_ptr,  # [N, Hkv, D] x2, [N, W] int32 (unused without HAS_TREE)
    part_o_ptr, part_lse_ptr,  # [S, N, Hq, D] fp32, [S, N, Hq] fp32
    qk_scale, num_splits,
    stride_qn, stride_qh, stride_page, stride_slot, stride_kvh, stride_bt, stride_tn, stride_th, stride_mn,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE_M: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_TREE: tl.constexpr, FOLD_TREE: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """FOLD_TREE (trees of one row: plain decoding): no tree programs; the sequence's last prefix split (split 0
    without a prefix) attends each row's own key after its keys, so each row has one partial fewer, and with one
    split its partial is the output (`attention_partials`' `out`)."""
    m_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2) // NUM_KV_HEADS
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    prefix_len = tl.load(prefix_lens_ptr + seq)
    chunk_len = split_chunk_len(prefix_len, num_splits, BLOCK_N)
    kv_start = split * chunk_len
    is_tree = (split >= num_splits) & HAS_TREE  # tree programs: every TREE_M rows of the tile write one partial
    first_row = m_block * BLOCK_M + tl.where(is_tree, (split - num_splits) * TREE_M, 0)
    last_split = tl.maximum(tl.cdiv(prefix_len, chunk_len), 1) - 1
    holds_tree = (split == last_split) & FOLD_TREE
    if (first_row >= q_len * GROUP) | ((kv_start >= prefix_len) & ~is_tree & ~holds_tree):
        return
    if is_tree:
        _tree_partial(q_ptr, tree_k_ptr, tree_v_ptr, tree_mask_ptr, part_o_ptr, part_lse_ptr, m_block,
                      split - num_splits, num_splits, kv_head, q_start, q_len, qk_scale, stride_qn, stride_qh,
                      stride_tn, stride_th, stride_mn, stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
                      GROUP, HEAD_DIM, BLOCK_M, TREE_M, BLOCK_T, DOT_PRECISION)
    else:
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_end = tl.minimum(kv_start + chunk_len, prefix_len)
        _prefix_partial(q_ptr, k_src, v_src, table, part_o_ptr, part_lse_ptr, m_block, split, kv_head, q_start,
                        q_len * GROUP, kv_start, kv_end, qk_scale, stride_qn, stride_qh, stride_page, stride_slot,
                        stride_kvh, stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
                        tree_k_ptr, tree_v_ptr, holds_tree, stride_tn, stride_th,
                        GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, DOT_PRECISION, USE_TMA)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Hopper or newer; the interpreter emulates descriptors, so CPU tests run the TMA path too."""
    if device.type != "cuda":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return torch.cuda.get_device_capability(device)[0] >= 9


def tma_descriptors(k_pages: torch.Tensor, v_pages: torch.Tensor, block_n: int):
    """TMA descriptors over the pages as `[num_pages * P, Hkv * D]`, or None where TMA does not apply:
    no TMA unit, a key block that straddles pages, or pages that are not dense rows of that view."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    row = num_kv_heads * head_dim
    dense = k_pages.stride() == (page_size * row, row, head_dim, 1)
    aligned = k_pages.data_ptr() % 16 == 0 and v_pages.data_ptr() % 16 == 0
    if not (dense and aligned and block_n <= page_size and _has_tma(k_pages.device)):
        return None
    shape, strides = [num_pages * page_size, row], [row, 1]
    return tuple(TensorDescriptor(pages, shape, strides, [block_n, head_dim]) for pages in (k_pages, v_pages))


def attention_partials(
    q: torch.Tensor,  # [N, Hq, D]
    k_pages: torch.Tensor,  # [num_pages, P, Hkv, D]
    v_pages: torch.Tensor,  # [num_pages, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_pages] int32
    prefix_lens: torch.Tensor,  # [B] int32
    cu_q: torch.Tensor,  # [B + 1] int32
    sm_scale: float,
    plan: SplitPlan,
    cfg: SplitConfig,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # tree_k, tree_v [N, Hkv, D]; mask [N, W]
    max_q_len: int = 1,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [S, N, Hq, D] fp32, [S, N, Hq] fp32; S = `num_partials`
    """Launch the partials stage; the caller has checked the inputs (see `check_paged_kv`).

    `max_q_len` bounds the tree size of any sequence (it sizes the tree's key blocks). `out` ([N, Hq, D], only
    where `num_partials` is 1): the one partial is written there, in its dtype, as the attention output.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    fold = folds_tree(tree is not None, max_q_len)
    partials = num_partials(plan, tree is not None, max_q_len)
    if out is not None and partials != 1:
        raise ValueError(f"only a launch with one partial writes the output itself ({partials} here)")
    part_o = q.new_empty(partials, num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    part_lse = q.new_empty(partials, num_tokens, num_q_heads, dtype=torch.float32)
    if partials == 0 or num_tokens == 0:
        return part_o, part_lse
    own_tree = tree is not None and not fold  # NOTE: the tree block in programs of its own, writing partial S - 1
    tree_m = min(plan.block_m, TREE_BLOCK_M)
    tree_programs = plan.block_m // tree_m if own_tree else 0
    prefix_programs = partials if fold else plan.num_splits
    grid = (plan.num_m_blocks, prefix_programs + tree_programs, block_tables.shape[0] * num_kv_heads)
    o_dest = part_o if out is None else out[None]
    descriptors = tma_descriptors(k_pages, v_pages, plan.block_n) if cfg.tma else None
    k_src, v_src = descriptors or (k_pages, v_pages)
    tree_k, tree_v, tree_mask = tree if tree is not None else (q, q, cu_q.view(-1, 1))
    _partials_kernel[grid](
        q, k_src, v_src, block_tables, prefix_lens, cu_q, tree_k, tree_v, tree_mask, o_dest, part_lse,
        sm_scale * LOG2E, plan.num_splits,
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        block_tables.stride(0), tree_k.stride(0), tree_k.stride(1), tree_mask.stride(0),
        o_dest.stride(0), o_dest.stride(1), o_dest.stride(2), part_lse.stride(0), part_lse.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, TREE_M=tree_m,
        BLOCK_T=max(16, min(64, triton.next_power_of_2(max_q_len))), HAS_TREE=own_tree,
        FOLD_TREE=fold,
        DOT_PRECISION=dot_precision(q), USE_TMA=descriptors is not None,
        num_warps=cfg.num_warps if plan.block_m >= 64 else 4, num_stages=cfg.num_stages,
    )
    return part_o, part_lse


def folds_tree(has_tree: bool, max_q_len: int) -> bool:
    """Whether the tree block is attended by a prefix split rather than programs of its own: for trees of one
    row (plain decoding), whose own programs would cost a partial and a merge input each for one key."""
    return has_tree and max_q_len == 1


def num_partials(plan: SplitPlan, has_tree: bool, max_q_len: int) -> int:
    """Partials per query row that a launch may write: the prefix splits, and the tree's own (none when folded;
    a folded tree without a prefix split still has split 0's program)."""
    if folds_tree(has_tree, max_q_len):
        return max(plan.num_splits, 1)
    return plan.num_splits + has_tree


def dot_precision(q: torch.Tensor) -> str:
    """fp32 inputs get IEEE products: fp32 is the exact mode the engine's tests compare greedy outputs in,
    and TF32's 10-bit mantissa flips near-tied argmaxes. 16-bit inputs are unaffected."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_paged_kv(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
    lengths: torch.Tensor,
) -> None:
    """Shape, dtype and stride checks of the paged inputs, before any launch."""
    _require(q.dim() == 3 and k_pages.dim() == 4, "q must be [N, Hq, D] and pages [num_pages, P, Hkv, D]")
    _require(k_pages.shape == v_pages.shape and k_pages.stride() == v_pages.stride(),
             "k_pages and v_pages must share shape and strides")
    _require(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}")
    _require(k_pages.dtype == q.dtype and v_pages.dtype == q.dtype, "q and pages must share a dtype")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    _require(k_pages.shape[3] == head_dim, "pages head_dim differs from q")
    _require(head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim} not in 16..256 (power of two)")
    _require(16 <= page_size <= 256 and page_size & (page_size - 1) == 0, f"page size {page_size} unsupported")
    _require(num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= 16, "GQA group must be 1..16")
    _require(q.stride(2) == 1 and k_pages.stride(3) == 1, "head_dim must be the contiguous axis")
    _require(block_tables.dim() == 2 and block_tables.dtype == torch.int32, "block_tables must be [B, pages] int32")
    _require(lengths.shape == (block_tables.shape[0],) and lengths.dtype == torch.int32, "lengths must be [B] int32")
    _require(len({t.device for t in (q, k_pages, v_pages, block_tables, lengths)}) == 1, "tensors on one device")


def check_host_bounds(sm_scale: float, *bounds: int) -> None:
    """Host-side scalars: a NaN scale or a negative bound is a caller bug, caught before the launch."""
    _require(math.isfinite(sm_scale) and all(b >= 0 for b in bounds), "scale must be finite, bounds >= 0")
