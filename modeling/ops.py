"""The row-wise ops of a decoder layer, in plain torch or as fused Triton kernels; `row_ops(x)` picks by device.

The layers call these and never branch on the device themselves. `TorchRowOps` is the reference (CPU, and the
semantics); `TritonRowOps` replaces each op on CUDA tensors with one kernel, because inside a replayed CUDA graph
a decode step is bound by kernel count (ddtree_kernels/fused_layer_ops.py) and few-row GEMMs by how fast the
weight streams (ddtree_kernels/skinny_gemm.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from modeling.rope import apply_rotary


class TorchRowOps:
    """Plain torch. Ops are written in terms of each other, so a subclass that replaces one keeps the rest."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up where gate, up = linear(x, weight, bias).chunk(2, -1): weight is [gate; up] stacked."""
        gate, up = self.linear(x, weight, bias).chunk(2, dim=-1)
        return self.silu_mul(gate, up)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last axis of x."""
        # NOTE: normalise in fp32 and scale after casting back, as HF checkpoints were trained.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)): a residual add and the norm that follows it."""
        total = x + delta
        return total, self.rms_norm(total, weight, eps)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 log-sum-exp of each row of x ([..., C] -> [...]), as accurate as over x in fp32."""
        return torch.logsumexp(x.float(), dim=-1)

    def top_k_log_probs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable tokens of each row with their log-probs (logit - the row's fp32 log-sum-exp),
        ranked by (log-prob desc, token id asc); logits [..., V] -> fp32 values and int64 ids, each
        [..., min(k, V)]. Which of the tokens tied at the k-th value are kept is the implementation's choice."""
        values, ids = torch.topk(logits, min(k, logits.shape[-1]), dim=-1, sorted=True)
        return rank_top_k(values.float() - self.logsumexp(logits)[..., None], ids)

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The per-head norm (none when weight is None) and RoPE; x: [N, H, D], cos and sin: [N, D]; written into
        `out` ([N, H, D], any strides) when given."""
        rotated = apply_rotary(x if weight is None else self.rms_norm(x, weight, eps), cos, sin)
        return rotated if out is None else out.copy_(rotated)

    def latent_entry(self, kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """MLA's cache entry of each token from kv_a_proj_with_mqa's output kv [N, C + R] (its R RoPE columns as
        halves, cos and sin [N, R]): the C latent columns RMS-normalised by `weight`, the RoPE columns rotated ->
        [N, C + R], written into `out` when given."""
        rope = cos.shape[-1]
        entry = torch.cat([self.rms_norm(kv[:, :-rope], weight, eps),
                           self.norm_rope(kv[:, None, -rope:], None, 0.0, cos, sin)[:, 0]], dim=-1)
        return entry if out is None else out.copy_(entry)

    def qkv_norm_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """norm_rope of q and of k, v as is: q [N, Hq, D], k and v [N, Hkv, D]. `kv_out` ([N, Hkv, D] each) is
        where K and V may be written instead of new tensors; only some implementations do, so callers compare
        pointers. Both norms are given or neither (Qwen3 has both, Llama neither)."""
        return self.norm_rope(q, q_weight, eps, cos, sin), self.norm_rope(k, k_weight, eps, cos, sin), v


class TritonRowOps(TorchRowOps):
    """One fused kernel per op (same values, torch's rounding points kept); linears go through the skinny GEMM
    when x is a step's few rows, else through cuBLAS."""

    def __init__(self) -> None:
        # NOTE: imported here, not at module level: Triton reads TRITON_INTERPRET once, at its first import
        # (tests/conftest.py sets it), and machines without CUDA never need it.
        from ddtree_kernels import fused_layer_ops, row_logsumexp, row_top_k, skinny_gemm

        self.fused, self.gemm = fused_layer_ops, skinny_gemm
        self.row_logsumexp, self.row_top_k = row_logsumexp, row_top_k

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemm.fits(x, weight):
            return self.gemm.linear(x, weight, bias)
        return super().linear(x, weight, bias)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.fused.silu_mul(gate, up)

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gemm.fits(x, weight, gated=True):
            return self.gemm.silu_mul_linear(x, weight, bias)
        return super().silu_mul_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.fused.rms_norm(x, weight, eps)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        return self.row_logsumexp.logsumexp(x)

    def top_k_log_probs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_top_k.top_k_log_probs(logits, k)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fused.add_rms_norm(x, delta, weight, eps)

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.fused.norm_rope(x, weight, eps, cos, sin, out)

    def latent_entry(self, kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        return self.fused.latent_entry(kv, weight, eps, cos, sin, out)

    def qkv_norm_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch; K and V always land in `kv_out` when it is given."""
        k_out, v_out = kv_out or (torch.empty_like(k), torch.empty_like(v))
        q = self.fused.qkv_norm_rope(q, k, v, q_weight, k_weight, eps, cos, sin, k_out, v_out)
        return q, k_out, v_out


def rank_top_k(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order top-k rows by (value desc, token id asc): topk's order among equal values is unspecified.

    values, ids: [..., K] -> the same entries, reordered along the last dim; on their own device.
    """
    ids, by_id = torch.sort(ids, dim=-1)
    values = torch.gather(values, -1, by_id)
    values, by_value = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, torch.gather(ids, -1, by_value)


_TORCH_ROW_OPS = TorchRowOps()


@functools.cache
def _triton_row_ops() -> TritonRowOps:
    return TritonRowOps()


def row_ops(x: torch.Tensor) -> TorchRowOps:
    """The ops for x's device: the Triton kernels for a CUDA tensor (Triton loads at the first), else plain torch."""
    return _triton_row_ops() if x.is_cuda else _TORCH_ROW_OPS


def use_device(device: str | torch.device) -> None:
    """Make a CUDA `device` with an index the calling thread's current device: Triton launches a kernel on the
    thread's current device, not on its tensors' (a thread starts on device 0), so a model on cuda:1 would run its
    Triton kernels against device 0. Nothing for the CPU, or for a bare "cuda" (device 0 already)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
