"""MLA hybrid verify attention over the paged latent cache (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash).

In absorbed form every query head attends over the same per-token entries [latent (kv_lora_rank), rotated RoPE
key], and the values are the latents themselves. So the work of a verify step is large (T tokens x H heads of
query rows, each a 576-wide dot and a 512-wide accumulate per key) while the bytes are small (one entry per key):
the step is compute-bound, and what matters is feeding the tensor cores. One program owns one (sequence, query
block, split): its tile packs BLOCK_M rows (row = token * H + head) and reads each latent tile of its prefix chunk
once for all of them; the programs of one split run side by side (the query block is the fastest grid axis), so a
chunk comes from HBM once and from L2 for the other blocks.

As in the GQA kernel (`split_kv`): splits [0, num_splits) cut each sequence's prefix on the device
(`split_chunk_len`, shared with the merge), split `num_splits` is the tree block under its ancestor bits, and
`lse_merge.merge_partials` folds the partials. Every launch shape comes from host-side bounds, so one CUDA-graph
capture serves every length up to them. A single-token block (plain decoding) is the same launch with T = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_kernels.lse_merge import merge_partials
from ddtree_kernels.split_kv import (
    LOG2E,
    SplitConfig,
    check_host_bounds,
    dot_precision,
    plan_splits,
    split_chunk_len,
)
from ddtree_kernels.verify_attention import MAX_TREE_LEN

try:
    from ddtree_kernels import latent_prefix_sm90
except ImportError:  # NOTE: Gluon came with Triton 3.5; before it the Triton kernel serves every launch
    latent_prefix_sm90 = None


def hopper_prefix(q: torch.Tensor, value_dim: int, rows: int) -> bool:
    """Whether the prefix splits of this launch run on the warpgroup-MMA kernel (`latent_prefix_sm90`)."""
    return latent_prefix_sm90 is not None and latent_prefix_sm90.supports(q, value_dim, rows)


def prefix_config(q: torch.Tensor, value_dim: int, rows: int) -> SplitConfig:
    """The default launch shape of the prefix splits (the split count and chunking the merge shares)."""
    return latent_prefix_sm90.CONFIG if hopper_prefix(q, value_dim, rows) else default_latent_config(rows, value_dim)


def default_latent_config(rows: int, value_dim: int) -> SplitConfig:
    """Tuned on an H200 (benchmarks/results/verify_attention_mla.md): 32-row tiles of one warpgroup beat 64-row
    tiles over one or two warpgroups at every head count and tree size measured (the [BLOCK_M, kv_lora_rank]
    fp32 accumulator is what limits the tile; splitting the value columns over programs measured slower still)."""
    return SplitConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, programs_per_sm=2)


@triton.jit
def _attend_entries(
    q_c, q_pe, acc, m_i, l_i,  # q_c: [BLOCK_M, LORA], q_pe: [BLOCK_M, BLOCK_PE]; acc: [BLOCK_M, LORA] fp32
    src, keys, key_ok, visible, qk_scale,  # keys: [BLOCK_N] element offsets of the entries; visible: [M, N]
    LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_PE: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax step over one block of entries: scores from the latent and RoPE parts, values = latents."""
    dims = tl.arange(0, LORA)
    pe_dims = tl.arange(0, BLOCK_PE)
    if MASKED:  # NOTE: slots past the sequence hold stale (maybe non-finite) values: 0 * NaN is NaN
        c = tl.load(src + keys[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        pe = tl.load(src + keys[:, None] + LORA + pe_dims[None, :], mask=key_ok[:, None] & (pe_dims[None, :] < ROPE),
                     other=0.0)
    else:
        c = tl.load(src + keys[:, None] + dims[None, :])
        pe = tl.load(src + keys[:, None] + LORA + pe_dims[None, :], mask=pe_dims[None, :] < ROPE, other=0.0)
    s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    s = tl.dot(q_pe, tl.trans(pe), s, input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a row may see nothing in a tree block
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _page_keys(table, start, end, stride_page, stride_slot, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets of the entries of keys [start, start + BLOCK_N) of a paged sequence, and which are < end."""
    offs = start + tl.arange(0, BLOCK_N)
    ok = offs < end
    page = tl.load(table + offs // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    return page * stride_page + (offs % PAGE_SIZE) * stride_slot, ok


@triton.jit
def _latent_partials_kernel(
    q_ptr, pages_ptr, block_tables_ptr, prefix_lens_ptr, cu_q_ptr, tree_ptr, tree_mask_ptr,
    part_o_ptr, part_lse_ptr,  # [S, N, H, LORA] fp32, [S, N, H] fp32
    qk_scale, num_splits, first_split,  # programs of split axis index i run split first_split + i
    stride_qn, stride_qh, stride_page, stride_slot, stride_bt, stride_tn, stride_mn,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
    NUM_HEADS: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_PE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    split = tl.program_id(1) + first_split
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    prefix_len = tl.load(prefix_lens_ptr + seq)
    chunk_len = split_chunk_len(prefix_len, num_splits, BLOCK_N)
    kv_start = split * chunk_len
    is_tree = split == num_splits
    if (m_block * BLOCK_M >= q_len * NUM_HEADS) | ((kv_start >= prefix_len) & ~is_tree):
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * NUM_HEADS
    token = q_start + rows // NUM_HEADS
    head = rows % NUM_HEADS
    q_rows = q_ptr + token.to(tl.int64) * stride_qn + head * stride_qh
    dims = tl.arange(0, LORA)
    pe_dims = tl.arange(0, BLOCK_PE)
    q_c = tl.load(q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows[:, None] + LORA + pe_dims[None, :], mask=row_ok[:, None] & (pe_dims[None, :] < ROPE),
                   other=0.0)
    acc = tl.zeros([BLOCK_M, LORA], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if is_tree:
        mask_rows = tree_mask_ptr + token * stride_mn
        for t0 in range(0, q_len, BLOCK_N):
            cols = t0 + tl.arange(0, BLOCK_N)
            col_ok = cols < q_len
            words = tl.load(mask_rows[:, None] + cols[None, :] // 32, mask=row_ok[:, None] & col_ok[None, :],
                            other=0)
            visible = ((words >> (cols[None, :] % 32)) & 1) != 0
            keys = (q_start + cols).to(tl.int64) * stride_tn
            acc, m_i, l_i = _attend_entries(q_c, q_pe, acc, m_i, l_i, tree_ptr, keys, col_ok, visible, qk_scale,
                                            LORA, ROPE, BLOCK_PE, True, DOT_PRECISION)
    else:
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_end = tl.minimum(kv_start + chunk_len, prefix_len)
        full_end = kv_start + (kv_end - kv_start) // BLOCK_N * BLOCK_N
        for start in range(kv_start, full_end, BLOCK_N):
            keys, ok = _page_keys(table, start, kv_end, stride_page, stride_slot, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_entries(q_c, q_pe, acc, m_i, l_i, pages_ptr, keys, ok, None, qk_scale,
                                            LORA, ROPE, BLOCK_PE, False, DOT_PRECISION)
        for start in range(full_end, kv_end, BLOCK_N):  # the sequence's partial last block, if any
            keys, ok = _page_keys(table, start, kv_end, stride_page, stride_slot, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_entries(q_c, q_pe, acc, m_i, l_i, pages_ptr, keys, ok, ok[None, :], qk_scale,
                                            LORA, ROPE, BLOCK_PE, True, DOT_PRECISION)
    out_rows = split * stride_ps + token * stride_pn + head * stride_ph
    tl.store(part_o_ptr + out_rows[:, None] + dims[None, :], acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(part_lse_ptr + split * stride_ls + token * stride_ln + head, m_i + tl.math.log2(l_i), mask=row_ok)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_latent_inputs(q: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor, prefix_lens: torch.Tensor,
                        tree_entries: torch.Tensor, cu_tree: torch.Tensor, tree_mask: torch.Tensor,
                        value_dim: int, max_tree_len: int) -> None:
    """Shapes, dtypes and strides, before any launch."""
    _require(q.dim() == 3 and pages.dim() == 4 and pages.shape[2] == 1,
             "q must be [N, H, C] and pages [num_pages, P, 1, C]")
    latent_dim = q.shape[2]
    _require(pages.shape[3] == latent_dim and tree_entries.shape == (q.shape[0], latent_dim),
             "pages, tree entries and q must share the entry width C")
    _require(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported dtype {q.dtype}")
    _require(pages.dtype == q.dtype and tree_entries.dtype == q.dtype, "q, pages and tree entries must share a dtype")
    _require(16 <= value_dim <= 512 and value_dim & (value_dim - 1) == 0,
             f"kv_lora_rank {value_dim} must be a power of two in 16..512")
    _require(0 < latent_dim - value_dim <= 64, f"the RoPE part ({latent_dim - value_dim}) must be 1..64 wide")
    page_size = pages.shape[1]
    _require(16 <= page_size <= 256 and page_size & (page_size - 1) == 0, f"page size {page_size} unsupported")
    _require(q.stride(2) == 1 and pages.stride(3) == 1 and tree_entries.stride(1) == 1,
             "the entry axis must be contiguous")
    _require(block_tables.dim() == 2 and block_tables.dtype == torch.int32, "block_tables must be [B, pages] int32")
    _require(prefix_lens.shape == (block_tables.shape[0],) and prefix_lens.dtype == torch.int32,
             "prefix_lens must be [B] int32")
    _require(cu_tree.shape == (block_tables.shape[0] + 1,) and cu_tree.dtype == torch.int32,
             "cu_tree must be [B + 1] int32")
    _require(tree_mask.dim() == 2 and tree_mask.shape[0] == q.shape[0] and tree_mask.dtype == torch.int32
             and tree_mask.shape[1] * 32 >= max_tree_len and tree_mask.stride(1) == 1,
             "tree_mask must be [N, ceil(max_tree_len / 32)] int32, contiguous words")
    _require(max_tree_len <= MAX_TREE_LEN, f"max_tree_len {max_tree_len} > {MAX_TREE_LEN}")
    _require(len({t.device for t in (q, pages, block_tables, prefix_lens, tree_entries, cu_tree, tree_mask)}) == 1,
             "tensors on one device")


def latent_verify_attention(
    q: torch.Tensor,  # [N, H, C] absorbed queries (C = kv_lora_rank + rope dim)
    pages: torch.Tensor,  # [num_pages, P, 1, C] one layer's latent pool
    block_tables: torch.Tensor,  # [B, max_pages] int32
    prefix_lens: torch.Tensor,  # [B] int32
    tree_entries: torch.Tensor,  # [N, C] the block's own entries
    cu_tree: torch.Tensor,  # [B + 1] int32
    tree_mask: torch.Tensor,  # [N, W] int32
    sm_scale: float,
    value_dim: int,
    max_prefix_len: int,
    max_tree_len: int,
    cfg: SplitConfig | None = None,
) -> torch.Tensor:  # [N, H, value_dim]
    """Same result as `reference.latent_verify_attention_reference`; `max_prefix_len` and `max_tree_len` are
    host-side upper bounds that only pick the launch shape (see `verify_attention.hybrid_verify_attention`)."""
    check_latent_inputs(q, pages, block_tables, prefix_lens, tree_entries, cu_tree, tree_mask, value_dim, max_tree_len)
    check_host_bounds(sm_scale, max_prefix_len, max_tree_len)
    num_tokens, num_heads, latent_dim = q.shape
    num_seqs = block_tables.shape[0]
    rows = num_heads * max_tree_len
    hopper = cfg is None and hopper_prefix(q, value_dim, rows)
    triton_cfg = cfg or default_latent_config(rows, value_dim)
    plan = plan_splits(num_seqs, 1, rows, max_prefix_len, q.device, cfg or prefix_config(q, value_dim, rows))
    part_o = q.new_empty(plan.num_splits + 1, num_tokens, num_heads, value_dim, dtype=torch.float32)
    part_lse = q.new_empty(plan.num_splits + 1, num_tokens, num_heads, dtype=torch.float32)
    if num_tokens and num_seqs:
        qk_scale = sm_scale * LOG2E
        first_split, num_m_blocks, block_m, block_n = 0, plan.num_m_blocks, plan.block_m, plan.block_n
        if hopper:  # the prefix splits on warpgroup MMAs; the tree split below, on the Triton kernel's tiles
            if plan.num_splits:
                latent_prefix_sm90.latent_prefix_partials(q, pages, block_tables, prefix_lens, cu_tree, part_o,
                                                          part_lse, qk_scale, plan.num_splits, plan.num_m_blocks)
            first_split, block_m, block_n = plan.num_splits, triton_cfg.block_m, triton_cfg.block_n
            num_m_blocks = triton.cdiv(rows, block_m)
        rope = latent_dim - value_dim
        _latent_partials_kernel[(num_m_blocks, plan.num_splits + 1 - first_split, num_seqs)](
            q, pages, block_tables, prefix_lens, cu_tree, tree_entries, tree_mask, part_o, part_lse,
            qk_scale, plan.num_splits, first_split,
            q.stride(0), q.stride(1), pages.stride(0), pages.stride(1), block_tables.stride(0),
            tree_entries.stride(0), tree_mask.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            NUM_HEADS=num_heads, LORA=value_dim, ROPE=rope, BLOCK_PE=max(16, triton.next_power_of_2(rope)),
            PAGE_SIZE=pages.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q),
            num_warps=triton_cfg.num_warps, num_stages=triton_cfg.num_stages,
        )
    return merge_partials(part_o, part_lse, cu_tree, prefix_lens, plan, True, max_tree_len, q.dtype)
