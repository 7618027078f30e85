"""The fused routing kernel against `modeling.moe.route`, in Triton's interpreter on the CPU (the `gpu` test runs
it on CUDA): the same experts in the same order, the same weights, for every routing the served models use."""

from __future__ import annotations

import pytest
import torch

from ddtree_kernels.moe_routing import fused_route
from modeling.config import MoEConfig
from modeling.moe import route

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter cases run on CPU machines")

# name: (experts, k, scoring, topk_method, groups, topk_groups, norm, scale, correction bias)
ROUTINGS = {
    "deepseek-v2-lite": (64, 6, "softmax", "greedy", 1, 1, False, 1.0, False),
    "deepseek-v2": (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0, False),
    "deepseek-v3": (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, True),
    "glm-4.7-flash": (64, 4, "sigmoid", "noaux_tc", 1, 1, True, 1.8, True),
    "kimi-k2": (384, 8, "sigmoid", "noaux_tc", 1, 1, True, 2.827, True),
}


def routing(name: str) -> tuple[MoEConfig, torch.Tensor | None]:
    experts, k, scoring, method, groups, topk_groups, norm, scale, biased = ROUTINGS[name]
    moe = MoEConfig(num_experts=experts, experts_per_token=k, intermediate_size=8, num_shared_experts=1,
                    sparse_layers=(0,), scoring=scoring, topk_method=method, num_groups=groups,
                    topk_groups=topk_groups, norm_topk_prob=norm, routed_scaling_factor=scale)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(1)) * 0.1 if biased else None
    return moe, bias


def check(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> None:
    want_ids, want_weights = route(logits, moe, bias)
    ids, weights = fused_route(logits, moe, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@cpu_only
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_fused_routing_equals_the_torch_routing(name: str) -> None:
    moe, bias = routing(name)
    for num_tokens in (1, 7):
        check(torch.randn(num_tokens, moe.num_experts, generator=torch.Generator().manual_seed(num_tokens)) * 3,
              moe, bias)


@cpu_only
@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3", "glm-4.7-flash"])
def test_ties_go_to_the_lower_expert_and_group(name: str) -> None:
    """Logits of a few distinct values: many experts (and groups) tie, and both pick the lower ids first."""
    moe, bias = routing(name)
    logits = torch.randint(0, 3, (5, moe.num_experts), generator=torch.Generator().manual_seed(2)).float()
    check(logits, moe, None if bias is None else torch.zeros_like(bias))


@cpu_only
def test_the_shared_expert_follows_the_routed_pairs() -> None:
    """With `shared_expert`, each token's routed pairs are unchanged and one more follows: that id, weight 1."""
    moe, bias = routing("glm-4.7-flash")
    logits = torch.randn(5, moe.num_experts, generator=torch.Generator().manual_seed(4)) * 3
    routed_ids, routed_weights = fused_route(logits, moe, bias)
    ids, weights = fused_route(logits, moe, bias, shared_expert=moe.num_experts)
    assert ids.shape == weights.shape == (5, moe.experts_per_token + 1)
    assert torch.equal(ids[:, :-1], routed_ids) and torch.equal(weights[:, :-1], routed_weights)
    assert ids[:, -1].tolist() == [moe.num_experts] * 5 and weights[:, -1].tolist() == [1.0] * 5


@cpu_only
def test_no_tokens_and_bad_logits() -> None:
    moe, bias = routing("glm-4.7-flash")
    ids, weights = fused_route(torch.zeros(0, moe.num_experts), moe, bias)
    assert ids.shape == (0, 4) and weights.shape == (0, 4)
    with pytest.raises(ValueError, match="logits must be fp32"):
        fused_route(torch.zeros(2, moe.num_experts, dtype=torch.float16), moe, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_fused_routing_gpu(name: str) -> None:
    moe, bias = routing(name)
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, moe.num_experts, generator=generator) * 3).cuda()
    check(logits, moe, None if bias is None else bias.cuda())
