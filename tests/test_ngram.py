"""n-gram drafter: continuation chains, branching, no match, limits, incremental index."""

from __future__ import annotations

import math
import random

import pytest

from drafter_service.ngram_index import NgramIndex, _continuation, _trie_tree
from modeling.tree import DraftTree


def _drafter(tokens: list[int], **kwargs: int) -> NgramIndex:
    drafter = NgramIndex(**kwargs)
    drafter.open("s", tokens)
    return drafter


def test_repetitive_history_drafts_the_obvious_chain() -> None:
    tree = _drafter([1, 2, 3, 4, 5, 1, 2, 3]).draft("s", budget=8, max_depth=3)
    tree.validate(10, 8)
    assert tree.tokens == (4, 5, 1)
    assert (tree.parents, tree.depths) == (DraftTree.chain([4, 5, 1]).parents, (1, 2, 3))


def test_a_periodic_tail_wraps_into_a_full_chain() -> None:
    tree = _drafter([7, 9, 9, 9, 9]).draft("s", budget=10, max_depth=5)
    assert tree.tokens == (9, 9, 9, 9, 9)
    assert tree.parents == (-1, 0, 1, 2, 3)


def test_different_continuations_branch_by_frequency() -> None:
    # "5 6" was followed by 1 twice and by 2 once: the 1-branch ranks first, then the 2-branch
    history = [5, 6, 1, 3, 0, 5, 6, 2, 4, 0, 5, 6, 1, 3, 0, 5, 6]
    tree = _drafter(history, min_n=2, max_n=2).draft("s", budget=4, max_depth=2)
    tree.validate(10, 4)
    paths = [tuple(tree.tokens[i] for i in tree.path_to(n)) for n in range(len(tree))]
    assert paths == [(1,), (1, 3), (2,), (2, 4)]
    assert tree.logprobs[0] == pytest.approx(tree.logprobs[1])
    assert tree.logprobs[0] > tree.logprobs[2]


def test_longest_suffix_match_wins() -> None:
    # the 1-gram "3" was followed by 8 and 9, but the 2-gram "2 3" only by 9
    tree = _drafter([3, 8, 2, 3, 9, 0, 2, 3], min_n=1, max_n=3).draft("s", budget=5, max_depth=1)
    assert tree.tokens == (9,)


def test_no_match_gives_an_empty_tree() -> None:
    drafter = _drafter([1, 2, 3, 4], min_n=2)
    assert len(drafter.draft("s", budget=10, max_depth=4)) == 0
    drafter.open("t", [5])
    assert len(drafter.draft("t", budget=10, max_depth=4)) == 0


@pytest.mark.parametrize("budget,max_depth", [(1, 1), (3, 8), (16, 2), (64, 16)])
def test_budget_and_depth_limits(budget: int, max_depth: int) -> None:
    rng = random.Random(0)
    history = [rng.randrange(4) for _ in range(500)]
    tree = _drafter(history).draft("s", budget=budget, max_depth=max_depth)
    tree.validate(4, budget)
    assert 0 < len(tree) <= budget
    assert tree.max_depth() <= max_depth


def test_incremental_extend_equals_a_fresh_open() -> None:
    rng = random.Random(1)
    history = [rng.randrange(6) for _ in range(300)]
    incremental = _drafter(history[:10], min_n=1, max_n=5, max_matches=8)
    fresh = NgramIndex(min_n=1, max_n=5, max_matches=8)
    end = 10
    while end < len(history):
        step = rng.randrange(1, 6)
        incremental.extend("s", history[end:end + step])
        end = min(end + step, len(history))
        fresh.open("s", history[:end])
        assert incremental.draft("s", 20, 6) == fresh.draft("s", 20, 6)


def test_close_forgets_the_session() -> None:
    drafter = _drafter([1, 2, 1, 2])
    drafter.close("s")
    assert "s" not in drafter
    with pytest.raises(KeyError):
        drafter.draft("s", 4, 4)


def test_equal_counts_prefer_shallow_then_recent() -> None:
    # "4" was followed by 1 2 and (more recently) by 3 5: every trie node has count 1
    tree = _drafter([4, 1, 2, 0, 4, 3, 5, 0, 4], min_n=1, max_n=1).draft("s", budget=3, max_depth=2)
    paths = [tuple(tree.tokens[i] for i in tree.path_to(n)) for n in range(len(tree))]
    assert paths == [(3,), (1,), (3, 5)]


def _reference_starts(tokens: list[int], min_n: int, max_n: int, max_matches: int) -> list[int]:
    """Where the continuations of the longest earlier-seen suffix n-gram start, by brute force."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        ends = [p for p in range(n, len(tokens)) if tokens[p - n:p] == suffix]
        if ends:
            return ends[-max_matches:][::-1]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 4), (1, 1), (2, 3), (3, 5)])
def test_the_suffix_lookup_matches_a_brute_force_search(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(200):
        vocab = rng.choice([2, 3, 8, 100])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(min_n=min_n, max_n=max_n, max_matches=5)
        index.open("s", tokens)
        assert index._match_starts(index._sessions["s"]) == _reference_starts(tokens, min_n, max_n, 5), tokens


def _reference_trie(continuations: list[list[int]], budget: int) -> DraftTree:
    """The whole trie, every node sorted by (-count, depth, creation order), the first `budget` kept."""
    children: list[dict[int, int]] = [{}]  # node 0 = the root
    token_of, parent_of, depth_of, count = [-1], [-1], [0], [len(continuations)]
    for continuation in continuations:
        node = 0
        for token in continuation:
            if token not in children[node]:
                children[node][token] = len(token_of)
                children.append({})
                token_of.append(token)
                parent_of.append(node)
                depth_of.append(depth_of[node] + 1)
                count.append(0)
            node = children[node][token]
            count[node] += 1
    kept = sorted(range(1, len(token_of)), key=lambda i: (-count[i], depth_of[i], i))[:budget]
    position = {0: -1} | {node: i for i, node in enumerate(kept)}
    return DraftTree(tuple(token_of[i] for i in kept), tuple(position[parent_of[i]] for i in kept),
                     tuple(depth_of[i] for i in kept), tuple(math.log(count[i] / count[0]) for i in kept))


def test_the_best_first_trie_equals_sorting_the_whole_trie() -> None:
    rng = random.Random(7)
    for _ in range(500):
        vocab, length = rng.choice([1, 2, 3, 5, 50]), rng.randrange(1, 9)
        distinct = [[rng.randrange(vocab) for _ in range(length)] for _ in range(rng.randrange(1, 6))]
        continuations = [list(rng.choice(distinct)) for _ in range(rng.randrange(0, 40))]
        budget = rng.randrange(1, 50)
        assert _trie_tree(continuations, budget) == _reference_trie(continuations, budget), (continuations, budget)


@pytest.mark.parametrize("vocab", [2, 4, 16])
def test_drafts_equal_the_whole_trie_of_full_depth_continuations(vocab: int) -> None:
    """Continuations cut at the budget's depth change nothing: no deeper node is ever kept."""
    rng = random.Random(vocab)
    index = _drafter([rng.randrange(vocab) for _ in range(400)], max_matches=32)
    for _ in range(100):
        index.extend("s", [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))])
        budget, max_depth = rng.randrange(1, 40), rng.randrange(1, 17)
        tokens = index.history("s")
        full = [_continuation(tokens, p, max_depth) for p in index._match_starts(index._sessions["s"])]
        assert index.draft("s", budget, max_depth) == _reference_trie(full, budget)
