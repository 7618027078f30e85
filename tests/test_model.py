"""The target model matches transformers' implementations on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from modeling.checkpoint import load_causal_lm
from modeling.config import ModelConfig
from tests.engine_helpers import causal_attention

SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CASES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "qwen3-yarn": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"rope_scaling": YARN}),
    "qwen3-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"tie_word_embeddings": True}),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_theta": 500000.0}),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_scaling": LLAMA3}),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("placement", ["cpu", "cpu-fused", pytest.param("cuda-fused", marks=pytest.mark.gpu)])
def test_logits_and_hidden_states_match_transformers(case: str, placement: str, tmp_path) -> None:
    """Also with Q/K/V and gate/up fused into one GEMM each, and on CUDA (fused Triton row-wise ops)."""
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    reference = model_cls(config_cls(**SHAPE, **extra)).eval()
    reference.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index file
    assert (tmp_path / "model.safetensors.index.json").is_file()
    device = placement.split("-")[0]
    ours = load_causal_lm(tmp_path, dtype="float32", device=device)
    if placement.endswith("fused"):
        ours.fuse_projections()
        fused = [p.data_ptr() for p in ours.parameters()]
        ours.fuse_projections()  # a second drafter or engine on the same model: nothing may move
        assert [p.data_ptr() for p in ours.parameters()] == fused
    ids = torch.randint(0, SHAPE["vocab_size"], (37,))
    with torch.no_grad():
        expected = reference(ids[None], output_hidden_states=True)
        positions = torch.arange(37, device=device)
        hidden, features = ours(ids.to(device), positions, causal_attention, capture_layers=(1, 0))
    torch.testing.assert_close(ours.logits(hidden).cpu(), expected.logits[0], atol=2e-5, rtol=1e-4)
    expected_features = torch.cat([expected.hidden_states[2][0], expected.hidden_states[1][0]], -1)
    torch.testing.assert_close(features.cpu(), expected_features, atol=2e-5, rtol=1e-4)


def test_both_rope_spellings_give_the_same_config() -> None:
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 1024}
    legacy = ModelConfig.from_hf({**base, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    modern = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}})
    assert legacy.rope == modern.rope
    assert legacy.rope.theta == 1e6 and legacy.rope.params["original_max_position_embeddings"] == 1024


def test_unsupported_architecture_is_named(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_load_tracks_fp32(tiny_target, dtype: str) -> None:
    ids = torch.arange(20) + 40
    full = load_causal_lm(tiny_target, dtype="float32")
    low = load_causal_lm(tiny_target, dtype=dtype)
    assert low.lm_head.weight.dtype == getattr(torch, dtype)
    with torch.no_grad():
        expected = full.logits(full(ids, torch.arange(20), causal_attention)[0])
        got = low.logits(low(ids, torch.arange(20), causal_attention)[0])
    assert (got - expected).abs().max() < 0.05
