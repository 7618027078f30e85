"""The routing of a mixture-of-experts layer in one launch: `modeling.moe.route` for the router's fp32 logits.

At verify sizes the layer's cost should be reading its experts' weights; the torch routing (scores, the group
pick, a stable sort, a gather, the renormalisation) is a dozen small launches per layer, which at 1-16 tokens
cost as much as the experts' GEMMs. One program per token: scores (softmax or sigmoid), the correction bias,
the best groups (a group scores as its best expert, or as its best two with noaux_tc), then k picks of the
best remaining expert (ties to the lower id, as the stable sort), the weights from the uncorrected scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from modeling.config import MoEConfig


@triton.jit
def _best_of_groups(choice, member, experts, TWO: tl.constexpr):
    """[G] scores of the groups of `member` [G, E]: the best expert's choice, or the sum of the best two."""
    grouped = tl.where(member, choice[None, :], float("-inf"))
    best = tl.max(grouped, axis=1)
    if TWO:
        first = tl.argmax(grouped, axis=1)
        second = tl.max(tl.where(experts[None, :] == first[:, None], float("-inf"), grouped), axis=1)
        best = best + second
    return best


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, stride_l, scale, shared_expert,
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    OUT_K: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_SUM_OF_TWO: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_PAD)
    real = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=real, other=float("-inf"))
    if SIGMOID:
        scores = tl.where(real, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    else:
        exps = tl.exp(logits - tl.max(logits, axis=0))
        scores = exps / tl.sum(exps, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=real, other=0.0)
    choice = tl.where(real, choice, float("-inf"))
    if TOPK_GROUPS < NUM_GROUPS:
        groups = tl.arange(0, GROUPS_PAD)
        member = (experts[None, :] // (NUM_EXPERTS // NUM_GROUPS) == groups[:, None]) & real[None, :]
        group_scores = tl.where(groups < NUM_GROUPS, _best_of_groups(choice, member, experts, GROUP_SUM_OF_TWO),
                                float("-inf"))
        kept = groups < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.argmax(group_scores, axis=0)
            kept = kept | (groups == best)
            group_scores = tl.where(groups == best, float("-inf"), group_scores)
        in_kept = tl.max((member & kept[:, None]).to(tl.int32), axis=0) > 0
        choice = tl.where(in_kept, choice, float("-inf"))
    picks = tl.arange(0, TOPK_PAD)
    ids = tl.zeros([TOPK_PAD], dtype=tl.int64)
    weights = tl.zeros([TOPK_PAD], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        ids = tl.where(picks == slot, best.to(tl.int64), ids)
        weights = tl.where(picks == slot, tl.sum(tl.where(experts == best, scores, 0.0), axis=0), weights)
        choice = tl.where(experts == best, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(ids_ptr + token * OUT_K + picks, ids, mask=picks < TOP_K)
    tl.store(weights_ptr + token * OUT_K + picks, weights * scale, mask=picks < TOP_K)
    if OUT_K > TOP_K:  # the shared expert's pair: weight 1, unscaled
        tl.store(ids_ptr + token * OUT_K + TOP_K, shared_expert.to(tl.int64))
        tl.store(weights_ptr + token * OUT_K + TOP_K, 1.0)


def fused_route(logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None,
                shared_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`modeling.moe.route` in one launch: logits [N, E] fp32 -> expert ids [N, k] int64, fp32 weights [N, k].
    With `shared_expert`, one more pair per token after the k routed ones: that id with weight 1 (the shared expert
    run as a stacked one, `modeling.moe.MoE.fuse_projections`): [N, k + 1] each."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] != moe.num_experts:
        raise ValueError(f"logits must be fp32 [N, {moe.num_experts}]")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_tokens, k = logits.shape[0], moe.experts_per_token
    out_k = k + (shared_expert is not None)
    ids = torch.empty(num_tokens, out_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, out_k, dtype=torch.float32, device=logits.device)
    grouped = moe.topk_method != "greedy" and moe.topk_groups < moe.num_groups
    if num_tokens:
        bias = correction_bias.float().contiguous() if correction_bias is not None else logits
        _route_kernel[(num_tokens,)](
            logits, bias, ids, weights, logits.stride(0), moe.routed_scaling_factor, shared_expert or 0,
            NUM_EXPERTS=moe.num_experts, EXPERTS_PAD=triton.next_power_of_2(moe.num_experts), TOP_K=k,
            TOPK_PAD=triton.next_power_of_2(k), OUT_K=out_k,
            SIGMOID=moe.scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
            NUM_GROUPS=moe.num_groups if grouped else 1, GROUPS_PAD=triton.next_power_of_2(moe.num_groups),
            TOPK_GROUPS=moe.topk_groups if grouped else 1, GROUP_SUM_OF_TWO=moe.topk_method == "noaux_tc",
            NORM=moe.norm_topk_prob, num_warps=4)
    return ids, weights
