"""The mixture-of-experts MLP of DeepSeek-V2/V3, Kimi K2 and GLM-4.7-Flash: each token goes to k of E routed
experts and, always, to the shared experts.

The torch version is the reference the fused GPU kernels are tested against: `route` is the routing that
ddtree_kernels/moe_routing.py computes in one launch on CUDA, and `MoE.run_experts` the exact grouped computation
ddtree_kernels/fused_moe.py replaces on CUDA once `fuse_projections` has stacked the experts (no capacity limit, no
dropped tokens); a prefill chunk's thousands of tokens take torch's grouped GEMM instead (`grouped_gemm_experts`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from modeling.config import ModelConfig, MoEConfig
from modeling.layers import MLP
from modeling.ops import row_ops

SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def route(logits: torch.Tensor, moe: MoEConfig,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights, from the router's fp32 logits [N, E].

    Scores are softmax (DeepSeek-V2) or sigmoid (V3 and later) of the logits. The choice ranks experts by score
    plus `correction_bias` (V3's auxiliary-loss-free load balancing: it steers the choice, never the weights),
    restricted to each token's best `topk_groups` of `num_groups` equal groups unless `topk_method` is greedy.
    The weights are the chosen experts' uncorrected scores, renormalised to sum to 1 when `norm_topk_prob`, times
    `routed_scaling_factor`.
    NOTE: ties go to the lower expert (and group) id on every device, so a routing is reproducible.
    Returns expert ids [N, k] (int64, best choice first) and fp32 weights [N, k]."""
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()  # [N, E]
    choice = scores if correction_bias is None else scores + correction_bias
    if moe.topk_method != "greedy" and moe.topk_groups < moe.num_groups:
        choice = _within_best_groups(choice, moe)
    ids = _top(choice, moe.experts_per_token)  # [N, k]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * moe.routed_scaling_factor


def _within_best_groups(choice: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """`choice` [N, E] with -inf outside each token's best `topk_groups` groups. A group scores as its best
    expert (group_limited_greedy) or as the sum of its best two (noaux_tc)."""
    grouped = choice.view(choice.shape[0], moe.num_groups, -1)  # [N, G, E / G]
    if moe.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
    else:
        group_scores = grouped.amax(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _top(group_scores, moe.topk_groups), True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values of each row, ties to the lower index (torch.topk leaves ties open)."""
    return values.sort(dim=-1, descending=True, stable=True).indices[:, :k]


class Router(nn.Module):
    """`gate.weight` [E, hidden] and, for sigmoid scoring, `gate.e_score_correction_bias` [E].
    NOTE: `keep_fp32`: the loader keeps these in fp32 whatever the model dtype (as transformers does): the choice
    hangs on small score differences, and the bias is added to scores in [0, 1]."""

    keep_fp32 = True

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.scoring == "sigmoid" else None
        self.e_score_correction_bias = bias

    def forward(self, x: torch.Tensor, shared_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, hidden] -> expert ids [N, k], fp32 weights [N, k]; the logits are computed in fp32. On CUDA,
        `shared_expert` adds a pair per token to that expert with weight 1 ([N, k + 1] each)."""
        logits = F.linear(x.float(), self.weight.float())  # [N, E]
        if logits.is_cuda:
            from ddtree_kernels.moe_routing import fused_route  # NOTE: Triton loads only where it runs

            return fused_route(logits, self.moe, self.e_score_correction_bias, shared_expert)
        if shared_expert is not None:
            raise ValueError("the shared expert runs as a routed pair only on CUDA")
        return route(logits, self.moe, self.e_score_correction_bias)


def expert_mlp(config: ModelConfig, intermediate_size: int) -> MLP:
    """A silu-gated MLP without biases (experts never have them) of the given width."""
    return MLP(replace(config, intermediate_size=intermediate_size, mlp_bias=False))


class StackedExperts(nn.Module):
    """Consecutive routed experts as the fused kernel reads them: `w13` [E, 2I, hidden] (each expert's gate rows,
    then its up rows) and `w2` [E, hidden, I]. Each expert's Linear weights become views of them, so names,
    loading and memory are unchanged (as `FusedLinear`); the stacks are non-persistent buffers."""

    def __init__(self, experts: list[MLP], first_expert: int):
        super().__init__()
        self.first_expert = first_expert
        w13 = torch.stack([torch.cat([e.gate_proj.weight.detach(), e.up_proj.weight.detach()]) for e in experts])
        self.register_buffer("w13", w13, persistent=False)
        self.register_buffer("w2", torch.stack([e.down_proj.weight.detach() for e in experts]), persistent=False)
        inter = experts[0].gate_proj.out_features
        for j, expert in enumerate(experts):
            expert.gate_proj.weight = nn.Parameter(self.w13[j, :inter], requires_grad=False)
            expert.up_proj.weight = nn.Parameter(self.w13[j, inter:], requires_grad=False)
            expert.down_proj.weight = nn.Parameter(self.w2[j], requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if ids.numel() >= GROUPED_GEMM_FROM_PAIRS and grouped_gemm_runs(x.device):
            return grouped_gemm_experts(x, ids, weights, self.w13, self.w2, self.first_expert)
        from ddtree_kernels.fused_moe import fused_moe  # NOTE: Triton loads only where it runs

        return fused_moe(x, ids, weights, self.w13, self.w2, self.first_expert)


# NOTE: from this many (token, expert) pairs on (a prefill chunk's), the routed experts run as two grouped GEMMs of
# the library rather than the fused kernels, whose small tiles suit a verify step's few rows per expert. On an H100
# (benchmarks/results/moe_layer_h100.md), 4096 tokens: GLM-4.7-Flash 1.95 -> 0.92 ms, DeepSeek-V2-Lite 2.51 -> 1.13;
# at 1024 tokens (4096 GLM pairs) an eager probe timed both alike
GROUPED_GEMM_FROM_PAIRS = 8192


@functools.cache
def grouped_gemm_runs(device: torch.device) -> bool:
    """Whether torch's grouped GEMM serves this device (CUTLASS's, on Hopper and later)."""
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def grouped_gemm_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """`StackedExperts`' result through torch's grouped GEMM: the pairs sorted by expert, each expert's rows times
    its weights in one launch per projection, summed per token in fp32 as the fused kernel does. Pairs of another
    rank's experts sort last, past every group: their rows are left unwritten, so they are dropped, never scaled.
    x: [N, hidden]; ids, weights: [N, k]; w13: [E, 2I, hidden]; w2: [E, hidden, I] -> [N, hidden] fp32."""
    # NOTE: Triton loads only where it runs
    from ddtree_kernels.fused_moe import pairs_by_expert, weighted_pair_sum

    num_experts, inter = w2.shape[0], w2.shape[2]
    local, order, counts = pairs_by_expert(ids, first_expert, num_experts)
    group_ends = counts.cumsum(0, dtype=torch.int32)
    gate_up = torch._grouped_mm(x[order // ids.shape[1]], w13.transpose(1, 2), offs=group_ends)  # [P, 2I]
    hidden_rows = row_ops(gate_up).silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    out = torch._grouped_mm(hidden_rows, w2.transpose(1, 2), offs=group_ends)  # [P, hidden], in `order`
    return weighted_pair_sum(out, order, weights, local, num_experts)


class MoE(nn.Module):
    """Routed experts plus shared experts, named as in the checkpoints under a layer's `mlp.`: `gate.*`,
    `experts.{j}.{gate,up,down}_proj.weight`, `shared_experts.{gate,up,down}_proj.weight`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture}: the config has no routed experts")
        if moe.scoring not in SCORINGS or moe.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported routing: scoring {moe.scoring!r} (expected one of {SCORINGS}), "
                             f"topk_method {moe.topk_method!r} (expected one of {TOPK_METHODS})")
        if moe.num_experts % moe.num_groups:
            raise ValueError(f"{moe.num_experts} experts do not split into {moe.num_groups} equal groups")
        self.gate = Router(config.hidden_size, moe)
        self.experts = nn.ModuleList(expert_mlp(config, moe.intermediate_size) for _ in range(moe.num_experts))
        shared = moe.num_shared_experts * moe.intermediate_size
        self.shared_experts = expert_mlp(config, shared) if shared else None
        self.stacked: StackedExperts | None = None
        self.shared_stacked = False  # the shared expert runs in the fused kernels as one more pair per token

    def fuse_projections(self) -> None:
        """For CUDA serving: the held routed experts stacked for the fused kernel. The shared expert joins the stack
        (one more pair per token, weight 1, summed after the routed ones as the forward adds it) when it is one
        expert's width and this rank holds every routed expert (each expert id is then its stack index); else its
        gate/up run as one GEMM. Idempotent: a second call must not move the weights, since captured CUDA graphs
        read them."""
        if self.stacked is None:
            held = [j for j, expert in enumerate(self.experts) if expert is not None]
            if held != list(range(held[0], held[-1] + 1)):
                raise ValueError("a rank's routed experts must be consecutive")
            shared = self.shared_experts
            self.shared_stacked = (shared is not None and len(held) == len(self.experts)
                                   and shared.gate_proj.out_features == self.gate.moe.intermediate_size)
            stack = [self.experts[j] for j in held] + ([shared] if self.shared_stacked else [])
            self.stacked = StackedExperts(stack, held[0])
        if self.shared_experts is not None and not self.shared_stacked:
            self.shared_experts.fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]."""
        return self.expert_sum(x).to(x.dtype)

    def expert_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted outputs plus the shared experts', in fp32 [N, hidden]."""
        if self.shared_stacked and x.is_cuda:
            return self.stacked(x, *self.gate(x, shared_expert=len(self.experts)))
        ids, weights = self.gate(x)
        out = self.run_experts(x, ids, weights)
        if self.shared_experts is not None:
            out += self.shared_experts(x)
        return out

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(token), accumulated in fp32. The (token, expert)
        pairs are sorted by expert, so each expert that has tokens runs once, on its rows only; an expert that is
        None (held by another tensor-parallel rank) is skipped. x: [N, hidden]; ids, weights: [N, k] -> [N, hidden]
        fp32. On CUDA, once stacked, the fused kernel does the same without a host sync."""
        if self.stacked is not None and x.is_cuda:
            return self.stacked(x, ids, weights)
        k = ids.shape[1]
        flat = ids.flatten()  # [N * k], token-major
        order = flat.argsort(stable=True)  # the pairs grouped by expert, tokens ascending within each
        tokens = order // k  # [N * k]: the token of each sorted pair
        pair_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # NOTE: syncs with the device
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count and expert is not None:
                rows = tokens[start:start + count]
                out.index_add_(0, rows, expert(x[rows]) * pair_weights[start:start + count, None])
            start += count
        return out
