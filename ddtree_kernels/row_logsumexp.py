"""The log-sum-exp of each row of a wide tensor (the drafter's logits over the vocabulary), in fp32, in one read.

`torch.logsumexp` needs fp32 input for fp32 accuracy, so the drafter's bf16 logits were first copied to fp32
([S, B-1, V] at V = 152k) and then reduced. Here each row is read once in its own dtype: every lane keeps a running
max and a sum of exponentials relative to it across the row's tiles, and the lanes are merged at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _logsumexp_kernel(x_ptr, out_ptr, num_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_cols, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < num_cols,
                    other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)  # NOTE: -inf - -inf is nan; -inf - 0 adds 0
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    shift = tl.where(row_max > float("-inf"), row_max, 0.0)
    tl.store(out_ptr + row, shift + tl.log(tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0)))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x.float(), -1) for x [..., C] with a contiguous last axis -> fp32 [...]."""
    if x.stride(-1) != 1:
        raise ValueError("the last axis must be contiguous")
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _logsumexp_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), BLOCK=BLOCK, num_warps=8)
    return out.view(x.shape[:-1])
