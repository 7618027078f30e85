"""The k most probable tokens of each row of logits, with their log-probs, ranked: the drafter's top-k per depth.

torch.topk over the drafter's [S * (B-1), V] logits (V = 152k) runs a radix select of several passes; at 64
sessions it took ~1.1 ms of an H100 for a 0.3 GB read, and the row log-sum-exp another read
(benchmarks/results/draft_commit_graphs.md). Here the values are read twice at most:

1. one pass takes each group of GROUP values' maximum and each chunk's (max, sum of exponentials);
2. torch.topk picks the k groups with the largest maxima, a small problem (V / GROUP values a row). Every value
   above the k-th largest group maximum lies in one of those groups, and they hold at least k values at or
   above it (each holds its maximum), so a top-k of the row lies among their k * GROUP values;
3. one program a row sorts those candidates on a 64-bit key (the value's order-preserving bits, then the token
   id reversed), keeps the k best, ranked by (value desc, token id asc), and subtracts the row's log-sum-exp
   merged from the chunks.

Which of several tokens tied at the k-th value are kept is this function's choice (torch.topk's, before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # values a group maximum covers
CHUNK = 4096  # values a program of the first pass reads


@triton.jit
def _group_max_kernel(x_ptr, group_max_ptr, partial_ptr, num_cols, stride_x, num_groups, num_chunks,
                      CHUNK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=float("-inf")).to(tl.float32)
    groups = chunk * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP)
    tl.store(group_max_ptr + row * num_groups + groups, tl.max(tl.reshape(x, [CHUNK // GROUP, GROUP]), axis=1),
             mask=groups < num_groups)
    top = tl.max(x, axis=0)
    shift = tl.where(top > float("-inf"), top, 0.0)  # NOTE: -inf - -inf is nan; -inf - 0 adds 0
    partial = partial_ptr + (row * num_chunks + chunk) * 2
    tl.store(partial, top)
    tl.store(partial + 1, tl.sum(tl.exp(x - shift), axis=0))


@triton.jit
def _select_kernel(x_ptr, stride_x, num_cols, picked_ptr, num_picked, partial_ptr, num_chunks, values_ptr,
                   ids_ptr, k, PICKED: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, PICKED)
    groups = tl.load(picked_ptr + row * num_picked + slots, mask=slots < num_picked, other=0)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    valid = (slots[:, None] < num_picked) & (cols < num_cols)
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    low = tl.full([], 0xFFFFFFFF, tl.int64)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed and monotonic in the value
    keys = tl.where(valid, (ordered << 32) | (low - cols), tl.full([], -(1 << 63), tl.int64))
    # NOTE: K >= 2: tl.topk of one value does not compile on sm_90 (Triton 3.6)
    best = tl.topk(tl.reshape(keys, [PICKED * GROUP]), K)  # descending: value desc, then token id asc
    high = best >> 32
    ids = low - (best & low)
    values = tl.where(high >= 0, high, high ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)

    chunks = tl.arange(0, CHUNKS)
    partial = partial_ptr + (row * num_chunks + chunks) * 2
    tops = tl.load(partial, mask=chunks < num_chunks, other=float("-inf"))
    sums = tl.load(partial + 1, mask=chunks < num_chunks, other=0.0)
    top = tl.max(tops, axis=0)
    shift = tl.where(top > float("-inf"), top, 0.0)
    lse = shift + tl.log(tl.sum(sums * tl.exp(tops - shift), axis=0))

    ranks = tl.arange(0, K)
    tl.store(values_ptr + row * k + ranks, values - lse, mask=ranks < k)
    tl.store(ids_ptr + row * k + ranks, ids, mask=ranks < k)


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best log-probs (fp32) and token ids of each row of logits [..., V] (contiguous last axis), each
    [..., min(k, V)], ranked by (log-prob desc, token id asc); log-prob = logit - the row's fp32 log-sum-exp."""
    if logits.stride(-1) != 1:
        raise ValueError("the last axis must be contiguous")
    num_cols = logits.shape[-1]
    k = min(k, num_cols)
    rows = logits.reshape(-1, num_cols)
    count = rows.shape[0]
    num_groups, num_chunks = triton.cdiv(num_cols, GROUP), triton.cdiv(num_cols, CHUNK)
    group_max = torch.empty(count, num_groups, dtype=torch.float32, device=logits.device)
    partials = torch.empty(count, num_chunks, 2, dtype=torch.float32, device=logits.device)
    values = torch.empty(count, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(count, k, dtype=torch.long, device=logits.device)
    if count:
        _group_max_kernel[(count, num_chunks)](rows, group_max, partials, num_cols, rows.stride(0), num_groups,
                                               num_chunks, CHUNK=CHUNK, GROUP=GROUP)
        picked = torch.topk(group_max, min(k, num_groups), dim=-1, sorted=False).indices
        _select_kernel[(count,)](rows, rows.stride(0), num_cols, picked, picked.shape[1], partials, num_chunks,
                                 values, ids, k, PICKED=triton.next_power_of_2(picked.shape[1]), GROUP=GROUP,
                                 K=max(2, triton.next_power_of_2(k)), CHUNKS=triton.next_power_of_2(num_chunks))
    shape = logits.shape[:-1] + (k,)
    return values.view(shape), ids.view(shape)
