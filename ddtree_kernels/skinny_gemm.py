"""y = x @ w.T (+ bias) for the few rows of a verify or decode step: one streaming pass over w.

With 1-32 rows a projection is bound by reading its weight matrix, and a fixed ramp-up and tail per launch
keeps cuBLAS and this kernel alike below the copy rate (benchmarks/results/skinny_gemm.md compares the two
per layer projection). Here the weight tile is the wide side of the MMA (swap-AB: the accumulator is
[BLOCK_N, BLOCK_M]) and each program streams its own rows of w through a four-deep load pipeline, without
split-K (it gained nothing at these shapes). The gated form computes the MLP's
gate and up tiles side by side and writes silu(gate) * up, so the [rows, 2I] intermediate and the SiLU
kernel disappear.

Every output row is computed alone, in the same reduction order for any row count that maps to the
same BLOCK_M, so up to 16 rows a row's result does not depend on how many rows share the call
(tests/test_skinny_gemm.py checks 1 row against 16 bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 32  # at 64 rows cuBLAS is faster (x is re-read once per weight tile; skinny_gemm.md)
_STAGES = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, K, UP_OFFSET, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = w_ptrs + UP_OFFSET * stride_wn  # GATED: the up rows sit UP_OFFSET rows below the gate rows
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_t = tl.trans(tl.load(x_ptrs + k0, mask=offs_m[:, None] < M, other=0.0))
        acc = tl.dot(tl.load(w_ptrs + k0), x_t, acc)
        if GATED:
            acc_up = tl.dot(tl.load(up_ptrs + k0), x_t, acc_up)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(bias_ptr + UP_OFFSET + offs_n).to(tl.float32)[:, None]
    if GATED:  # rounded where the unfused path rounds: each GEMM output, then F.silu, then the product
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(dtype), mask=offs_m[None, :] < M)


def _largest_divisor(n: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def _tiles(rows: int, n: int, k: int, gated: bool) -> tuple[int, int] | None:
    """(BLOCK_N, BLOCK_K) for x [rows, k] and an [n, k] weight, or None if they do not tile. A gated program
    reads two weight tiles per step, and past 32 rows the x tile grows: both take a shorter reduction step
    (the gated tiles were timed on an H200: benchmarks/results/skinny_gemm.md)."""
    block_n = _largest_divisor(n, (64, 32) if gated else (64, 32, 16))
    block_k = _largest_divisor(k, (64, 32) if gated else (256, 128, 64, 32) if rows <= 32 else (128, 64, 32))
    return None if block_n is None or block_k is None else (block_n, block_k)


def fits(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `linear` / `silu_mul_linear` take this call: 1..MAX_ROWS rows, fp16/bf16, dims that tile."""
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1
            and (not gated or weight.shape[0] % 2 == 0) and _tiles(x.shape[0], n, x.shape[1], gated) is not None)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    if not fits(x, weight, gated):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} do not fit "
                         f"the skinny GEMM (1..{MAX_ROWS} rows, fp16/bf16, contiguous rows, tiling dims)")
    (m, k), n = x.shape, weight.shape[0] // 2 if gated else weight.shape[0]
    block_n, block_k = _tiles(m, n, k, gated)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(n // block_n,)](
        x, weight, weight if bias is None else bias, out, m, k, n, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4, num_stages=_STAGES,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], weight [N, K] (see `fits`)."""
    return _launch(x, weight, bias, gated=False)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up where gate, up = F.linear(x, weight, bias).chunk(2, -1): the fused gate/up projection
    and the SiLU product in one pass ([M, N/2])."""
    return _launch(x, weight, bias, gated=True)
