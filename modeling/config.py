"""Model configuration read from a Hugging Face `config.json`: dense GQA models (Qwen3, Qwen2, Llama) and MLA +
mixture-of-experts models (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

DENSE_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MLA_ARCHITECTURES
# transformers' defaults for the model-level fields an MLA config.json may leave out (they differ per family;
# the MoE fields' are _MOE_DEFAULTS). n_routed_experts: transformers builds these families with experts always.
_MLA_DEFAULTS = {
    "DeepseekV2ForCausalLM": {"q_lora_rank": 1536, "n_routed_experts": 64, "max_position_embeddings": 2048},
    "DeepseekV3ForCausalLM": {"q_lora_rank": 1536, "n_routed_experts": 256, "max_position_embeddings": 4096},
    "Glm4MoeLiteForCausalLM": {"q_lora_rank": 768, "n_routed_experts": 64, "max_position_embeddings": 202752,
                               "rms_norm_eps": 1e-5},
}
# NOTE: DeepSeek Sparse Attention (an indexer picks the top-k keys per query) is not built.
SPARSE_ATTENTION_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings in either spelling: top-level `rope_theta` + `rope_scaling`, or `rope_parameters`."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    params: dict = field(default_factory=dict)  # the scaling dict as written (factor, beta_fast, ...)

    @staticmethod
    def from_hf(raw: dict) -> RopeConfig:
        params = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        params.update(scaling)
        theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        if rope_type in ("llama3", "yarn"):
            params.setdefault("original_max_position_embeddings",
                              raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")))
        return RopeConfig(theta=float(theta), rope_type=rope_type, params=params)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: per token and layer the cache holds one normalised latent of kv_lora_rank
    values and one rotated RoPE key of qk_rope_head_dim values shared by all heads (no per-head K/V)."""

    q_lora_rank: int | None  # None: q comes from one projection (q_proj), else through a low-rank pair
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's RoPE pairs are adjacent columns, not the two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token's cache entry holds per layer: the latent, then the rotated RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_hf(raw: dict, architecture: str) -> MLAConfig:
        # NOTE: DeepSeek-V2 always rotates adjacent pairs (as complex numbers); it has no rope_interleave field.
        interleave = architecture == "DeepseekV2ForCausalLM" or raw.get("rope_interleave", True)
        return MLAConfig(q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=raw["kv_lora_rank"],
                         qk_nope_head_dim=raw["qk_nope_head_dim"], qk_rope_head_dim=raw["qk_rope_head_dim"],
                         v_head_dim=raw["v_head_dim"], rope_interleave=bool(interleave))


# transformers' defaults for the MoE fields a config.json may leave out (they differ per family).
_MOE_DEFAULTS = {
    "DeepseekV2ForCausalLM": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "moe_intermediate_size": 1407},
    "DeepseekV3ForCausalLM": {"n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
                              "moe_intermediate_size": 2048},
    "Glm4MoeLiteForCausalLM": {"n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.8,
                               "num_experts_per_tok": 4, "moe_intermediate_size": 1536},
}


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (plus always-on shared experts) in place of the MLP of the `sparse_layers`."""

    num_experts: int  # n_routed_experts
    experts_per_token: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, per expert
    num_shared_experts: int  # n_shared_experts: one MLP of num_shared_experts * intermediate_size
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE; the others are dense
    scoring: str  # softmax (DeepSeek-V2) | sigmoid (DeepSeek-V3, Kimi K2, GLM-4.7-Flash)
    topk_method: str  # greedy | group_limited_greedy (V2) | noaux_tc (V3: group pick with the correction bias)
    num_groups: int  # n_group
    topk_groups: int  # topk_group
    norm_topk_prob: bool
    routed_scaling_factor: float

    @staticmethod
    def from_hf(raw: dict, architecture: str) -> MoEConfig:
        raw = {**_MOE_DEFAULTS.get(architecture, {}), **raw}
        num_layers = raw["num_hidden_layers"]
        if raw.get("mlp_layer_types"):
            sparse = tuple(i for i, kind in enumerate(raw["mlp_layer_types"]) if kind == "sparse")
        elif architecture == "Glm4MoeLiteForCausalLM":
            sparse = tuple(range(1, num_layers))
        else:
            first_dense, every = raw.get("first_k_dense_replace", 0), raw.get("moe_layer_freq", 1)
            sparse = tuple(i for i in range(num_layers) if i >= first_dense and i % every == 0)
        v2 = architecture == "DeepseekV2ForCausalLM"
        return MoEConfig(
            num_experts=raw["n_routed_experts"], experts_per_token=raw["num_experts_per_tok"],
            intermediate_size=raw["moe_intermediate_size"], num_shared_experts=raw.get("n_shared_experts") or 0,
            sparse_layers=sparse, scoring="softmax" if v2 else "sigmoid",
            topk_method=(raw.get("topk_method") or "greedy") if v2 else "noaux_tc",
            num_groups=raw.get("n_group") or 1, topk_groups=raw.get("topk_group") or 1,
            # NOTE: transformers never renormalises DeepSeek-V2's top-k weights, whatever norm_topk_prob says.
            norm_topk_prob=bool(raw.get("norm_topk_prob")) and not v2,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


@dataclass(frozen=True)
class ModelConfig:
    """The decoder-only transformer shape shared by the target and (for its Qwen3 fields) the drafter."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # MLA: num_heads (it has no KV heads; the cache holds one latent per token)
    head_dim: int  # the rotary dimension of q and k (MLA: qk_rope_head_dim)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 always has q/k/v bias; Llama when attention_bias is set
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAConfig | None = None  # set: multi-head latent attention instead of GQA
    moe: MoEConfig | None = None  # set: routed experts in the MoE layers

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(head dim), and for MLA with YaRN the mscale_all_dim factor squared
        (the checkpoints fold YaRN's attention temperature into the scale, not into cos/sin)."""
        if self.mla is None:
            return self.head_dim ** -0.5
        scale = self.mla.qk_head_dim ** -0.5
        params = self.rope.params
        if self.rope.rope_type != "default" and params.get("mscale_all_dim"):
            factor = params["factor"]
            mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return scale

    @staticmethod
    def from_hf(raw: dict) -> ModelConfig:
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch in SPARSE_ATTENTION_ARCHITECTURES or raw.get("index_topk"):
            raise ValueError(f"architectures[0] = {arch!r} uses DeepSeek Sparse Attention (an indexer selecting "
                             "the top-k keys), which is not supported yet")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures[0] = {arch!r} is not supported; expected one of "
                             f"{SUPPORTED_ARCHITECTURES}")
        raw = {**_MLA_DEFAULTS.get(arch, {}), **raw}
        num_heads = raw["num_attention_heads"]
        mla = MLAConfig.from_hf(raw, arch) if arch in MLA_ARCHITECTURES else None
        moe = MoEConfig.from_hf(raw, arch) if mla is not None and raw.get("n_routed_experts") else None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if mla else raw.get("num_key_value_heads") or num_heads,
            head_dim=mla.qk_rope_head_dim if mla else raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=raw.get("mlp_bias", False),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
            eos_token_ids=eos_ids,
            mla=mla,
            moe=moe,
        )

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        return ModelConfig.from_hf(read_config_json(path))


def read_config_json(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face checkpoint directory")
    return json.loads(config_file.read_text())
