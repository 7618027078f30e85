"""DDTree: the draft tree of `budget` nodes that maximizes the sum of path probabilities.

docs/design.md section 4. The drafter gives one log-probability row per depth (the same distribution for
every node at that depth), so a node's path log-prob is the sum of its ranks' log-probs along the path
and the best `budget` prefixes can be popped best-first from a heap. The top-k runs on the drafter's
device; the heap runs on the CPU over plain Python floats (no per-node tensor ops), which keeps it a
small share of the build next to the top-k (benchmarks/results/ddtree_builder.md). On a GPU a batch's trees
are built there instead, one program per session (`draft_trees`).

Tie-breaking (deterministic, documented because acceptance depends on it):
- within a depth, equal log-probs are ranked by token id, lowest first (among the top-k kept; which
  tokens tie at the k-th boundary is the top-k's choice);
- in the heap, equal path log-probs pop shallower first, then the child of the earlier node, then the
  lower rank. This key is a total order, so the tree never depends on heap internals.
"""

from __future__ import annotations

import heapq

import torch

from modeling.ops import rank_top_k, row_ops
from modeling.tree import DraftTree

# a GPU batch of this many sessions builds its trees on the GPU: on an H100 a launch and its copies cost ~0.2 ms
# against ~20 us a session for the host heap (benchmarks/results/draft_commit_graphs.md)
GPU_TREES_FROM = 16


def top_k_per_depth(logp: torch.Tensor, budget: int, top_k: int | None = None) -> tuple[list, list]:
    """Top K = min(budget, V, top_k) tokens per depth, sorted by (log-prob desc, token id asc).

    Works on logp's own device; one device->host transfer of the [..., K] values and indices.
    logp: [..., D, V] -> (values, token ids) as nested lists of shape [..., D, K].
    """
    k = min(budget, logp.shape[-1], top_k if top_k is not None else budget)
    values, ids = rank_top_k(*torch.topk(logp, k, dim=-1, sorted=True))  # [..., D, K]
    return values.double().cpu().tolist(), ids.cpu().tolist()


def top_k_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens per row with their log-probs, ranked as top_k_per_depth ranks them.

    Only the k kept logits become log-probs (minus the row's fp32 logsumexp): no [..., V] log_softmax is written,
    and the logits are read in their own dtype (a bf16 value is exact in fp32, so the top-k is the same); on CUDA
    in two reads of the row (ddtree_kernels/row_top_k.py).
    logits: [..., V] -> (fp32 log-probs, token ids), each [..., min(k, V)], on logits' device.
    """
    return row_ops(logits).top_k_log_probs(logits, k)


def best_first_tree(values: list[list[float]], ids: list[list[int]], budget: int) -> DraftTree:
    """The heap part: pop the `budget` most probable prefixes from per-depth sorted top-k lists.

    values, ids: [D, K] plain Python lists, each row sorted best first. A heap entry is
    (-path_logp, depth, parent node, rank); popping it adds token ids[depth-1][rank] under parent,
    then pushes its next sibling and its first child.
    """
    num_depths = len(values)
    if budget <= 0 or num_depths == 0 or not values[0]:
        return DraftTree.empty()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap = [(-values[0][0], 1, -1, 0)]
    pop, push = heapq.heappop, heapq.heappush
    while heap and len(tokens) < budget:
        neg, depth, parent, rank = pop(heap)
        node = len(tokens)
        row = values[depth - 1]
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        if rank + 1 < len(row):
            base = scores[parent] if parent >= 0 else 0.0
            push(heap, (-(base + row[rank + 1]), depth, parent, rank + 1))
        if depth < num_depths:
            push(heap, (neg - values[depth][0], depth + 1, node, 0))
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(scores))


def build_ddtree(logp: torch.Tensor, budget: int, top_k: int | None = None) -> DraftTree:
    """One session's tree from its per-depth log-probs.

    logp: [B-1, V], row d-1 = depth d, on any device. `top_k` caps K further: budget = B-1 with
    top_k = 1 gives the plain DFlash chain of argmax tokens.
    """
    if budget <= 0 or logp.shape[0] == 0:
        return DraftTree.empty()
    values, ids = top_k_per_depth(logp, budget, top_k)
    return best_first_tree(values, ids, budget)


def trees_from_top_k(values: torch.Tensor, ids: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    """One tree per session from ranked top-k rows (top_k_log_probs) already on the host.

    values, ids: [S, D, K] CPU tensors. A session of budget b uses the first b ranks of its rows: the tree
    of a top-b, since a rank-r node needs its r better siblings in the tree first.
    """
    return [best_first_tree(v[:, :b].tolist(), i[:, :b].tolist(), b) for v, i, b in zip(values, ids, budgets)]


def draft_trees(values: torch.Tensor, ids: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    """trees_from_top_k for rows on any device. A GPU batch of GPU_TREES_FROM sessions or more builds its trees
    there, one program per session (ddtree_kernels.best_first_tree, the same trees), and only their nodes come to
    the host; a smaller one brings the first max(budgets) ranks to the host heap."""
    if not (values.is_cuda and len(budgets) >= GPU_TREES_FROM):
        width = max(budgets, default=0)
        return trees_from_top_k(*_to_host(values[..., :width], ids[..., :width]), budgets)
    from ddtree_kernels.best_first_tree import best_first_trees  # NOTE: Triton loads only where it runs

    with torch.cuda.device(values.device):  # NOTE: the launch goes to the calling thread's device, maybe another
        wanted = torch.tensor(budgets, dtype=torch.int64).to(values.device, non_blocking=True)
        return trees_from_nodes(*_to_host(*best_first_trees(values, ids, wanted)))


def trees_from_nodes(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                     counts: torch.Tensor) -> list[DraftTree]:
    """The trees of ddtree_kernels.best_first_trees' node arrays ([S, M] each, counts [S]), on the host."""
    tokens, parents, depths, scores, counts = (t.tolist() for t in (tokens, parents, depths, scores, counts))
    return [DraftTree(tuple(tokens[s][:n]), tuple(parents[s][:n]), tuple(depths[s][:n]), tuple(scores[s][:n]))
            for s, n in enumerate(counts)]


def _to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of the tensors, with one wait for all of them when they are on a GPU."""
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    if tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()
    return copies
