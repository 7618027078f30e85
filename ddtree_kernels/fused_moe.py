"""Fused mixture-of-experts MLP for the few hundred tokens of a verify step: two grouped GEMM launches. (A prefill
chunk's thousands of tokens take torch's grouped GEMM where it runs, `modeling.moe.grouped_gemm_experts`, with this
module's pair sum.)

A step of T tokens sends T x k (token, expert) pairs to the routed experts, so it touches most experts with a
few rows each: the cost is reading each touched expert's weights once. The pairs are sorted by expert on the
device and cut into blocks of BLOCK_M pairs of one expert (`expert_blocks`, one launch with no host sync, so the
whole MLP replays inside a CUDA graph); then
1. `_gate_up_kernel`: each program multiplies one block's tokens by one column tile of the expert's fused
   gate/up matrix and writes silu(gate) * up for those pairs;
2. `_down_kernel`: the down projection of each block, times the pair's routing weight, written per pair;
and the k pairs of each token are summed in fp32 (a fixed order: the result does not depend on scheduling).
Experts outside `[first_expert, first_expert + E)` belong to another tensor-parallel rank: their pairs add 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoELaunch:
    """Launch shape of both GEMMs."""

    block_m: int  # pairs per block (all of one expert)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_moe_launch(num_pairs: int) -> MoELaunch:
    """Tuned on an H200 (benchmarks/results/moe_layer.md, the sweep): a few pairs per expert at verify sizes, so
    16-pair blocks; from ~8 pairs per expert on, 32-pair blocks read each expert's weights fewer times."""
    if num_pairs <= 512:
        return MoELaunch(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return MoELaunch(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)


@dataclass(frozen=True)
class ExpertBlocks:
    """Pairs sorted by expert and cut into blocks of one expert each; blocks past the last used one are empty."""

    order: torch.Tensor  # [P] int32: pair ids (token * k + slot), grouped by expert, in pair order within each
    expert: torch.Tensor  # [max_blocks] int32: the block's local expert, E for an empty block
    start: torch.Tensor  # [max_blocks] int32: first position in `order`
    end: torch.Tensor  # [max_blocks] int32: one past the last (start == end: empty)


# NOTE: the layout kernel's one-hot tiles, [pairs (or blocks) per loop step, expert bins] integers: as many pairs
# a step as keep a tile at this many elements (8 warps: 32 registers a thread), so few steps run in sequence and
# Kimi K2's 385 bins (padded to 512) still fit
TILE_ELEMENTS = 8192


# NOTE: up to this many pairs (a verify step of 16 tokens routed to 8 experts and a shared one: 144) the layout
# counts every pair's place at once (`_expert_blocks_ranked_kernel`, [pairs, pairs] comparisons in tiles)
RANKED_MAX_PAIRS = 256


# NOTE: the layout kernel is one program walking the pairs in sequence: as CUDA-graph replays on an H100, 26 us for
# 256 pairs (the sort: 79), 96 for 1536 (99), 234 for 4096 (109), 912 for 16k (159); beyond this many a sort does it
LAYOUT_KERNEL_MAX_PAIRS = 1536


def expert_blocks(ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int) -> ExpertBlocks:
    """ids: [N, k] global expert ids. No host sync either way: capturable in a CUDA graph. Up to
    LAYOUT_KERNEL_MAX_PAIRS pairs (verify sizes) one launch of fixed shapes (the torch ops it replaces were ~30
    launches, most of the layer's time outside its GEMMs there); more, `expert_blocks_by_sort`."""
    num_pairs = ids.numel()
    if num_pairs > LAYOUT_KERNEL_MAX_PAIRS:
        return expert_blocks_by_sort(ids, first_expert, num_experts, block_m)
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    order = torch.empty(num_pairs, dtype=torch.int32, device=ids.device)
    expert, start, end = torch.empty(3, max_blocks, dtype=torch.int32, device=ids.device)
    if max_blocks:
        bins = triton.next_power_of_2(num_experts + 1)
        block_pairs = max(16, min(128, TILE_ELEMENTS // bins))
        if num_pairs <= RANKED_MAX_PAIRS:
            pairs = triton.next_power_of_2(num_pairs)
            _expert_blocks_ranked_kernel[(1,)](
                ids.contiguous(), order, expert, start, end, num_pairs, first_expert, max_blocks,
                NUM_EXPERTS=num_experts, EXPERTS_PAD=bins, BLOCK_M=block_m, PAIRS=pairs,
                COLUMNS=max(1, min(pairs, TILE_ELEMENTS // pairs)), BLOCK_PAIRS=block_pairs, num_warps=8)
        else:
            _expert_blocks_kernel[(1,)](
                ids.contiguous(), order, expert, start, end, num_pairs, first_expert, max_blocks,
                NUM_EXPERTS=num_experts, EXPERTS_PAD=bins, BLOCK_M=block_m, BLOCK_PAIRS=block_pairs, num_warps=8)
    return ExpertBlocks(order, expert, start, end)


def expert_blocks_by_sort(ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int) -> ExpertBlocks:
    """The same layout from torch's stable sort (a block's expert: how many experts' blocks end at or before it)."""
    local, order, counts = pairs_by_expert(ids, first_expert, num_experts)
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    pair_start = counts.cumsum(0) - counts
    index = torch.arange(triton.cdiv(local.numel(), block_m) + min(num_experts, local.numel()), device=ids.device)
    expert = torch.searchsorted(block_end, index, right=True)
    own = expert.clamp(max=num_experts - 1)
    start = pair_start[own] + (index - (block_end - blocks)[own]) * block_m
    end = torch.where(expert < num_experts, torch.minimum(start + block_m, pair_start[own] + counts[own]), start)
    return ExpertBlocks(*(t.to(torch.int32) for t in (order, expert, start, end)))


def pairs_by_expert(ids: torch.Tensor, first_expert: int,
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [N, k] global expert ids -> the pairs' local experts [N * k] (`num_experts` for another rank's), the
    pair ids in a stable order by local expert (another rank's last), and [E] int64 pairs per local expert (no
    host sync, as bincount would have)."""
    local = ids.flatten() - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=local.device)
    counts = counts.index_add_(0, local, torch.ones_like(local))[:num_experts]
    return local, local.argsort(stable=True), counts


@triton.jit
def _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    """The pairs' experts on this rank, NUM_EXPERTS for another rank's, EXPERTS_PAD (no bin) past the last pair."""
    local = (tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=0) - first_expert).to(tl.int32)
    local = tl.where((local >= 0) & (local < NUM_EXPERTS), local, NUM_EXPERTS)
    return tl.where(pairs < num_pairs, local, EXPERTS_PAD)


@triton.jit
def _expert_blocks_kernel(
    ids_ptr, order_ptr, expert_ptr, start_ptr, end_ptr, num_pairs, first_expert, max_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):
    """One program: the pairs counted per expert (bin NUM_EXPERTS: another rank's, sorted last), each pair's place
    in the stable order by expert (its expert's first place plus the earlier pairs of that expert), a tile of pairs
    after another, then each block's expert and range (`_write_blocks`)."""
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for first in range(0, num_pairs, BLOCK_PAIRS):
        local = _local_experts(ids_ptr, first + tl.arange(0, BLOCK_PAIRS), num_pairs, first_expert, NUM_EXPERTS,
                               EXPERTS_PAD)
        counts += tl.sum((local[:, None] == experts[None, :]).to(tl.int32), axis=0)
    places = tl.cumsum(counts, axis=0) - counts  # NOTE: every expert's first place in the order
    for first in range(0, num_pairs, BLOCK_PAIRS):
        pairs = first + tl.arange(0, BLOCK_PAIRS)
        local = _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS, EXPERTS_PAD)
        hot = (local[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_PAIRS, EXPERTS_PAD]
        place = tl.sum(hot * (places[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
        tl.store(order_ptr + place, pairs, mask=pairs < num_pairs)
        places += tl.sum(hot, axis=0)
    _write_blocks(counts, expert_ptr, start_ptr, end_ptr, max_blocks, NUM_EXPERTS, EXPERTS_PAD, BLOCK_M,
                  BLOCK_PAIRS)


@triton.jit
def _expert_blocks_ranked_kernel(
    ids_ptr, order_ptr, expert_ptr, start_ptr, end_ptr, num_pairs, first_expert, max_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
    COLUMNS: tl.constexpr, BLOCK_PAIRS: tl.constexpr,
):
    """One program for up to PAIRS pairs: every pair's place in the stable order by expert at once (the pairs
    before it there: those of a smaller expert, or of its own expert and earlier), counted over tiles of COLUMNS
    other pairs, and the counts per expert as a histogram; no pass over the pairs depends on the last one's
    running places, as the tiled kernel's do."""
    pairs = tl.arange(0, PAIRS)
    local = _local_experts(ids_ptr, pairs, num_pairs, first_expert, NUM_EXPERTS, EXPERTS_PAD)
    place = tl.zeros([PAIRS], dtype=tl.int32)
    for first in range(0, PAIRS, COLUMNS):
        others = first + tl.arange(0, COLUMNS)
        other = _local_experts(ids_ptr, others, num_pairs, first_expert, NUM_EXPERTS, EXPERTS_PAD)
        earlier = others[None, :] < pairs[:, None]
        before = (other[None, :] < local[:, None]) | ((other[None, :] == local[:, None]) & earlier)
        place += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + place, pairs, mask=pairs < num_pairs)
    counts = tl.histogram(tl.minimum(local, NUM_EXPERTS), EXPERTS_PAD)  # NOTE: padding pairs in another rank's bin
    _write_blocks(counts, expert_ptr, start_ptr, end_ptr, max_blocks, NUM_EXPERTS, EXPERTS_PAD, BLOCK_M,
                  BLOCK_PAIRS)


@triton.jit
def _write_blocks(counts, expert_ptr, start_ptr, end_ptr, max_blocks, NUM_EXPERTS: tl.constexpr,
                  EXPERTS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    """From the pairs per expert bin ([EXPERTS_PAD]; bins from NUM_EXPERTS on are not this rank's): each block's
    expert and range (a block's expert: how many experts' blocks end at or before it)."""
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.where(experts < NUM_EXPERTS, counts, 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    pair_start = tl.cumsum(counts, axis=0) - counts
    for first in range(0, max_blocks, BLOCK_PAIRS):
        index = first + tl.arange(0, BLOCK_PAIRS)
        ended = (block_end[None, :] <= index[:, None]) & (experts[None, :] < NUM_EXPERTS)
        expert = tl.sum(ended.to(tl.int32), axis=1)
        own = (tl.minimum(expert, NUM_EXPERTS - 1)[:, None] == experts[None, :]).to(tl.int32)
        first_block = tl.sum(own * (block_end - blocks)[None, :], axis=1)
        start = tl.sum(own * pair_start[None, :], axis=1) + (index - first_block) * BLOCK_M
        last = tl.sum(own * (pair_start + counts)[None, :], axis=1)
        end = tl.where(expert < NUM_EXPERTS, tl.minimum(start + BLOCK_M, last), start)
        tl.store(expert_ptr + index, expert, mask=index < max_blocks)
        tl.store(start_ptr + index, start, mask=index < max_blocks)
        tl.store(end_ptr + index, end, mask=index < max_blocks)


@triton.jit
def _block_rows(order_ptr, expert_ptr, start_ptr, end_ptr, block, BLOCK_M: tl.constexpr):
    """The block's expert, its positions in the sorted order, which are real, and their pair ids."""
    expert = tl.load(expert_ptr + block)
    start = tl.load(start_ptr + block)
    slots = start + tl.arange(0, BLOCK_M)
    ok = slots < tl.load(end_ptr + block)
    pairs = tl.load(order_ptr + slots, mask=ok, other=0)
    return expert, slots, ok, pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, order_ptr, expert_ptr, start_ptr, end_ptr, h_ptr,  # h: [P, I] rows in sorted order
    hidden, inter, stride_xn, stride_we, stride_wn, stride_hn,
    TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, slots, ok, pairs = _block_rows(order_ptr, expert_ptr, start_ptr, end_ptr, tl.program_id(0), BLOCK_M)
    if expert >= NUM_EXPERTS:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * stride_xn
    w = w13_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w + cols.to(tl.int64) * stride_wn
    up_rows = w + (inter + cols).to(tl.int64) * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_rows[:, None] + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w_gate = tl.load(gate_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        w_up = tl.load(up_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        gate = tl.dot(a, tl.trans(w_gate), gate)
        up = tl.dot(a, tl.trans(w_up), up)
    gate = gate.to(h_ptr.dtype.element_ty).to(tl.float32)  # NOTE: torch rounds each projection to the dtype
    up = up.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    out = h_ptr + slots.to(tl.int64)[:, None] * stride_hn + cols[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, weights_ptr, order_ptr, expert_ptr, start_ptr, end_ptr, y_ptr,  # y: [P, hidden] fp32 per pair
    hidden, inter, stride_hn, stride_we, stride_wn, stride_yn,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, slots, ok, pairs = _block_rows(order_ptr, expert_ptr, start_ptr, end_ptr, tl.program_id(0), BLOCK_M)
    if expert >= NUM_EXPERTS:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    h_rows = h_ptr + slots.to(tl.int64) * stride_hn
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_rows[:, None] + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows[:, None] + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # NOTE: the expert's output in the dtype, as in torch
    weight = tl.load(weights_ptr + pairs, mask=ok, other=0.0)
    out = y_ptr + pairs.to(tl.int64)[:, None] * stride_yn + cols[None, :]
    tl.store(out, acc * weight[:, None], mask=ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or x.stride(1) != 1:
        raise ValueError(f"x must be [N, {hidden}] with contiguous rows")
    if two_inter % 2 or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError("w13 must be [E, 2I, hidden] (gate rows, then up rows) and w2 [E, hidden, I]")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("expert weights need contiguous rows")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError("ids and weights must both be [N, k]")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError("x and the expert weights must share a dtype")


def fused_moe(
    x: torch.Tensor,  # [N, hidden]
    ids: torch.Tensor,  # [N, k] global expert ids
    weights: torch.Tensor,  # [N, k] fp32 routing weights
    w13: torch.Tensor,  # [E, 2I, hidden] the local experts' gate rows, then up rows
    w2: torch.Tensor,  # [E, hidden, I]
    first_expert: int = 0,
    cfg: MoELaunch | None = None,
) -> torch.Tensor:  # [N, hidden] fp32
    """Same result as `modeling.moe.MoE.run_experts` over the experts [first_expert, first_expert + E)."""
    _check(x, ids, weights, w13, w2)
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = w2.shape
    num_pairs = num_tokens * top_k
    cfg = cfg or default_moe_launch(num_pairs)
    y = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    if num_pairs:
        blocks = expert_blocks(ids, first_expert, num_experts, cfg.block_m)
        h = x.new_empty(num_pairs, inter)
        num_blocks = blocks.expert.numel()
        launch = dict(NUM_EXPERTS=num_experts, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
            x, w13, blocks.order, blocks.expert, blocks.start, blocks.end, h,
            hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), TOP_K=top_k, **launch)
        _down_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
            h, w2, weights.float().contiguous(), blocks.order, blocks.expert, blocks.start, blocks.end, y,
            hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), **launch)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


@triton.jit
def _pair_sum_kernel(rows_ptr, place_ptr, weights_ptr, local_ptr, out_ptr, hidden, num_experts, stride_r, stride_o,
                     TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """One token's columns: its k pairs' rows (found at their places in the expert order) times their weights, in
    slot order; a pair of another rank's expert adds 0 (its row was never written)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        place = tl.load(place_ptr + pair).to(tl.int64)
        held = tl.load(local_ptr + pair) < num_experts
        row = tl.load(rows_ptr + place * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
        acc += tl.where(held, row * tl.load(weights_ptr + pair), 0.0)  # NOTE: an unwritten row may hold NaN
    tl.store(out_ptr + token * stride_o + cols, acc, mask=inside)


def weighted_pair_sum(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """rows: [P, hidden] the pairs' expert outputs in `order` (pair ids sorted by expert); weights: [N, k] fp32;
    local: [P] the pairs' local experts (`num_experts`: another rank's) -> [N, hidden] fp32, each token's weighted
    sum, in one pass (the torch ops it replaces wrote the pairs in fp32 three times before summing them)."""
    num_tokens, top_k = weights.shape
    hidden = rows.shape[1]
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=rows.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if num_tokens:
        _pair_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
            rows, place, weights.float().contiguous(), local, out, hidden, num_experts, rows.stride(0),
            out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
