"""Building blocks shared by the target model and the DFlash drafter."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.ops import row_ops


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) computed by the row ops of x's device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_ops(x).linear(x, self.weight, self.bias)


class LayerAttention(Protocol):
    """The attention of one layer over whatever KV state the caller keeps (pages, drafter cache)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] for the same N tokens -> [N, Hq, D]."""
        ...

    def kv_buffers(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this layer's K and V end up ([N, Hkv, D] each), so the projection can write them there
        directly instead of the caller copying them; None when the caller keeps no such buffer."""
        ...

    def latent(self, layer: int, q: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """MLA in absorbed form: q [N, H, C] and the cache entries [N, C] of the same N tokens (C = latent_dim)
        -> [N, H, kv_lora_rank]: softmax(q . entry * ModelConfig.attention_scale) over the visible entries,
        weighting their first kv_lora_rank columns (the latents). The scale is read from the config, not
        passed: MLA's differs from 1/sqrt(C)."""
        ...

    def latent_rows(self, layer: int, num_tokens: int) -> torch.Tensor | None:
        """MLA: where this layer's cache entries of the N tokens end up ([N, latent_dim]), so the layer can write
        them there directly instead of `latent` copying them; None when the caller keeps no such buffer."""
        ...

    def latent_expanded(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, entries: torch.Tensor,
                        w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor | None:
        """MLA over per-head keys and values expanded from the entries through kv_b_proj's halves W_UK [H, nope, r]
        and W_UV [H, v, r] (cheaper than the absorbed form for a long prefill chunk): q_nope [N, H, nope], q_rope
        [N, H, rope] rotated -> [N, H, v], the values already through W_UV. None where the caller attends in
        absorbed form only (`latent`)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_ops(x).rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: (x + delta, norm(x + delta)); no add when delta is None."""
        if delta is None:
            return x, self(x)
        return row_ops(x).add_rms_norm(x, delta, self.weight, self.eps)


class FusedLinear(nn.Module):
    """Several projections of one input as one GEMM (fewer launches, better bandwidth on skinny inputs).
    The checkpoint's weights become views of the fused matrix, so names, loading and memory are unchanged;
    the fused tensors are non-persistent buffers, so `.to()` moves them and state dicts never see them."""

    def __init__(self, *linears: Linear):
        super().__init__()
        self.register_buffer("weight", torch.cat([linear.weight.detach() for linear in linears]), persistent=False)
        has_bias = linears[0].bias is not None
        bias = torch.cat([linear.bias.detach() for linear in linears]) if has_bias else None
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = [linear.out_features for linear in linears]
        start = 0
        for linear, size in zip(linears, self.sizes):
            linear.weight = nn.Parameter(self.weight[start:start + size], requires_grad=False)
            if has_bias:
                linear.bias = nn.Parameter(self.bias[start:start + size], requires_grad=False)
            start += size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return row_ops(x).linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.gate_up: FusedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(x))

    def fuse_projections(self) -> None:
        """gate/up as one GEMM; idempotent (captured CUDA graphs read the weights in place)."""
        if self.gate_up is None:
            self.gate_up = FusedLinear(self.gate_proj, self.up_proj)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x), from the fused gate/up projection when there is one."""
        if self.gate_up is not None:
            return row_ops(x).silu_mul_linear(x, self.gate_up.weight, self.gate_up.bias)
        return row_ops(x).silu_mul(self.gate_proj(x), self.up_proj(x))


class Attention(nn.Module):
    """Q/K/V/O projections with optional per-head q/k norm (Qwen3) and RoPE."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: FusedLinear | None = None

    def forward(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: LayerAttention) -> torch.Tensor:
        """x: [N, hidden] normed -> [N, hidden]; `layer` is this layer's index for `attend`."""
        q, k, v = self.project(x, cos, sin, attend.kv_buffers(layer, x.shape[0]))
        return self.output(attend(layer, q, k, v))

    def fuse_projections(self) -> None:
        """Q/K/V as one GEMM; idempotent (captured CUDA graphs read the weights in place)."""
        if self.qkv is None:
            self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """q [N, Hq, D], k and v [N, Hkv, D] of the same tokens; on CUDA k and v land in `kv_out` if given
        (once the projections are fused)."""
        if self.qkv is None:
            return self.query(x, cos, sin), *self.key_value(x, cos, sin)
        q, k, v = (t.view(x.shape[0], -1, self.head_dim) for t in self.qkv(x))
        if self.q_norm is None:  # Llama: no q/k norms
            q_weight = k_weight = None
            eps = 0.0
        else:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return row_ops(x).qkv_norm_rope(q, k, v, q_weight, k_weight, eps, cos, sin, kv_out)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)  # [N, Hq, D]
        return norm_rope(q, self.q_norm, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        return norm_rope(k, self.k_norm, cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], -1))


def norm_rope(x: torch.Tensor, norm: RMSNorm | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The per-head q/k norm (when the model has one) and RoPE; x: [N, H, D]."""
    return row_ops(x).norm_rope(x, None if norm is None else norm.weight, norm.eps if norm else 0.0, cos, sin)
