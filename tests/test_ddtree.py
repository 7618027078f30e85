"""DDTree builder: size, validity, optimality against brute force, ties, chain reduction, top-k from logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from drafter_service.tree_builder import build_ddtree, top_k_log_probs, top_k_per_depth, trees_from_top_k
from modeling.tree import DraftTree


def _all_prefixes(values: list[list[float]]) -> dict[tuple[int, ...], float]:
    """Every token path of every depth with its path log-prob, summed root-down like the builder."""
    num_depths, vocab = len(values), len(values[0])
    scores: dict[tuple[int, ...], float] = {}
    for depth in range(1, num_depths + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            parent = scores.get(path[:-1], 0.0)
            scores[path] = parent + values[depth - 1][path[-1]]
    return scores


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.tokens[i] for i in tree.path_to(node)) for node in range(len(tree))]


def _random_logp(num_depths: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(num_depths, vocab, generator=gen, dtype=torch.float64), -1)


@pytest.mark.parametrize("num_depths,vocab,budget", [(1, 5, 3), (3, 3, 7), (4, 3, 20), (3, 4, 84), (2, 2, 9)])
def test_matches_brute_force(num_depths: int, vocab: int, budget: int) -> None:
    for seed in range(5):
        logp = _random_logp(num_depths, vocab, seed)  # [D, V]
        tree = build_ddtree(logp, budget)
        tree.validate(vocab, budget)
        scores = _all_prefixes(logp.tolist())
        assert len(tree) == min(budget, len(scores))
        best = sorted(scores.values(), reverse=True)[: len(tree)]
        paths = _paths(tree)
        assert len(set(paths)) == len(paths)
        # random float64 scores have no ties, so the best set is unique
        assert set(paths) == {p for p, s in scores.items() if s >= best[-1]}
        assert list(tree.logprobs) == pytest.approx([scores[p] for p in paths], abs=0)


def test_size_is_budget_when_the_tree_space_is_large() -> None:
    logp = _random_logp(15, 1000, seed=1)
    for budget in (1, 15, 63, 256):
        tree = build_ddtree(logp, budget)
        tree.validate(1000, budget)
        assert len(tree) == budget
        assert max(tree.depths) <= 15


def test_ties_are_deterministic_and_follow_the_rule() -> None:
    # uniform rows: every prefix of a depth ties; rule = shallower first, earlier parent, lower token id
    logp = torch.full((3, 3), -float(torch.log(torch.tensor(3.0))))  # [D, V]
    tree = build_ddtree(logp, 8)
    assert tree == build_ddtree(logp.clone(), 8)
    assert tree.tokens == (0, 1, 2, 0, 1, 2, 0, 1)
    assert tree.parents == (-1, -1, -1, 0, 0, 0, 1, 1)
    assert tree.depths == (1, 1, 1, 2, 2, 2, 2, 2)


@pytest.mark.parametrize("seed", range(4))
def test_ties_still_give_a_most_probable_set(seed: int) -> None:
    # coarse quantized log-probs produce many ties; any tie resolution must keep the best scores
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.randint(0, 3, (3, 4), generator=gen).double()  # [D, V], values in {0, -1, -2}
    budget = 20
    tree = build_ddtree(logp, budget)
    tree.validate(4, budget)
    scores = _all_prefixes(logp.tolist())
    assert sorted(tree.logprobs, reverse=True) == sorted(scores.values(), reverse=True)[:budget]
    assert tree == build_ddtree(logp.clone(), budget)


def test_tied_tokens_rank_by_token_id() -> None:
    logp = torch.log(torch.tensor([[0.1, 0.3, 0.3, 0.3]]))  # [1, V]
    assert build_ddtree(logp, 3).tokens == (1, 2, 3)


def test_chain_reduction_with_top1() -> None:
    logp = _random_logp(15, 50, seed=3)  # [B-1, V], B = 16
    tree = build_ddtree(logp, 15, top_k=1)
    assert tree.tokens == tuple(logp.argmax(-1).tolist())
    assert tree.parents == DraftTree.chain(list(tree.tokens)).parents
    assert tree.depths == tuple(range(1, 16))


def test_empty_inputs() -> None:
    assert len(build_ddtree(_random_logp(3, 4, 0), 0)) == 0
    assert len(build_ddtree(torch.zeros(0, 4), 5)) == 0


def test_top_k_from_logits_equals_top_k_of_log_softmax() -> None:
    logits = 4 * torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0))  # [S, D, V]
    values, ids = top_k_log_probs(logits, 12)
    expected_values, expected_ids = top_k_per_depth(torch.log_softmax(logits, -1), 12)
    assert ids.tolist() == expected_ids
    torch.testing.assert_close(values, torch.tensor(expected_values, dtype=torch.float32), atol=1e-5, rtol=0)
    assert top_k_log_probs(logits, 80)[0].shape == (3, 7, 50)  # K = min(k, V)


def test_top_k_from_logits_ranks_ties_by_token_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]]).bfloat16()  # [D, V]
    values, ids = top_k_log_probs(logits, 5)
    assert ids.tolist() == [[1, 3, 5, 2, 4]]
    assert values.dtype == torch.float32
    torch.testing.assert_close(values, torch.log_softmax(logits.float(), -1)[:, [1, 3, 5, 2, 4]])


def test_trees_from_top_k_equal_build_ddtree_per_budget() -> None:
    logp = torch.log_softmax(torch.randn(4, 7, 30, generator=torch.Generator().manual_seed(0)), -1)  # [S, D, V]
    values, ids = (torch.tensor(rows) for rows in top_k_per_depth(logp, 40))  # [S, D, 30]
    budgets = [40, 1, 17, 0]
    trees = trees_from_top_k(values, ids, budgets)
    assert trees == [build_ddtree(logp[s], b) for s, b in enumerate(budgets)]


def test_float32_and_bfloat16_inputs() -> None:
    logp = _random_logp(5, 64, seed=2)
    for dtype in (torch.float32, torch.bfloat16):
        tree = build_ddtree(logp.to(dtype), 30)
        tree.validate(64, 30)
        assert len(tree) == 30
