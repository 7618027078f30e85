"""Writes a small random Qwen3 target (and byte-level tokenizer) in real Hugging Face file formats.

Deterministic for a given seed; used by tests and by the README's first command.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from modeling.checkpoint import save_sharded
from modeling.config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"

TINY_TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "bos_token_id": 256,
    "eos_token_id": 256,
}


def byte_level_tokenizer() -> Tokenizer:
    """Token id b (0..255) is byte b; the special tokens follow at 256.."""
    byte_to_char = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins, unordered
    ordered = sorted(byte_to_char, key=_byte_of_char)
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(ordered)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _byte_of_char(ch: str) -> int:
    """Inverse of GPT-2's bytes-to-unicode table: printable bytes map to themselves, the rest to 256+k."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def random_weights(config: ModelConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights: normal(0, std) matrices, ones for norms."""
    from modeling.target import CausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * std
    return tensors


def make_tiny_target(path: str | Path, seed: int = 0) -> Path:
    """Write config.json, two safetensors shards + index, tokenizer.json into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = dict(TINY_TARGET_CONFIG)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = random_weights(ModelConfig.from_hf(raw), seed)
    total = sum(t.numel() * 4 for t in tensors.values())
    save_sharded(tensors, path, max_shard_bytes=total // 2 + 1)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "model_max_length": 8192}))
    return path
