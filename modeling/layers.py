"""Building blocks shared by the target model and the DFlash drafter."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from modeling.config import ModelConfig
from modeling.rope import apply_rotary


class LayerAttention(Protocol):
    """The attention of one layer over whatever KV state the caller keeps (pages, drafter cache)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] for the same N tokens -> [N, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32 and scale after casting back, as HF checkpoints were trained.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Q/K/V/O projections with optional per-head q/k norm (Qwen3) and RoPE."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)  # [N, Hq, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rotary(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn.reshape(attn.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: LayerAttention) -> torch.Tensor:
        h = self.input_layernorm(x)
        q = self.self_attn.query(h, cos, sin)
        k, v = self.self_attn.key_value(h, cos, sin)
        x = x + self.self_attn.output(attend(index, q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))
