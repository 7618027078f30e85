"""The mixture-of-experts layer matches transformers' DeepSeek-V2/V3 and GLM-4.7-Flash MoE modules, runs only the
experts its tokens route to, and routes ties reproducibly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteMoE

from modeling.checkpoint import load_causal_lm
from modeling.config import ModelConfig
from modeling.moe import MoE, route
from modeling.tiny import make_tiny_target

HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 32, 16, 16, 4
SHAPE = dict(hidden_size=HIDDEN, moe_intermediate_size=EXPERT_WIDTH, n_routed_experts=EXPERTS,
             num_experts_per_tok=TOP_K)
V2 = ("DeepseekV2ForCausalLM", transformers.DeepseekV2Config, DeepseekV2Moe)
V3 = ("DeepseekV3ForCausalLM", transformers.DeepseekV3Config, DeepseekV3MoE)
GLM = ("Glm4MoeLiteForCausalLM", transformers.Glm4MoeLiteConfig, Glm4MoeLiteMoE)
CASES = {
    "v2-greedy": (*V2, dict(topk_method="greedy", n_shared_experts=2, routed_scaling_factor=16.0)),
    # NOTE: transformers never renormalises V2's weights; our config parsing follows it.
    "v2-greedy-norm_topk_prob": (*V2, dict(topk_method="greedy", n_shared_experts=2, norm_topk_prob=True)),
    "v2-group_limited_greedy": (*V2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                          n_shared_experts=2, routed_scaling_factor=16.0)),
    "v3-noaux_tc": (*V3, dict(n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)),
    "v3-unnormalised": (*V3, dict(n_group=4, topk_group=2, n_shared_experts=1, norm_topk_prob=False)),
    "kimi-k2": (*V3, dict(n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.827)),
    "glm4_moe_lite": (*GLM, dict(n_shared_experts=1, routed_scaling_factor=1.8)),
}


def hf_pair(case: str, seed: int = 0) -> tuple[torch.nn.Module, MoE]:
    """transformers' MoE module of the case with random weights (and correction bias), and ours holding them."""
    arch, config_cls, module_cls, extra = CASES[case]
    hf_config = config_cls(architectures=[arch], **SHAPE, **extra)
    hf_config._experts_implementation = "eager"  # the per-expert loop, the reference
    torch.manual_seed(seed)
    reference = module_cls(hf_config).eval()
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.3)
    if hasattr(reference.gate, "e_score_correction_bias"):
        reference.gate.e_score_correction_bias.normal_(std=0.3)
    ours = MoE(ModelConfig.from_hf(hf_config.to_dict())).eval()
    ours.load_state_dict(checkpoint_names(reference.state_dict()), strict=True)
    return reference, ours


def checkpoint_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors under the per-expert checkpoint names, as its save_pretrained writes
    them: gate_up_proj [E, 2I, H] is each expert's gate_proj then up_proj; down_proj [E, H, I]."""
    out = {}
    for name, tensor in state.items():
        if name == "experts.gate_up_proj":
            gates, ups = tensor.chunk(2, dim=1)
            for j in range(len(tensor)):
                out[f"experts.{j}.gate_proj.weight"], out[f"experts.{j}.up_proj.weight"] = gates[j], ups[j]
        elif name == "experts.down_proj":
            out.update({f"experts.{j}.down_proj.weight": down for j, down in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


def chosen(ids: torch.Tensor) -> torch.Tensor:
    return ids.sort(dim=-1).values


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_matches_transformers(case: str, device: str) -> None:
    """On CUDA the experts run through the Triton row ops; transformers stays the CPU reference."""
    reference, ours = hf_pair(case)
    ours.to(device)
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        _, hf_weights, hf_ids = reference.gate(x)
        ids, weights = (t.cpu() for t in ours.gate(x.to(device)))
        expected, got = reference(x), ours(x.to(device)).cpu()
    assert ids.unique().numel() > EXPERTS // 2 and chosen(ids).unique(dim=0).shape[0] > 16  # routing varies
    torch.testing.assert_close(chosen(ids), chosen(hf_ids), rtol=0, atol=0)
    torch.testing.assert_close(weights.gather(1, ids.argsort(dim=-1)), hf_weights.gather(1, hf_ids.argsort(dim=-1)))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["v2-group_limited_greedy", "v3-noaux_tc"])
def test_group_limit_and_correction_bias_change_the_choice(case: str) -> None:
    """Guards the comparison above: these cases route differently without their group limit or bias."""
    _, ours = hf_pair(case)
    moe, bias = ours.gate.moe, ours.gate.e_score_correction_bias
    logits = torch.randn(64, HIDDEN) @ ours.gate.weight.T  # [N, E]
    ids = chosen(route(logits, moe, bias)[0])
    assert not torch.equal(ids, chosen(route(logits, replace(moe, topk_groups=moe.num_groups), bias)[0]))
    if bias is not None:
        assert not torch.equal(ids, chosen(route(logits, moe, torch.zeros_like(bias))[0]))


def test_parameter_names_are_the_checkpoints(tmp_path) -> None:
    """Our names and shapes under `mlp.` are those transformers' save_pretrained writes, and the per-expert split
    of the fused tensors is the one it writes."""
    hf_config = transformers.DeepseekV3Config(architectures=[V3[0]], vocab_size=64, num_hidden_layers=2,
                                              first_k_dense_replace=1, num_attention_heads=2, kv_lora_rank=16,
                                              q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                              intermediate_size=64, n_group=4, topk_group=2, **SHAPE)
    reference = transformers.DeepseekV3ForCausalLM(hf_config)
    reference.save_pretrained(tmp_path)
    prefix = "model.layers.1.mlp."
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as saved:
        written = {name.removeprefix(prefix): saved.get_tensor(name) for name in saved.keys() if prefix in name}
    ours = MoE(ModelConfig.from_hf(hf_config.to_dict()))
    assert {n: tuple(p.shape) for n, p in ours.named_parameters()} == {n: tuple(t.shape) for n, t in written.items()}
    split = checkpoint_names(reference.model.layers[1].mlp.state_dict())
    assert all(torch.equal(split[name], tensor) for name, tensor in written.items())


def test_runs_only_the_routed_experts_each_once() -> None:
    """Every token prefers experts 2 and 5: only they run, once each, on all the tokens' rows; the result equals
    the dense sum over all experts of the routing weight (zero when not chosen) times the expert's output."""
    _, ours = hf_pair("kimi-k2")
    ours.gate.moe = replace(ours.gate.moe, experts_per_token=2)
    direction = torch.randn(HIDDEN)
    with torch.no_grad():
        ours.gate.weight.zero_()
        ours.gate.weight[[2, 5]] = direction
        ours.gate.e_score_correction_bias.zero_()
    x = torch.rand(40, 1) * direction + 0.01 * torch.randn(40, HIDDEN)
    calls: list[tuple[int, int]] = []
    for j, expert in enumerate(ours.experts):
        expert.register_forward_hook(lambda module, args, out, j=j: calls.append((j, args[0].shape[0])))
    with torch.no_grad():
        ids, weights = ours.gate(x)
        got = ours.run_experts(x, ids, weights)
        assert calls == [(2, 40), (5, 40)]
        dense = torch.zeros(40, EXPERTS).scatter(1, ids, weights)  # [N, E]
        expected = sum(dense[:, j, None] * expert(x) for j, expert in enumerate(ours.experts))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# Experts 3, 9, 12, 14 and 15 tie for the best score, all others tie below them (see each case's groups).
TIED_BEST = (3, 9, 12, 14, 15)
TIE_WINNERS = {
    "v2-greedy": [3, 9, 12, 14],
    "v2-group_limited_greedy": [3, 9, 0, 1],  # groups 0, 2 and 3 tie: 0 and 2 are kept
    "v3-noaux_tc": [3, 12, 14, 15],  # group 3 is best (two top scores), then 0 and 2 tie: 0 is kept
}


@pytest.mark.parametrize("case", sorted(TIE_WINNERS))
def test_ties_go_to_the_lower_expert_and_group(case: str) -> None:
    moe = hf_pair(case)[1].gate.moe
    logits = torch.randn(5, EXPERTS)
    logits[1], logits[3] = 0.0, 0.0
    logits[3, list(TIED_BEST)] = 1.0
    ids, _ = route(logits, moe)
    assert ids[1].tolist() == list(range(TOP_K))
    assert ids[3].tolist() == TIE_WINNERS[case]
    assert torch.equal(route(logits[3:4], moe)[0][0], ids[3])  # whatever else is in the batch


@pytest.mark.parametrize("arch, config_cls", [V2[:2], V3[:2], GLM[:2]])
def test_absent_fields_take_transformers_defaults(arch: str, config_cls: type) -> None:
    raw = {"architectures": [arch], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 6, "num_attention_heads": 2, "kv_lora_rank": 4, "q_lora_rank": 4,
           "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "n_routed_experts": 16,
           "num_experts_per_tok": 2, "moe_intermediate_size": 4}
    hf, moe = config_cls(**raw), ModelConfig.from_hf(raw).moe
    sparse = [i for i in range(6) if (hf.mlp_layer_types[i] == "sparse" if arch == GLM[0]
                                       else i >= hf.first_k_dense_replace)]
    assert list(moe.sparse_layers) == sparse
    assert moe.num_shared_experts == hf.n_shared_experts
    assert moe.routed_scaling_factor == hf.routed_scaling_factor
    assert moe.norm_topk_prob == (hf.norm_topk_prob and arch != V2[0])
    assert (moe.num_groups, moe.topk_groups) == (hf.n_group or 1, hf.topk_group or 1)


def test_router_loads_in_fp32(tmp_path) -> None:
    """In a bfloat16 model the router's weight and correction bias stay fp32, as transformers keeps them."""
    model = load_causal_lm(make_tiny_target(tmp_path, arch="deepseek_v3"), dtype="bfloat16")
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts[0].up_proj.weight.dtype == moe.shared_experts.down_proj.weight.dtype == torch.bfloat16
