"""Model configuration read from a Hugging Face `config.json` (Qwen3, Qwen2, Llama)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")

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
class ModelConfig:
    """The decoder-only transformer shape shared by the target and (for its Qwen3 fields) the drafter."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 always has q/k/v bias; Llama when attention_bias is set
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @staticmethod
    def from_hf(raw: dict) -> ModelConfig:
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures[0] = {arch!r} is not supported; expected one of "
                             f"{SUPPORTED_ARCHITECTURES}")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            mlp_bias=raw.get("mlp_bias", False),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype") or "float32",
            eos_token_ids=eos_ids,
        )

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        return ModelConfig.from_hf(read_config_json(path))


def read_config_json(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face checkpoint directory")
    return json.loads(config_file.read_text())
