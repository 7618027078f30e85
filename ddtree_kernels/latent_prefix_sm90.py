"""The prefix splits of the MLA verify attention on Hopper (sm_90), in Gluon with warpgroup MMAs.

Why a second kernel: the Triton kernel (`latent_verify`) is compute-bound and tops out with 32-row mma.sync tiles
(~160 TFLOP/s on an H200), because a 64-row tile, the least a warpgroup MMA takes, needs a [64, 512] fp32
accumulator that one warpgroup cannot hold in registers. Here two warpgroups share each 64-row tile: the scores
[64 rows, 64 keys] are cut by keys between them, the softmax row statistics are reduced over both, the
probabilities go through shared memory, and each warpgroup accumulates half of the 512 value columns. Latent tiles
are double-buffered with cp.async (any page size), so the next block's loads run under this block's MMAs.

Same grid, chunking and outputs as the prefix programs of `_latent_partials_kernel` (splits [0, num_splits));
the tree block and the merge stay with the Triton kernels.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ddtree_kernels.split_kv import MIN_SPLIT_BLOCKS, SplitConfig

BLOCK_M = gl.constexpr(64)  # query rows per tile: the M of one warpgroup MMA
BLOCK_N = gl.constexpr(64)  # keys per step
LORA = gl.constexpr(512)  # the latent width laid out for (every MLA model served: V2-Lite, V3, K2, GLM-4.7-Flash)
ROPE = gl.constexpr(64)
NUM_WARPS = gl.constexpr(8)  # two warpgroups
MIN_BLOCKS = gl.constexpr(MIN_SPLIT_BLOCKS.value)
CONFIG = SplitConfig(block_m=BLOCK_M.value, block_n=BLOCK_N.value, num_warps=NUM_WARPS.value, num_stages=2,
                     programs_per_sm=1)


def supports(q: torch.Tensor, value_dim: int, rows: int) -> bool:
    """Whether `latent_prefix_partials` serves this launch: bf16/fp16 on an sm_90 GPU, the 512 + 64 entry, and at
    least one full tile of query rows (tokens x heads; fewer leave most of the 64-row MMA idle)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and value_dim == LORA.value
            and q.shape[-1] == LORA.value + ROPE.value and rows >= BLOCK_M.value and _is_sm90(q.device))


@functools.cache
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


@gluon.jit
def _issue_block_load(c_buf, pe_buf, pages_ptr, table, start, kv_end, stride_page, stride_slot,
                      PAGE_SIZE: gl.constexpr, LOAD: gl.constexpr):
    """cp.async the latent and RoPE parts of keys [start, start + BLOCK_N) into one buffer (zeros past kv_end)."""
    offs = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    ok = offs < kv_end
    page = gl.load(table + offs // PAGE_SIZE, mask=ok, other=0).to(gl.int64)
    base = page * stride_page + (offs % PAGE_SIZE).to(gl.int64) * stride_slot
    cols = gl.arange(0, LORA, layout=gl.SliceLayout(0, LOAD))
    pe_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LOAD))
    async_copy.async_copy_global_to_shared(c_buf, pages_ptr + base[:, None] + cols[None, :], mask=ok[:, None])
    async_copy.async_copy_global_to_shared(pe_buf, pages_ptr + base[:, None] + LORA + pe_cols[None, :],
                                           mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _softmax_into(s, m_i, l_acc, start, kv_end, key_cols, qk_scale, p_smem):
    """Online-softmax step over the scores of keys [start, start + BLOCK_N): the probabilities go to `p_smem` for
    the value MMA; returns the new row max, the running sums and the factor that rescales the accumulator.

    The row sums stay per thread ([BLOCK_M, BLOCK_N] `l_acc`, summed once at the end): a per-step sum would cost a
    cross-warpgroup reduction, two more barriers, every step."""
    s = gl.where((start + key_cols < kv_end)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: a block past the chunk has no key at all
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    return m_new, l_acc * alpha[:, None] + p, alpha


@gluon.jit
def _latent_prefix_kernel(
    q_ptr, pages_ptr, block_tables_ptr, prefix_lens_ptr, cu_q_ptr,
    part_o_ptr, part_lse_ptr,  # [S, N, H, LORA] fp32, [S, N, H] fp32
    qk_scale, num_splits,
    stride_qn, stride_qh, stride_page, stride_slot, stride_bt,
    stride_ps, stride_pn, stride_ph, stride_ls, stride_ln,
    NUM_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr,
):
    m_block = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + seq)
    q_len = gl.load(cu_q_ptr + seq + 1) - q_start
    prefix_len = gl.load(prefix_lens_ptr + seq)
    # NOTE: must equal split_kv.split_chunk_len (a triton.jit function, which Gluon cannot call)
    blocks = gl.cdiv(gl.cdiv(prefix_len, BLOCK_N), gl.maximum(num_splits, 1))
    chunk_len = gl.maximum(blocks, MIN_BLOCKS) * BLOCK_N
    kv_start = split * chunk_len
    if (m_block * BLOCK_M < q_len * NUM_HEADS) & (kv_start < prefix_len):
        kv_end = gl.minimum(kv_start + chunk_len, prefix_len)
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, LORA // 2, 16])
        WIDE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, LORA], WIDE)
        q_pe_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], WIDE)
        c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LORA], WIDE)
        pe_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], WIDE)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], WIDE)

        rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
        token = q_start + rows // NUM_HEADS
        q_rows = q_ptr + token.to(gl.int64) * stride_qn + (rows % NUM_HEADS) * stride_qh
        row_ok = (rows < q_len * NUM_HEADS)[:, None]
        cols = gl.arange(0, LORA, layout=gl.SliceLayout(0, LOAD))
        pe_cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, LOAD))
        async_copy.async_copy_global_to_shared(q_c_smem, q_rows[:, None] + cols[None, :], mask=row_ok)
        async_copy.async_copy_global_to_shared(q_pe_smem, q_rows[:, None] + LORA + pe_cols[None, :], mask=row_ok)
        table = block_tables_ptr + seq.to(gl.int64) * stride_bt
        _issue_block_load(c_smem.index(0), pe_smem.index(0), pages_ptr, table, kv_start, kv_end,
                          stride_page, stride_slot, PAGE_SIZE, LOAD)  # commits the query copies too

        acc = gl.zeros([BLOCK_M, LORA], dtype=gl.float32, layout=O_LAYOUT)
        m_i = gl.full([BLOCK_M], float("-inf"), dtype=gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        l_acc = gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=S_LAYOUT)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], dtype=gl.float32, layout=S_LAYOUT)
        key_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        num_blocks = gl.cdiv(kv_end - kv_start, BLOCK_N)
        # PV of block j and the scores of block j + 1 run back to back on the tensor cores; block j + 2's copies go
        # out as soon as PV j has released its buffer. The scores of the (all-masked) block past the chunk are
        # computed and add nothing.
        _issue_block_load(c_smem.index(1), pe_smem.index(1), pages_ptr, table, kv_start + BLOCK_N, kv_end,
                          stride_page, stride_slot, PAGE_SIZE, LOAD)
        async_copy.wait_group(1)
        fence_async_shared()
        s = warpgroup_mma(q_c_smem, c_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        s = warpgroup_mma(q_pe_smem, pe_smem.index(0).permute((1, 0)), s)
        m_i, l_acc, alpha = _softmax_into(s, m_i, l_acc, kv_start, kv_end, key_cols, qk_scale, p_smem)
        for j in range(num_blocks):
            buf = j % 2
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
            acc = warpgroup_mma(p_smem, c_smem.index(buf), acc, is_async=True)
            async_copy.wait_group(0)
            fence_async_shared()
            s = warpgroup_mma(q_c_smem, c_smem.index(1 - buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_pe_smem, pe_smem.index(1 - buf).permute((1, 0)), s, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
            _issue_block_load(c_smem.index(buf), pe_smem.index(buf), pages_ptr, table, kv_start + (j + 2) * BLOCK_N,
                              kv_end, stride_page, stride_slot, PAGE_SIZE, LOAD)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_acc, alpha = _softmax_into(s, m_i, l_acc, kv_start + (j + 1) * BLOCK_N, kv_end, key_cols,
                                              qk_scale, p_smem)
        async_copy.wait_group(0)

        l_i = gl.sum(l_acc, 1)
        out_rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_LAYOUT))
        out_token = q_start + out_rows // NUM_HEADS
        out = part_o_ptr + split * stride_ps + out_token.to(gl.int64) * stride_pn + (out_rows % NUM_HEADS) * stride_ph
        out_cols = gl.arange(0, LORA, layout=gl.SliceLayout(0, O_LAYOUT))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))
        gl.store(out[:, None] + out_cols[None, :], acc / l_o[:, None], mask=(out_rows < q_len * NUM_HEADS)[:, None])
        lse_rows = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
        lse_token = q_start + lse_rows // NUM_HEADS
        gl.store(part_lse_ptr + split * stride_ls + lse_token * stride_ln + lse_rows % NUM_HEADS,
                 m_i + gl.log2(l_i), mask=lse_rows < q_len * NUM_HEADS)


def latent_prefix_partials(q: torch.Tensor, pages: torch.Tensor, block_tables: torch.Tensor,
                           prefix_lens: torch.Tensor, cu_tree: torch.Tensor, part_o: torch.Tensor,
                           part_lse: torch.Tensor, qk_scale: float, num_splits: int, num_m_blocks: int) -> None:
    """Write partials [0, num_splits) of `latent_verify_attention` (inputs checked there; `supports` holds)."""
    _latent_prefix_kernel[(num_m_blocks, num_splits, block_tables.shape[0])](
        q, pages, block_tables, prefix_lens, cu_tree, part_o, part_lse, qk_scale, num_splits,
        q.stride(0), q.stride(1), pages.stride(0), pages.stride(1), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        NUM_HEADS=q.shape[1], PAGE_SIZE=pages.shape[1], num_warps=NUM_WARPS.value,
    )
