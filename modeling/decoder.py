"""One decoder layer of any supported family: its attention (GQA or MLA) and its MLP (dense or MoE) are
picked from the config, so the layer itself only wires norms and residuals."""

from __future__ import annotations

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.layers import MLP, Attention, LayerAttention, RMSNorm
from modeling.mla import MLAttention
from modeling.moe import MoE


def make_attention(config: ModelConfig) -> Attention | MLAttention:
    return Attention(config) if config.mla is None else MLAttention(config)


def make_mlp(config: ModelConfig, index: int) -> MLP | MoE:
    """The routed experts in the config's sparse layers, else the dense MLP of intermediate_size."""
    if config.moe is not None and index in config.moe.sparse_layers:
        return MoE(config)
    return MLP(config)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int):
        """index: the layer's place in the stack (it decides dense MLP or MoE)."""
        super().__init__()
        self.self_attn = make_attention(config)
        self.mlp = make_mlp(config, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse_projections(self) -> None:
        """Q/K/V as one GEMM and gate/up as one where the layer has them (GQA attention, dense MLP), MLA's input
        projections as one, the routed experts stacked for the fused MoE kernel, for CUDA serving; the CPU path
        stays op by op. Idempotent: a second call must not move the weights, since captured CUDA graphs read them
        in place."""
        for module in (self.self_attn, self.mlp):
            if isinstance(module, (Attention, MLAttention, MLP, MoE)):
                module.fuse_projections()

    def forward(self, index: int, x: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attend: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is `x + pending` (the previous layer's MLP output, None for the first layer);
        returns the same pair for the next one. Each residual add runs fused into the norm that follows it."""
        x, h = self.input_layernorm.add_and_norm(x, pending)
        x, h = self.post_attention_layernorm.add_and_norm(x, self.self_attn(index, h, cos, sin, attend))
        return x, self.mlp(h)
