"""DDTree's best-first heap on the GPU: one program per session builds its tree from the ranked top-k rows.

The host heap (`drafter_service.tree_builder.best_first_tree`) costs ~20 us a session in Python, 1.3 ms for a
batch of 64 (benchmarks/results/ddtree_builder.md); here the batch's trees come out of one launch and only
their [S, budget] node arrays travel to the host. The frontier lives in registers: each pop takes the smallest
(-path log-prob, depth, parent, rank), the host heap's total order, puts the popped entry's next sibling in
its slot and appends its first child. Path sums are fp64, as the host heap's Python floats, so both build the
same trees from the same rows, scores included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pick(selected, x):
    """The value of x where `selected` (exactly one lane) holds."""
    return tl.sum(tl.where(selected, x, tl.zeros_like(x)), 0)


@triton.jit
def _best_first_kernel(
    values_ptr, ids_ptr, budgets_ptr,  # [S, D, K] fp32 (ranked, best first), [S, D, K] int64, [S] int64
    tokens_ptr, parents_ptr, depths_ptr, scores_ptr, counts_ptr,  # [S, MAX_NODES] x4 (scores fp64), [S]
    num_depths, width,
    MAX_NODES: tl.constexpr, FRONTIER: tl.constexpr,
):
    session = tl.program_id(0).to(tl.int64)
    rows = values_ptr + session * num_depths * width
    row_ids = ids_ptr + session * num_depths * width
    out = session * MAX_NODES
    budget = tl.load(budgets_ptr + session)
    ranked = tl.minimum(budget, width)  # a session of budget b ranks only its top b
    lanes = tl.arange(0, FRONTIER)
    nodes = tl.arange(0, MAX_NODES)
    inf = float("inf")
    first = -tl.load(rows).to(tl.float64)
    neg = tl.where(budget > 0, tl.where(lanes == 0, first, inf), inf)  # an empty slot's key is +inf
    depth = tl.where(lanes == 0, 1, 0).to(tl.int64)
    parent = tl.full((FRONTIER,), -1, tl.int64)
    rank = tl.zeros((FRONTIER,), tl.int64)
    scores = tl.zeros((MAX_NODES,), tl.float64)
    size = 1
    count = 0
    for node in range(0, tl.minimum(budget, MAX_NODES)):
        best = tl.min(neg, 0)
        alive = best < inf  # False once a budget beyond every path (K^D nodes) has them all
        order = (depth * (MAX_NODES + 2) + parent + 1) * width + rank  # the heap's order among equal log-probs
        order = tl.where(neg == best, order, 1 << 62)
        popped = order == tl.min(order, 0)
        d, p, r = _pick(popped, depth), _pick(popped, parent), _pick(popped, rank)
        score = -_pick(popped, tl.where(alive, neg, 0.0))
        tl.store(tokens_ptr + out + node, tl.load(row_ids + (d - 1) * width + r, mask=alive), mask=alive)
        tl.store(parents_ptr + out + node, p, mask=alive)
        tl.store(depths_ptr + out + node, d, mask=alive)
        tl.store(scores_ptr + out + node, score, mask=alive)
        scores = tl.where(nodes == node, score, scores)
        count += alive.to(tl.int32)
        # the popped slot takes its next sibling, if the session ranks that far
        sibling = alive & (r + 1 < ranked)
        base = tl.where(p >= 0, _pick(nodes == p, scores), 0.0)
        next_value = tl.load(rows + (d - 1) * width + r + 1, mask=sibling, other=0.0).to(tl.float64)
        replaced = tl.where(alive, popped, False)  # NOTE: `popped & alive` (block & scalar) fails in the interpreter
        neg = tl.where(replaced, tl.where(sibling, -(base + next_value), inf), neg)
        rank = tl.where(replaced, r + 1, rank)
        # a new slot takes its first child, if there is a deeper row
        child = alive & (d < num_depths)
        child_value = tl.load(rows + d * width, mask=child, other=0.0).to(tl.float64)
        appended = tl.where(child, lanes == size, False)
        neg = tl.where(appended, -score - child_value, neg)
        depth = tl.where(appended, d + 1, depth)
        parent = tl.where(appended, node, parent)
        rank = tl.where(appended, 0, rank)
        size += child.to(tl.int32)
    tl.store(counts_ptr + session, count)


def best_first_trees(values: torch.Tensor, ids: torch.Tensor, budgets: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every session's DDTree of `budgets[s]` nodes from its ranked top-k rows, on their device.

    values: [S, D, K] fp32 log-probs and ids: [S, D, K] int64, each row sorted best first (top_k_log_probs);
    budgets: [S] int64. -> (tokens, parents, depths, scores fp64) [S, M] and node counts [S] (M = the largest
    budget); node i of session s is valid for i < counts[s], in the host heap's order.
    """
    num_sessions, num_depths, width = values.shape
    if ids.shape != values.shape or budgets.shape != (num_sessions,):
        raise ValueError("values and ids must be [S, D, K] alike and budgets [S]")
    most = int(budgets.max()) if num_sessions else 0
    max_nodes = triton.next_power_of_2(max(most, 1))
    shape = (num_sessions, max_nodes)  # NOTE: empty: a program writes its valid nodes and its count only
    nodes = torch.empty((3, *shape), dtype=torch.int64, device=values.device)  # tokens, parents, depths
    scores = torch.empty(shape, dtype=torch.float64, device=values.device)
    counts = torch.zeros(num_sessions, dtype=torch.int32, device=values.device)
    tokens, parents, depths = nodes
    if num_sessions and most > 0 and num_depths and width:
        # NOTE: one warp: each pop is a chain of reductions over a few dozen lanes, shuffles within the warp
        _best_first_kernel[(num_sessions,)](
            values.contiguous(), ids.contiguous(), budgets, tokens, parents, depths, scores, counts,
            num_depths, width, MAX_NODES=max_nodes, FRONTIER=triton.next_power_of_2(max_nodes + 1), num_warps=1)
    return tokens[:, :most], parents[:, :most], depths[:, :most], scores[:, :most], counts
