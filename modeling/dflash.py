"""The DFlash block-diffusion drafter (Chen et al., arXiv 2602.06036) over the published checkpoint format.

One forward drafts a whole block: the input is `[root, MASK x (B-1)]` at positions n..n+B-1, where n is
the number of committed context tokens, and block position d yields the distribution of depth d.
The drafter sees the context only through K/V injected into every layer: a context token's feature is
`hidden_norm(fc(concat of the target's hidden states after target_layer_ids))`, and each layer turns
those features into K/V with its own k_proj/v_proj (k_norm on K, RoPE at the token's position).

Semantics, as in the reference implementation (z-lab/dflash `dflash/model.py`) and SGLang's port:
- context features do NOT pass through the layer's input_layernorm; the block hidden does.
- Q comes from the block only; K/V from [context features ; normed block hidden].
- full-attention layers are non-causal: block queries see all context and the whole block.
- sliding-attention layers use HF's window, which includes the query itself: a key at position k is
  visible to the query at q iff q - k < sliding_window; they are causal inside the block (both
  references' default), unless the config's `is_causal` says otherwise for every layer.
- the serving-time context window W (not in the checkpoint) hides context positions < n - W in every layer.
Not supported: DFlash2 extras (convolutions, candidate selector), `output_multiplier`, logit softcapping,
`input_embedding_scale` (published DFlash checkpoints do not use them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from modeling.checkpoint import iter_tensors
from modeling.config import ModelConfig, parse_dtype, read_config_json
from modeling.decoder import DecoderLayer
from modeling.layers import RMSNorm, norm_rope
from modeling.ops import row_ops
from modeling.rope import RotaryEmbedding

ARCHITECTURE = "DFlashDraftModel"
SLIDING = "sliding_attention"
FULL = "full_attention"
KeyValue = tuple[torch.Tensor, torch.Tensor]
# Drafter parameter -> the target checkpoint tensor it is read from (the drafter has neither).
TARGET_TENSORS = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's choice when `target_layer_ids` is absent: the middle layer for a one-layer drafter,
    else K layers evenly spaced from 1 to L - 3 (Python's round, as the reference)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    model: ModelConfig  # the Qwen3 fields of the drafter's layers
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: the reference default (sliding layers causal, full layers not)

    @property
    def feature_dim(self) -> int:
        """F: width of one token's target features. The drafter embeds with the target's embedding, so the
        target hidden size is the drafter's."""
        return len(self.target_layer_ids) * self.model.hidden_size

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def layer_causal(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING if self.is_causal is None else self.is_causal

    def visible_context(self, layer: int, context_window: int | None) -> int | None:
        """The most context positions any block query of `layer` can see (None = all): the root at n sees
        n - k < window, i.e. the last window - 1 context positions, and never more than W."""
        window = self.layer_window(layer)
        limits = [] if context_window is None else [context_window]
        if window is not None:
            limits.append(window - 1)
        return min(limits, default=None)

    @staticmethod
    def from_hf(raw: dict) -> DFlashConfig:
        arch = (raw.get("architectures") or [None])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"architectures[0] = {arch!r}; a DFlash drafter has {ARCHITECTURE!r}")
        dflash = raw.get("dflash_config") or {}
        model = dataclasses.replace(ModelConfig.from_hf({**raw, "architectures": ["Qwen3ForCausalLM"]}),
                                    architecture=ARCHITECTURE)
        num_target_layers = dflash.get("num_target_layers", raw.get("num_target_layers"))
        mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if num_target_layers is None or mask_token_id is None:
            raise ValueError("a DFlash config needs num_target_layers and dflash_config.mask_token_id")
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, model.num_layers)
        if any(not 0 <= i < num_target_layers for i in layer_ids):
            raise ValueError(f"target_layer_ids {list(layer_ids)} out of range for {num_target_layers} layers")
        layer_types = tuple(raw.get("layer_types") or [FULL] * model.num_layers)
        if len(layer_types) != model.num_layers or not set(layer_types) <= {FULL, SLIDING}:
            raise ValueError(f"layer_types must name {FULL!r} or {SLIDING!r} once per layer, got {layer_types}")
        sliding_window = raw.get("sliding_window")
        if SLIDING in layer_types and not sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        return DFlashConfig(
            model=model,
            block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
            num_target_layers=int(num_target_layers),
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            layer_types=layer_types,
            sliding_window=int(sliding_window) if SLIDING in layer_types else None,
            is_causal=raw.get("is_causal"),
        )

    @staticmethod
    def from_dir(path: str | Path) -> DFlashConfig:
        return DFlashConfig.from_hf(read_config_json(path))


@dataclass(frozen=True)
class LayerContext:
    """One layer's context K/V of every session slot, in fixed-size rows (positions in any order, as a ring
    keeps them). Each slot ends with B spare rows, so a draft's gathered copy has room for the block's K/V."""

    keys: torch.Tensor  # [N, C + B, Hkv, D] (RoPE applied); rows C.. are spare
    values: torch.Tensor  # [N, C + B, Hkv, D]
    positions: torch.Tensor  # [N, C] int64; -1 marks an empty row

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def store(self, slots: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Each (slot, row) takes its position and K/V [N, Hkv, D]."""
        self.keys[slots, rows] = keys
        self.values[slots, rows] = values
        self.positions[slots, rows] = positions


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, context_start: torch.Tensor,
                 window: int | None, causal: bool) -> torch.Tensor:
    """query_pos: [S, B]; key_pos: [S, K] (-1 = empty); context_start: [S] (keys before it are outside W)
    -> [S, B, K] bool."""
    distance = query_pos[:, :, None] - key_pos[:, None, :]  # [S, B, K]
    visible = (key_pos >= context_start[:, None])[:, None, :].expand_as(distance)
    if causal:
        visible = visible & (distance >= 0)
    if window is not None:
        visible = visible & (distance.abs() < window)
    return visible


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: LayerContext, slots: torch.Tensor,
                    block_pos: torch.Tensor, context_start: torch.Tensor, window: int | None,
                    causal: bool) -> torch.Tensor:
    """The draft block's attention in torch (the CPU path, and the oracle of ddtree_kernels.draft_attention):
    each session's block queries attend to its slot's context K/V and to its own block.
    q: [S * B, Hq, D]; k, v: [S * B, Hkv, D]; slots, context_start: [S]; block_pos: [S, B] -> [S * B, Hq, D]."""
    sessions, block = block_pos.shape
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    keys, values = context.keys[slots], context.values[slots]  # [S, C + B, Hkv, D] copies
    keys[:, context.capacity:] = k.view(sessions, block, kv_heads, dim)
    values[:, context.capacity:] = v.view(sessions, block, kv_heads, dim)
    key_pos = torch.cat([context.positions[slots], block_pos], dim=1)  # [S, C + B]
    visible = visible_keys(block_pos, key_pos, context_start, window, causal)  # [S, B, C + B]
    # NOTE: the query heads sharing a KV head are stacked along the query axis (row g * B + b), so every
    # SDPA backend reads each K/V head once and none needs GQA support.
    queries = q.view(sessions, block, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [S, Hkv, G, B, D]
    out = F.scaled_dot_product_attention(
        queries.reshape(sessions, kv_heads, group * block, dim), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=visible.repeat(1, group, 1)[:, None])  # [S, Hkv, G * B, D]
    return out.view(sessions, kv_heads, group, block, dim).permute(0, 3, 1, 2, 4).reshape(q.shape)


class _BlockAttention:
    """The LayerAttention of one batched draft: each session's block queries attend to its slot's context K/V
    and to its own block; the block's K/V are used once and dropped. Every shape comes from the batch size
    and the layer's capacity alone, so the draft can be captured in a CUDA graph. On CUDA one Triton launch
    (ddtree_kernels.draft_attention) reads the slot buffers in place; elsewhere `block_attention` gathers them."""

    def __init__(self, config: DFlashConfig, contexts: Sequence[LayerContext], slots: torch.Tensor,
                 block_pos: torch.Tensor, context_start: torch.Tensor):
        self.config, self.contexts, self.slots = config, contexts, slots
        self.block_pos, self.context_start = block_pos, context_start

    def kv_buffers(self, layer: int, num_tokens: int) -> None:
        return None  # the kernel reads the block's K/V where the projection leaves them; the torch path copies

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [S * B, Hq, D]; k, v: [S * B, Hkv, D] -> [S * B, Hq, D]
        context = self.contexts[layer]
        window, causal = self.config.layer_window(layer), self.config.layer_causal(layer)
        if not q.is_cuda:
            return block_attention(q, k, v, context, self.slots, self.block_pos, self.context_start, window, causal)
        # NOTE: imported here: Triton reads TRITON_INTERPRET at its first import, and CPU machines never need it
        from ddtree_kernels.draft_attention import draft_block_attention

        return draft_block_attention(q, k, v, context.keys, context.values, context.positions, self.slots,
                                     self.block_pos, self.context_start, window, causal)


class DFlashModel(nn.Module):
    """Stateless drafter math; the per-session context K/V cache lives in the caller (the session mirror).

    Parameter names follow the checkpoint (`layers.*`, `fc`, `hidden_norm`, `norm`), plus `embed_tokens`
    and `lm_head`, which are the target's (TARGET_TENSORS)."""

    def __init__(self, config: DFlashConfig, vocab_size: int):
        super().__init__()
        self.config = config
        hidden = config.model.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(config.model, i) for i in range(config.model.num_layers))
        self.fc = nn.Linear(config.feature_dim, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.model.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.model.rms_norm_eps)
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.model.rope, config.model.head_dim)
        self.register_buffer("context_kv", None, persistent=False)  # every layer's K/V weights, once fused
        self.register_buffer("context_kv_bias", None, persistent=False)

    def fuse_projections(self) -> None:
        """Each layer's Q/K/V and gate/up as one GEMM (DecoderLayer.fuse_projections), and the context's K/V of
        every layer as one more: a commit projects its rows into all layers at once, so one stream of those
        weights (a copy of them, 2L x Hkv x D rows) replaces 2L skinny GEMMs. Idempotent (captured CUDA graphs
        read the weights in place)."""
        for layer in self.layers:
            layer.fuse_projections()
        if self.context_kv is None:
            attentions = [layer.self_attn for layer in self.layers]
            self.context_kv = torch.cat([w for a in attentions for w in (a.k_proj.weight, a.v_proj.weight)])
            if attentions[0].k_proj.bias is not None:
                self.context_kv_bias = torch.cat([b for a in attentions for b in (a.k_proj.bias, a.v_proj.bias)])

    def context_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """target_features: [N, F] -> [N, H]."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def context_key_values(self, features: torch.Tensor, positions: torch.Tensor) -> list[KeyValue]:
        """features: [N, H] (from context_features); positions: [N] -> per layer (K, V), each [N, Hkv, D].
        They depend on the features alone, so a cache of them stays valid across drafts."""
        cos, sin = self.rotary(positions, features.dtype)
        if self.context_kv is None:
            return [layer.self_attn.key_value(features, cos, sin) for layer in self.layers]
        kv = self._fused_key_values(features)
        return [(norm_rope(kv[:, i, 0], layer.self_attn.k_norm, cos, sin), kv[:, i, 1])
                for i, layer in enumerate(self.layers)]

    def store_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      contexts: Sequence[LayerContext]) -> None:
        """Row i of features [N, H] (from context_features), at positions[i], into every layer's ring row
        positions[i] % C of slot slots[i] ([N] int64 each, on the model's device). On CUDA with fused projections
        one launch a layer (ddtree_kernels.context_rows) normalises, rotates and stores; else `LayerContext.store`.
        Shapes depend on N alone, so a CUDA graph can hold it."""
        if self.context_kv is None or not features.is_cuda:
            rings: dict[int, torch.Tensor] = {}  # capacity -> the rows' ring rows
            for (keys, values), context in zip(self.context_key_values(features, positions), contexts):
                ring = rings.get(context.capacity)
                if ring is None:
                    ring = rings[context.capacity] = positions % context.capacity
                context.store(slots, ring, positions, keys, values)
            return
        # NOTE: imported here: Triton reads TRITON_INTERPRET at its first import, and CPU machines never need it
        from ddtree_kernels.context_rows import store_context_rows

        cos, sin = self.rotary(positions, features.dtype)
        kv = self._fused_key_values(features)
        for i, (layer, context) in enumerate(zip(self.layers, contexts)):
            weight, eps = (None, 0.0) if (norm := layer.self_attn.k_norm) is None else (norm.weight, norm.eps)
            store_context_rows(kv[:, i, 0], kv[:, i, 1], weight, eps, cos, sin, context.keys, context.values,
                               context.positions, slots, positions)

    def _fused_key_values(self, features: torch.Tensor) -> torch.Tensor:
        """[N, H] -> every layer's K and V before norm and RoPE, [N, L, 2, Hkv, D], from one GEMM."""
        model = self.config.model
        kv = row_ops(features).linear(features, self.context_kv, self.context_kv_bias)
        return kv.view(features.shape[0], len(self.layers), 2, model.num_kv_heads, model.head_dim)

    def draft_logits(self, root_tokens: torch.Tensor, start_positions: torch.Tensor, slots: torch.Tensor,
                     contexts: Sequence[LayerContext], context_window: int | None = None) -> torch.Tensor:
        """root_tokens, start_positions, slots: [S] (start = n, the committed length; a slot picks the session's
        rows of `contexts`) -> logits [S, B-1, V] in the model dtype, row d-1 for depth d."""
        block = self.config.block_size
        offsets = torch.arange(block, device=root_tokens.device)
        block_pos = start_positions[:, None] + offsets  # [S, B]
        tokens = torch.where(offsets == 0, root_tokens[:, None], self.config.mask_token_id)  # [S, B]
        context_start = torch.zeros_like(start_positions)  # [S]: context positions before it lie outside W
        if context_window is not None:
            context_start = (start_positions - context_window).clamp(min=0)
        attend = _BlockAttention(self.config, contexts, slots, block_pos, context_start)
        x = self.embed_tokens(tokens.flatten())  # [S * B, H]
        cos, sin = self.rotary(block_pos.flatten(), x.dtype)
        pending = None
        for index, layer in enumerate(self.layers):
            x, pending = layer(index, x, pending, cos, sin, attend)
        x = self.norm.add_and_norm(x, pending)[1]
        # NOTE: one 2-D GEMM over the S * (B-1) drafted rows: the strided [S, B-1, H] view went to a batched GEMM
        # whose kernel re-read the LM head per session (4.6 ms at 16 sessions on an H200, against ~0.4)
        rows = x.view(*tokens.shape, -1)[:, 1:].reshape(-1, x.shape[-1])
        return self.lm_head(rows).view(tokens.shape[0], block - 1, -1)  # [S, B-1, V]


def load_dflash(drafter_dir: str | Path, target_dir: str | Path, dtype: str | torch.dtype | None = None,
                device: str | torch.device = "cpu") -> DFlashModel:
    """The drafter from its checkpoint (names with or without `model.`) plus the target's embedding and
    LM head, read alone from the target checkpoint (never the whole target)."""
    config = DFlashConfig.from_dir(drafter_dir)
    target = ModelConfig.from_dir(target_dir)
    if target.hidden_size != config.model.hidden_size:
        raise ValueError(f"drafter hidden size {config.model.hidden_size} != target's {target.hidden_size}")
    dtype = parse_dtype(dtype or config.model.torch_dtype)
    with torch.device("meta"):
        model = DFlashModel(config, target.vocab_size)
    model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config.model.rope, config.model.head_dim).to(device)
    params = dict(model.named_parameters())
    missing = set(params)
    for name, tensor in iter_tensors(drafter_dir):
        name = name.removeprefix("model.")
        if name in TARGET_TENSORS or name not in params:
            continue  # e.g. rotary buffers some exporters write
        _fill(params[name], name, tensor, device, dtype)
        missing.discard(name)
    by_target_name = {v: k for k, v in TARGET_TENSORS.items()}
    if target.tie_word_embeddings:
        by_target_name.pop("lm_head.weight")
        model.lm_head.weight = model.embed_tokens.weight
        missing.discard("lm_head.weight")
    for name, tensor in iter_tensors(target_dir, set(by_target_name)):
        _fill(params[by_target_name[name]], name, tensor, device, dtype)
        missing.discard(by_target_name[name])
    if missing:
        raise ValueError(f"DFlash checkpoints {drafter_dir} + {target_dir} lack tensors: {sorted(missing)[:5]}")
    return model.eval().requires_grad_(False)


def _fill(param: nn.Parameter, name: str, tensor: torch.Tensor, device: str | torch.device,
          dtype: torch.dtype) -> None:
    if tensor.shape != param.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
    param.data = tensor.to(device=device, dtype=dtype)
