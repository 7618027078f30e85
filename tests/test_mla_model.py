"""MLA + MoE targets (DeepSeek-V2/V3, GLM-4.7-Flash) match transformers on tiny random checkpoints: absorbed
latent attention, interleaved RoPE, YaRN with mscale, every routing method, dense and sparse layers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from modeling.checkpoint import INDEX_FILE, load_causal_lm
from modeling.config import ModelConfig
from tests.engine_helpers import CausalAttention

V2 = (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
V3 = (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)
GLM = (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM)
# 16 experts, 4 per token, weights of std 0.2: the 37 tokens spread over the experts with no near-ties. v_head_dim
# differs from qk_nope_head_dim, and rms_norm_eps is large, so a mixed-up dimension or eps shows.
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
             qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
             max_position_embeddings=5120, initializer_range=0.2, rms_norm_eps=1e-2)
CASES = {
    "deepseek_v2-greedy": (*V2, dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2)),
    "deepseek_v2-group-limited": (*V2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                            first_k_dense_replace=1, routed_scaling_factor=16.0)),
    "deepseek_v3": (*V3, dict(n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5)),
    "deepseek_v3-no-q-lora": (*V3, dict(q_lora_rank=None, n_group=2, topk_group=1, first_k_dense_replace=2)),
    "deepseek_v3-rope-halves": (*V3, dict(rope_interleave=False, n_group=1, topk_group=1, first_k_dense_replace=0)),
    "glm4_moe_lite": (*GLM, dict(routed_scaling_factor=1.8)),
}
# DeepSeek-V3's YaRN (factor 40 over 4096 pretrained positions) scaled down to 128 pretrained positions
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
ROPES = {"plain": None, "yarn": YARN, "yarn-mscale-differs": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.7}}


def random_reference(config_cls, model_cls, extra: dict, rope: dict | None) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    reference = model_cls(config_cls(**{**SHAPE, **extra}, rope_scaling=rope)).eval()
    with torch.no_grad():
        for name, tensor in reference.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):  # not all ones: a norm weight applied in the wrong place shows
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.1)
    return reference


def add_multi_token_prediction_layer(path, num_layers: int) -> None:
    """DeepSeek-V3 checkpoints ship their MTP module as one more layer index (not part of the causal LM)."""
    extra = {f"model.layers.{num_layers}.{name}": torch.randn(4, 4) for name in
             ("eh_proj.weight", "enorm.weight", "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight")}
    save_file(extra, str(path / "mtp.safetensors"))
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    (path / INDEX_FILE).write_text(json.dumps(index))


def routed_experts(reference: transformers.PreTrainedModel, ids: torch.Tensor,
                   positions: torch.Tensor) -> list[torch.Tensor]:
    """The top-k experts the reference's routers pick per token ([N, k] per sparse layer)."""
    picks: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picks.append(out[2]))
             for layer in reference.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        reference(ids[None], position_ids=positions[None])
    for hook in hooks:
        hook.remove()
    return picks


@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_hidden_states_match_transformers(case: str, rope: str, tmp_path) -> None:
    config_cls, model_cls, extra = CASES[case]
    reference = random_reference(config_cls, model_cls, extra, ROPES[rope])
    reference.save_pretrained(tmp_path, max_shard_size="200KB")  # sharded, per-expert tensor names
    assert (tmp_path / INDEX_FILE).is_file()
    if model_cls is transformers.DeepseekV3ForCausalLM:
        add_multi_token_prediction_layer(tmp_path, SHAPE["num_hidden_layers"])
    ours = load_causal_lm(tmp_path, dtype="float32")
    assert ours.config.attention_scale == pytest.approx(reference.model.layers[0].self_attn.scaling, rel=1e-12)
    ids = torch.randint(0, SHAPE["vocab_size"], (37,))
    positions = torch.arange(37) + 100  # across the 128 pretrained positions of the YaRN cases
    picks = routed_experts(reference, ids, positions)
    assert picks and all(len(p.unique()) >= 12 for p in picks)  # the routing varies over tokens
    with torch.no_grad():
        expected = reference(ids[None], position_ids=positions[None], output_hidden_states=True)
        hidden, features = ours(ids, positions, CausalAttention(ours.config), capture_layers=(1, 0))
    torch.testing.assert_close(ours.logits(hidden), expected.logits[0], atol=1e-4, rtol=1e-4)
    expected_features = torch.cat([expected.hidden_states[2][0], expected.hidden_states[1][0]], -1)
    torch.testing.assert_close(features, expected_features, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fusing_keeps_the_outputs(case: str, tmp_path) -> None:
    """What serving fuses (a dense layer's gate/up, MLA's input projections with their RoPE rows de-interleaved,
    the stacked experts) leaves the outputs as they were; a second fuse moves nothing."""
    config_cls, model_cls, extra = CASES[case]
    random_reference(config_cls, model_cls, extra, None).save_pretrained(tmp_path)
    ours = load_causal_lm(tmp_path, dtype="float32")
    ids, positions = torch.randint(0, SHAPE["vocab_size"], (9,)), torch.arange(9) + 50
    attend = CausalAttention(ours.config)
    attention = ours.model.layers[-1].self_attn
    with torch.no_grad():
        before = ours(ids, positions, attend)[0]
        unfused_kv = attention.kv_a_proj_with_mqa(torch.ones(1, SHAPE["hidden_size"]))
        ours.fuse_projections()
        fused_weight = attention.q_kv_a.weight
        ours.fuse_projections()
        after = ours(ids, positions, attend)[0]
        fused_kv = attention.kv_a_proj_with_mqa(torch.ones(1, SHAPE["hidden_size"]))
    assert attention.q_kv_a.weight is fused_weight and attention.rope_halves
    rope = SHAPE["qk_rope_head_dim"]
    expected_kv = unfused_kv if extra.get("rope_interleave") is False else torch.cat(
        [unfused_kv[:, :-rope], unfused_kv[:, -rope::2], unfused_kv[:, 1 - rope::2]], dim=-1)
    torch.testing.assert_close(fused_kv, expected_kv, atol=1e-6, rtol=1e-5)  # the rows reordered, no more
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config_cls, model_cls", [V2[:2], V3[:2], GLM[:2]], ids=["v2", "v3", "glm"])
def test_fields_left_out_take_the_transformers_defaults(config_cls, model_cls) -> None:
    """The model-level fields (tests/test_moe.py checks the MoE ones)."""
    required = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                    num_hidden_layers=5, num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, num_experts_per_tok=2)
    theirs = config_cls(**required)
    ours = ModelConfig.from_hf({"architectures": [model_cls.__name__], **required})
    assert (ours.mla.q_lora_rank, ours.moe.num_experts) == (theirs.q_lora_rank, theirs.n_routed_experts)
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (theirs.rms_norm_eps, theirs.max_position_embeddings)
    assert ours.mla.rope_interleave == getattr(theirs, "rope_interleave", True)  # V2: always adjacent pairs
