"""Tensor parallelism for the target model: the sharding plan and the layers that combine the shards.

Dense (GQA) models: every rank holds whole KV groups (a KV head and the query heads that read it), so attention
needs no communication; q/k/v and gate/up are split by output (column-parallel), o_proj and down_proj by input
(row-parallel, summed by one all-reduce each). MLA models: the query heads are split (q_proj / q_b_proj,
kv_b_proj, o_proj by head) while the low-rank projections and the latent cache are whole on every rank. MoE
layers: the router is whole, the routed experts are split into contiguous ranges and the shared experts by
columns; both partial sums cross ranks in one all-reduce. The embedding and LM head are split by contiguous
vocab ranges. Hidden states are replicated on every rank after each all-reduce. Collectives run on the default
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
from modeling.config import MLAConfig, ModelConfig
from modeling.decoder import DecoderLayer
from modeling.layers import Linear
from modeling.moe import MoE, expert_mlp
from modeling.ops import row_ops
from modeling.target import CausalLM

Range = tuple[int, int]  # [start, end)

# module name -> the range (of RankShard) its output rows (column-parallel) or input columns (row-parallel) follow
_ROW_SPLIT = {"q_proj": "heads", "q_b_proj": "heads", "kv_b_proj": "heads", "k_proj": "kv", "v_proj": "kv",
              "gate_proj": "mlp", "up_proj": "mlp", "embed_tokens": "vocab", "lm_head": "vocab"}
_COLUMN_SPLIT = {"o_proj": "heads", "down_proj": "mlp"}


def even_split(total: int, parts: int) -> list[Range]:
    """Contiguous ranges whose sizes differ by at most one (the first `total % parts` are the larger)."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


def _size(r: Range) -> int:
    return r[1] - r[0]


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: a range of KV heads (query heads follow their group; MLA: one "KV head" per query
    head), of dense MLP columns, of routed experts and shared-expert columns (MoE), and of vocab rows."""

    rank: int
    world_size: int
    kv_heads: Range
    intermediate: Range
    vocab: Range
    group_size: int  # query heads per KV head
    head_dim: int
    mla: MLAConfig | None = None  # set: the per-head widths of MLA's projections
    experts: Range = (0, 0)
    shared_experts: Range = (0, 0)  # columns of the shared experts' MLP (num_shared_experts * intermediate)

    @property
    def heads(self) -> Range:
        return self.kv_heads[0] * self.group_size, self.kv_heads[1] * self.group_size

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes of this rank's part of `config`. The MoE config stays whole: the router scores all experts
        (ExpertParallelMoE holds the expert split)."""
        return replace(config, num_heads=_size(self.heads), num_kv_heads=_size(self.kv_heads),
                       intermediate_size=_size(self.intermediate), vocab_size=_size(self.vocab))

    def _head_width(self, module: str) -> int:
        """Rows (column-parallel) or columns (o_proj) per head of `module`."""
        if self.mla is None:
            return self.head_dim
        mla = self.mla
        return {"q_proj": mla.qk_head_dim, "q_b_proj": mla.qk_head_dim,
                "kv_b_proj": mla.qk_nope_head_dim + mla.v_head_dim, "o_proj": mla.v_head_dim}[module]

    def _elements(self, parent: str, module: str) -> Range | None:
        """This rank's elements along the split dimension of tensor `parent.module`; None: every rank holds all of
        it (norms, MLA's low-rank projections, the router, a routed expert: whole on the one rank that has it)."""
        kind = _ROW_SPLIT.get(module) or _COLUMN_SPLIT.get(module)
        if kind in ("heads", "kv"):
            start, end = self.heads if kind == "heads" else self.kv_heads
            width = self._head_width(module)
            return start * width, end * width
        if kind == "mlp":  # NOTE: a routed expert's parent is its index, so it is read whole
            return {"mlp": self.intermediate, "shared_experts": self.shared_experts}.get(parent)
        return self.vocab if kind == "vocab" else None

    def part(self, name: str) -> tuple[slice, ...] | None:
        """The index of this rank's part of checkpoint tensor `name`; None when the rank reads all of it (see
        `_elements`, and the biases of row-parallel layers). Routed experts of other ranks are never asked for:
        the model does not hold them."""
        *_, parent, module, kind = ["", *name.split(".")]
        elements = self._elements(parent, module)
        if elements is None:
            return None
        if module in _COLUMN_SPLIT:
            return (slice(None), slice(*elements)) if kind == "weight" else None
        return (slice(*elements),)


def plan_shards(config: ModelConfig, world_size: int) -> list[RankShard]:
    """Whole KV groups per rank (N need not divide the head counts: 8 KV heads over 7 ranks gives one rank
    two groups); for MLA whole query heads; MLP columns, routed experts and vocab rows as even as possible."""
    heads, unit = ("num_heads", "attention head") if config.mla else ("num_kv_heads", "whole KV group")
    if not 1 <= world_size <= config.num_kv_heads:
        raise ValueError(f"tensor parallelism over {world_size} ranks needs 1 <= N <= {heads} "
                         f"({config.num_kv_heads}): every rank holds at least one {unit}")
    moe = config.moe
    if moe is not None and world_size > moe.num_experts:
        raise ValueError(f"tensor parallelism over {world_size} ranks needs N <= n_routed_experts "
                         f"({moe.num_experts}): every rank holds at least one routed expert")
    no_experts = [(0, 0)] * world_size
    experts = even_split(moe.num_experts, world_size) if moe else no_experts
    shared = even_split(moe.num_shared_experts * moe.intermediate_size, world_size) if moe else no_experts
    splits = zip(even_split(config.num_kv_heads, world_size), even_split(config.intermediate_size, world_size),
                 even_split(config.vocab_size, world_size), experts, shared)
    return [RankShard(rank, world_size, kv, mlp, vocab, config.group_size, config.head_dim, config.mla,
                      rank_experts, rank_shared)
            for rank, (kv, mlp, vocab, rank_experts, rank_shared) in enumerate(splits)]


def weight_share(config: ModelConfig, shard: RankShard) -> float:
    """The fraction of the model's weights (decoder layers, embedding, LM head; norms aside) a rank holds.
    Counted on the meta device from one layer of each kind (dense or MoE MLP), so every family's shapes are
    right by construction. Dense models read all of it per decode step; an MoE rank reads only the experts the
    step's tokens chose."""
    local = shard.local_config(config)
    sparse = set(config.moe.sparse_layers) if config.moe else set()
    first: dict[bool, int] = {}  # whether a layer is MoE -> the first layer of that kind
    for index in range(config.num_layers):
        first.setdefault(index in sparse, index)

    def params(module: nn.Module) -> int:
        return sum(p.numel() for name, p in module.named_parameters() if not name.endswith("norm.weight"))
    whole = held = 0
    with torch.device("meta"):
        for is_sparse, index in first.items():
            count = len(sparse) if is_sparse else config.num_layers - len(sparse)
            whole += count * params(DecoderLayer(config, index))
            held += count * params(split_layer(DecoderLayer(local, index), local, shard))
    vocab_matrices = 1 if config.tie_word_embeddings else 2
    return (held + vocab_matrices * local.vocab_size * config.hidden_size) / \
        (whole + vocab_matrices * config.vocab_size * config.hidden_size)


def kv_share(config: ModelConfig, shard: RankShard) -> float:
    """The fraction of the KV cache a rank holds: its KV heads' share, or all of it for MLA (every rank keeps
    the whole latent; only the heads that read it are split)."""
    return 1.0 if config.mla is not None else _size(shard.kv_heads) / config.num_kv_heads


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


class ExpertParallelMoE(MoE):
    """One rank's part of an MoE layer: the router whole (every rank routes the same replicated input alike), the
    routed experts `experts` (the others are None: another rank's, never loaded here) and the columns `shared`
    of the shared experts. Build it on the meta device: MoE.__init__ makes every expert first."""

    def __init__(self, config: ModelConfig, experts: Range, shared: Range):
        super().__init__(config)
        for j in range(len(self.experts)):
            if not experts[0] <= j < experts[1]:
                self.experts[j] = None
        if self.shared_experts is not None:
            self.shared_experts = expert_mlp(config, _size(shared))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums (its experts, its shared-expert columns) summed over ranks by one all-reduce,
        in fp32 as MoE accumulates."""
        out = self.expert_sum(x)
        dist.all_reduce(out)
        return out.to(x.dtype)


def _row_parallel(linear: nn.Linear) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)


def split_layer(layer: DecoderLayer, local: ModelConfig, shard: RankShard) -> DecoderLayer:
    """A layer built from the rank's `local` config, with the modules that combine the shards swapped in: o_proj
    and a dense down_proj row-parallel, an MoE expert-parallel."""
    layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj)
    if isinstance(layer.mlp, MoE):
        layer.mlp = ExpertParallelMoE(local, shard.experts, shard.shared_experts)
    else:
        layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj)
    return layer


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
            split_layer(layer, local, shard)

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
