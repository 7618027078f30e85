"""The DDTree heap as a GPU kernel (ddtree_kernels/best_first_tree.py) against the host heap it replaces on CUDA:
the same trees, node for node, scores included.

Without CUDA the kernel runs in Triton's CPU interpreter (a few small batches: it is slow there); with CUDA the
serving shapes too. Log-probs rounded to halves make equal path sums common, so the heap's tie order is tested.
"""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_kernels.best_first_tree import best_first_trees
from drafter_service.tree_builder import draft_trees, top_k_per_depth, trees_from_nodes, trees_from_top_k
from modeling.tree import DraftTree

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def ranked_rows(sessions: int, depths: int, vocab: int, width: int, seed: int, halves: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranked top-`width` rows [S, D, K] (fp32 log-probs, int64 ids) of random per-depth distributions."""
    logits = 3 * torch.randn(sessions, depths, vocab, generator=torch.Generator().manual_seed(seed))
    if halves:
        logits = (2 * logits).round() / 2
    values, ids = (torch.tensor(rows) for rows in top_k_per_depth(torch.log_softmax(logits, -1), width))
    return values.float(), ids


def kernel_trees(values: torch.Tensor, ids: torch.Tensor, budgets: list[int]) -> list[DraftTree]:
    nodes = best_first_trees(values.to(DEVICE), ids.to(DEVICE), torch.tensor(budgets, device=DEVICE))
    return trees_from_nodes(*(t.cpu() for t in nodes))


@pytest.mark.parametrize("seed", range(8 if not GPU else 200))
def test_kernel_trees_equal_the_host_heaps(seed: int) -> None:
    """Random batches: mixed budgets (0, beyond K, beyond what K^D holds), one-token rows, one depth, ties."""
    choose = random.Random(seed)
    sessions, depths, vocab = choose.randint(1, 4), choose.randint(1, 6), choose.randint(1, 20)
    width = choose.randint(1, vocab)
    budgets = [choose.choice([0, 1, 2, 3, 5, 8, 15, 40]) for _ in range(sessions)]
    values, ids = ranked_rows(sessions, depths, vocab, width, seed, halves=seed % 2 == 0)
    assert kernel_trees(values, ids, budgets) == trees_from_top_k(values, ids, budgets)


def test_a_flat_row_exhausts_a_chain_and_an_empty_batch_is_empty() -> None:
    values, ids = ranked_rows(2, 3, 1, 1, seed=0, halves=False)  # one token a depth: a chain of 3 at most
    trees = kernel_trees(values, ids, [5, 2])
    assert [len(tree) for tree in trees] == [3, 2] and trees == trees_from_top_k(values, ids, [5, 2])
    assert kernel_trees(values[:0], ids[:0], []) == []
    assert kernel_trees(values, ids, [0, 0]) == [DraftTree.empty()] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("budget", [15, 63])
@pytest.mark.parametrize("sessions", [4, 64])
def test_serving_batches_on_the_gpu_equal_the_host_heaps(budget: int, sessions: int) -> None:
    """draft_trees as the drafter calls it (a small batch's trees on the host, a large one's on the GPU): 15
    depths, K = 63, the rows left on the device."""
    values, ids = ranked_rows(sessions, 15, 500, 63, seed=budget, halves=True)
    budgets = [budget - s % 5 for s in range(sessions)]
    assert draft_trees(values.cuda(), ids.cuda(), budgets) == trees_from_top_k(values, ids, budgets)
