"""The target causal LM (Qwen3 / Qwen2 / Llama, or MLA + MoE: DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) over
packed tokens of many sequences."""

from __future__ import annotations

import torch
from torch import nn

from modeling.config import ModelConfig
from modeling.decoder import DecoderLayer
from modeling.layers import LayerAttention, RMSNorm
from modeling.rope import RotaryEmbedding


class DecoderStack(nn.Module):
    """Parameter names mirror HF's `model.*` so checkpoints load by name."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, shard_config: ModelConfig | None = None):
        """`shard_config`: the shapes this instance holds when it is one tensor-parallel shard of `config` (its
        own heads, MLP columns and vocab rows); None for the whole model."""
        super().__init__()
        self.config = config
        self.shard_config = shard_config or config
        self.model = DecoderStack(self.shard_config)
        self.lm_head = nn.Linear(config.hidden_size, self.shard_config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] packed tokens of one or more sequences
        positions: torch.Tensor,  # [N]
        attend: LayerAttention,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> final normed hidden [N, H] and, if asked, the concatenated hidden states after
        `capture_layers` [N, len(capture_layers) * H] (HF `hidden_states[i + 1]`)."""
        x, pending = self.model.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions, x.dtype)
        captured = {}
        for index, layer in enumerate(self.model.layers):
            x, pending = layer(index, x, pending, cos, sin, attend)
            if index in capture_layers:
                captured[index] = x + pending
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        return self.model.norm.add_and_norm(x, pending)[1], features

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.fuse_projections()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> the argmax token of every row [N] (in the model dtype: fp32 orders it alike)."""
        return self.lm_head(hidden).argmax(-1)
