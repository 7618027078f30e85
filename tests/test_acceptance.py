"""accept_path on hand-built trees: which nodes are accepted, and the next root (the target's token after them).

`target_tokens[0]` is the target's token at the root, `target_tokens[i + 1]` at node i. The targets may be
argmax tokens or sampled draws: acceptance only compares tokens, so the same contract holds for both.
"""

from __future__ import annotations

import random

from modeling.tree import DraftTree
from verifier_service.engine.acceptance import accept_path


def tree(*nodes: tuple[int, int]) -> DraftTree:
    """Nodes as (token, parent) in topological order."""
    depths: list[int] = []
    for _, parent in nodes:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return DraftTree(tuple(t for t, _ in nodes), tuple(p for _, p in nodes), tuple(depths))


def test_an_empty_tree_emits_the_target_token_at_the_root():
    assert accept_path(DraftTree.empty(), [7]) == ([], 7)


def test_a_chain_the_target_agrees_with_is_accepted_whole():
    draft = DraftTree.chain([5, 6, 7])
    assert accept_path(draft, [5, 6, 7, 9]) == ([0, 1, 2], 9)


def test_a_deep_chain_is_accepted_whole():
    tokens = [(3 * i) % 29 for i in range(64)]
    path, next_root = accept_path(DraftTree.chain(tokens), [*tokens, 1])
    assert path == list(range(64))
    assert next_root == 1


def test_a_chain_stops_at_the_first_disagreement():
    draft = DraftTree.chain([5, 6, 7])
    assert accept_path(draft, [5, 6, 8, 7]) == ([0, 1], 8)  # node 1's target is 8, not 7


def test_no_child_of_the_root_matches():
    draft = tree((3, -1), (4, -1), (5, 0))
    assert accept_path(draft, [9, 5, 5, 5]) == ([], 9)


def test_a_matching_token_deeper_down_does_not_count_without_its_parent():
    draft = tree((3, -1), (5, 0))
    assert accept_path(draft, [5, 8, 8]) == ([], 5)


def test_the_path_follows_the_branch_the_target_picks():
    #        root
    #       /    \
    #   0:3      1:4
    #    |        |
    #   3:8      2:7
    draft = tree((3, -1), (4, -1), (7, 1), (8, 0))
    # the target picks 4 at the root, 7 at node 1, and 11 at node 2
    assert accept_path(draft, [4, 8, 7, 11, 0]) == ([1, 2], 11)
    # and 3 at the root, 8 at node 0, 2 at node 3
    assert accept_path(draft, [3, 8, 7, 11, 2]) == ([0, 3], 2)


def test_the_first_of_two_siblings_with_one_token_wins():
    # nodes 0 and 1 both carry token 3 under the root; only node 1 has a child (5)
    draft = tree((3, -1), (3, -1), (5, 1))
    # node 0 wins, and it has no child: node 1's subtree is never reached
    assert accept_path(draft, [3, 5, 5, 9]) == ([0], 5)


def test_the_next_root_is_the_target_token_at_the_last_accepted_node():
    draft = tree((3, -1), (4, 0), (6, 0))
    path, next_root = accept_path(draft, [3, 6, 1, 2])  # at node 0 the target picks 6 (node 2)
    assert path == [0, 2]
    assert next_root == 2  # node 2's target


def test_every_emitted_token_is_the_target_choice_on_random_trees():
    """The exactness contract: each accepted token is the target's token at its parent, the path runs
    root-down, and it stops only where no child carries the target's token."""
    rng = random.Random(0)
    for _ in range(500):
        nodes: list[tuple[int, int]] = []
        for i in range(rng.randrange(0, 20)):
            nodes.append((rng.randrange(4), rng.randrange(-1, i)))
        draft = tree(*nodes)
        targets = [rng.randrange(4) for _ in range(len(nodes) + 1)]
        path, next_root = accept_path(draft, targets)

        parent = -1
        for node in path:
            assert draft.parents[node] == parent
            assert draft.tokens[node] == targets[parent + 1]
            matches = [i for i, p in enumerate(draft.parents) if p == parent and draft.tokens[i] == draft.tokens[node]]
            assert node == matches[0]  # the first of equal siblings
            parent = node
        assert next_root == targets[parent + 1]
        children = [i for i, p in enumerate(draft.parents) if p == parent]
        assert all(draft.tokens[i] != next_root for i in children)
