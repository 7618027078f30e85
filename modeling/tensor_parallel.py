"""Tensor parallelism for the target model: the sharding plan and the layers that combine the shards.

Every rank holds whole KV groups (a KV head and the query heads that read it), so attention needs no
communication; q/k/v and gate/up are split by output (column-parallel), o_proj and down_proj by input
(row-parallel, summed by one all-reduce each), the embedding and LM head by contiguous vocab ranges.
Hidden states are replicated on every rank after each all-reduce. Collectives run on the default
torch.distributed process group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from modeling.checkpoint import load_weights
from modeling.config import ModelConfig
from modeling.layers import Linear
from modeling.ops import row_ops
from modeling.target import CausalLM

Range = tuple[int, int]  # [start, end)

# module name -> the range (of RankShard) its output rows (column-parallel) or input columns (row-parallel) follow
_ROW_SPLIT = {"q_proj": "heads", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp",
              "embed_tokens": "vocab", "lm_head": "vocab"}
_COLUMN_SPLIT = {"o_proj": "heads", "down_proj": "mlp"}


def even_split(total: int, parts: int) -> list[Range]:
    """Contiguous ranges whose sizes differ by at most one (the first `total % parts` are the larger)."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: a range of KV heads (query heads follow their group), of MLP columns and of
    vocab rows."""

    rank: int
    world_size: int
    kv_heads: Range
    intermediate: Range
    vocab: Range
    group_size: int  # query heads per KV head
    head_dim: int

    @property
    def heads(self) -> Range:
        return self.kv_heads[0] * self.group_size, self.kv_heads[1] * self.group_size

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes of this rank's part of `config`."""
        def size(r: Range) -> int:
            return r[1] - r[0]
        return replace(config, num_heads=size(self.heads), num_kv_heads=size(self.kv_heads),
                       intermediate_size=size(self.intermediate), vocab_size=size(self.vocab))

    def _elements(self, kind: str) -> Range:
        if kind in ("heads", "kv"):
            start, end = self.heads if kind == "heads" else self.kv_heads
            return start * self.head_dim, end * self.head_dim
        return self.intermediate if kind == "mlp" else self.vocab

    def part(self, name: str) -> tuple[slice, ...] | None:
        """The index of this rank's part of checkpoint tensor `name`; None when every rank holds all of it
        (norms, and the biases of row-parallel layers)."""
        *_, module, kind = name.split(".")
        if module in _ROW_SPLIT:
            return (slice(*self._elements(_ROW_SPLIT[module])),)
        if module in _COLUMN_SPLIT and kind == "weight":
            return slice(None), slice(*self._elements(_COLUMN_SPLIT[module]))
        return None


def plan_shards(config: ModelConfig, world_size: int) -> list[RankShard]:
    """Whole KV groups per rank (N need not divide the head counts: 8 KV heads over 7 ranks gives one rank
    two groups); MLP columns and vocab rows as even as possible."""
    if not 1 <= world_size <= config.num_kv_heads:
        raise ValueError(f"tensor parallelism over {world_size} ranks needs 1 <= N <= num_kv_heads "
                         f"({config.num_kv_heads}): every rank holds at least one whole KV group")
    splits = zip(even_split(config.num_kv_heads, world_size), even_split(config.intermediate_size, world_size),
                 even_split(config.vocab_size, world_size))
    return [RankShard(rank, world_size, kv, mlp, vocab, config.group_size, config.head_dim)
            for rank, (kv, mlp, vocab) in enumerate(splits)]


def weight_share(config: ModelConfig, shard: RankShard) -> float:
    """The fraction of the model's weights (decoder layers, embedding, LM head; norms aside) a rank holds:
    what it reads per decode step, next to its KV share `(kv_end - kv_start) / num_kv_heads`."""
    h, d, local = config.hidden_size, config.head_dim, shard.local_config(config)
    vocab_matrices = 1 if config.tie_word_embeddings else 2

    def params(c: ModelConfig) -> int:
        attention = h * d * (2 * c.num_heads + 2 * c.num_kv_heads)
        return config.num_layers * (attention + 3 * h * c.intermediate_size) + vocab_matrices * c.vocab_size * h
    return params(local) / params(config)


class RowParallelLinear(Linear):
    """Input features split across ranks: the partial products are summed by one all-reduce, then the bias
    (held whole by every rank) is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = row_ops(x).linear(x, self.weight)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows `vocab[0]:vocab[1]` of the embedding: ids outside give zeros here and their row on the rank
    that holds it; the all-reduce sums one row with zeros (exact)."""

    def __init__(self, vocab: Range, dim: int):
        super().__init__(vocab[1] - vocab[0], dim)
        self.start = vocab[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out)
        return out


class TensorParallelCausalLM(CausalLM):
    """One rank's shard of the target. `config` stays the whole model's (vocab, context, stop ids); every
    rank must run the same calls in the same order, since each contains collectives."""

    def __init__(self, config: ModelConfig, shard: RankShard):
        local = shard.local_config(config)
        super().__init__(config, local)
        self.shard = shard
        self.vocab_ranges = even_split(config.vocab_size, shard.world_size)
        self.model.embed_tokens = VocabParallelEmbedding(shard.vocab, config.hidden_size)
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(local.num_heads * config.head_dim, config.hidden_size,
                                                       bias=False)
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(local) for _ in range(self.shard.world_size)]
        dist.all_gather(parts, local.contiguous())
        return parts

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] fp32 on every rank: the vocab shards gathered (padded to the widest: all_gather needs equal
        sizes). Only for sampling; greedy decoding needs `greedy_tokens` alone."""
        local = super().logits(hidden)  # [N, V_rank]
        width = max(end - start for start, end in self.vocab_ranges)
        parts = self._gather(F.pad(local, (0, width - local.shape[1])))
        return torch.cat([part[:, :end - start] for part, (start, end) in zip(parts, self.vocab_ranges)], dim=-1)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N] argmax over the whole vocab from each rank's (max, index) pair: R x N x 2 values cross ranks,
        not R x N x V. Ties go to the lowest rank, i.e. the lowest token id, as torch.argmax does."""
        local = super().logits(hidden)  # [N, V_rank]
        index = local.argmax(-1)
        best = torch.stack([local.gather(-1, index[:, None])[:, 0].double(), (index + self.shard.vocab[0]).double()],
                           dim=-1)  # [N, 2]; NOTE: float64 holds every token id exactly
        candidates = torch.stack(self._gather(best))  # [R, N, 2]
        winner = candidates[..., 0].argmax(0)  # [N]
        return candidates[winner, torch.arange(len(winner), device=winner.device), 1].long()


def load_shard(path: str | Path, world_size: int, rank: int, dtype: str | torch.dtype | None = None,
               device: str | torch.device = "cpu") -> TensorParallelCausalLM:
    """Build rank `rank`'s shard on the meta device and read only its slices of the checkpoint."""
    config = ModelConfig.from_dir(path)
    shard = plan_shards(config, world_size)[rank]
    with torch.device("meta"):
        model = TensorParallelCausalLM(config, shard)
    return load_weights(model, path, dtype, device, shard.part)
