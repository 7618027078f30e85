"""Writes small random targets (Qwen3, or an MLA + MoE architecture) with a byte-level tokenizer, and DFlash
drafters for them, in real Hugging Face file formats.

Deterministic for a given seed; used by tests and by the README's first command.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from modeling.checkpoint import save_sharded
from modeling.config import ModelConfig, parse_dtype, read_config_json
from modeling.tokenizer import BYTE_LEVEL_BYTES

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
# ChatML, as Qwen's checkpoints write it, so that the tiny model serves chat too.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")

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


_TINY_MLA = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
    "bos_token_id": 256, "eos_token_id": 256,
}
# The MLA + MoE families at tiny scale: V2-Lite-like (no q low-rank, softmax routing over groups), V3 / Kimi K2
# (q low-rank, sigmoid routing with the correction bias over groups), GLM-4.7-Flash.
TINY_CONFIGS = {
    "qwen3": TINY_TARGET_CONFIG,
    "deepseek_v2": {**_TINY_MLA, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
                    "first_k_dense_replace": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    "deepseek_v3": {**_TINY_MLA, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "q_lora_rank": 48, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True},
    "glm4_moe_lite": {**_TINY_MLA, "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
                      "q_lora_rank": 48, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                      "routed_scaling_factor": 1.8, "rope_interleave": True,
                      "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
}


def byte_level_tokenizer() -> Tokenizer:
    """Token id b (0..255) is byte b; the special tokens follow at 256.."""
    byte_to_char = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins, unordered
    ordered = sorted(byte_to_char, key=BYTE_LEVEL_BYTES.__getitem__)
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(ordered)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def random_weights(config: ModelConfig, seed: int, std: float = 0.02) -> dict[str, torch.Tensor]:
    """HF-named fp32 weights: normal(0, std) matrices, ones for norms."""
    from modeling.target import CausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return _random_tensors(shapes, seed, std)


def _random_tensors(shapes: dict[str, torch.Size], seed: int, std: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * std
            for name, shape in shapes.items()}


# Qwen3-0.6B's layers with the byte-level tokenizer of the tiny model (random weights: no hub downloads).
QWEN3_06B_SHAPE = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6,
                   "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


# A CPU stand-in for the GPU runs' random models, small enough for 64 sessions on two cores. At std 0.02 random models
# this small fall into loops an n-gram drafter predicts (1024-wide ones do not); at std 0.1 its greedy text is
# chaotic (the n-gram drafter's acceptance ~1, as the random 8B model's on the GPU).
SMALL_SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 32, "torch_dtype": "float32"}


def make_tiny_target(path: str | Path, seed: int = 0, shape: dict | None = None, arch: str = "qwen3",
                     std: float = 0.02) -> Path:
    """Write config.json, two safetensors shards + index, tokenizer.json and tokenizer_config.json (with a ChatML
    chat template) into `path`. `arch` is a key of TINY_CONFIGS; `shape` overrides config fields (a bigger random
    model with the same byte-level tokenizer, e.g. for GPU benchmarks; its `torch_dtype` is the dtype the weights
    are saved in). `std`: the weights' standard deviation (larger ones make a chaotic model, whose greedy text seldom
    repeats itself: small random models at 0.02 fall into loops that an n-gram drafter predicts)."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(TINY_CONFIGS)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = {**TINY_CONFIGS[arch], **(shape or {})}
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    dtype = parse_dtype(raw["torch_dtype"])
    tensors = {name: t.to(dtype) for name, t in random_weights(ModelConfig.from_hf(raw), seed, std).items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    save_sharded(tensors, path, max_shard_bytes=total // 2 + 1)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN, "model_max_length": 8192,
                                                            "chat_template": CHAT_TEMPLATE}))
    return path


def tiny_drafter_config(target: dict, mask_token_id: int) -> dict:
    """A two-layer DFlash drafter config for a tiny target, shaped like the published ones (all layers full
    attention); the hidden size must be the target's, whose embedding the drafter uses. An MLA target has no
    GQA shape to copy: its drafter gets 4 heads over 2 KV heads."""
    if "kv_lora_rank" in target:
        target = {**target, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": target["hidden_size"] // 4}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 8,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [1, target["num_hidden_layers"] - 2]},
        **{key: target[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                        "max_position_embeddings", "torch_dtype")},
        "num_hidden_layers": 2,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def make_tiny_drafter(path: str | Path, target_dir: str | Path, seed: int = 1) -> Path:
    """Write a random DFlash drafter for the tiny target at `target_dir`: config.json + model.safetensors
    (drafter tensors only: the embedding and LM head are the target's)."""
    from modeling.dflash import TARGET_TENSORS, DFlashConfig, DFlashModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target = read_config_json(target_dir)
    mask_token_id = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json")).token_to_id(MASK_TOKEN)
    raw = tiny_drafter_config(target, mask_token_id)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    with torch.device("meta"):
        model = DFlashModel(DFlashConfig.from_hf(raw), target["vocab_size"])
    shapes = {name: p.shape for name, p in model.named_parameters() if name not in TARGET_TENSORS}
    save_file(_random_tensors(shapes, seed, std=0.02), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
