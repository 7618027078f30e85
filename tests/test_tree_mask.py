"""The GPU tree-row kernel against the host-side batch builder (positions and ancestor words)."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_kernels.tree_mask import tree_positions_and_mask
from tests.engine_helpers import random_tree
from verifier_service.engine.verify_batch import BlockSpec, build_verify_batch

SHAPES = ("chain", "wide", "random")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed_parents(blocks: list[BlockSpec]) -> list[int]:
    parents, start = [], 0
    for block in blocks:
        parents += [p + start if p >= 0 else -1 for p in block.parent_rows]
        start += len(block.tokens)
    return parents


@pytest.mark.parametrize("sizes", [[1], [5, 0, 40], [70, 1, 33], [200]])
def test_kernel_matches_the_host_builder(sizes: list[int]) -> None:
    rng = random.Random(sum(sizes))
    blocks = [BlockSpec.from_tree(rng.randrange(5000), 3, random_tree(rng, n, 50, [], rng.choice(SHAPES)), [])
              for n in sizes]
    expected = build_verify_batch(blocks, DEVICE)
    n, words = expected.tree_mask.shape
    padding = 9  # rows past the last block, as in a captured batch's bucket
    parents = torch.tensor(packed_parents(blocks) + [-1] * padding, dtype=torch.int32, device=DEVICE)
    positions = torch.full((n + padding,), -5, dtype=torch.int64, device=DEVICE)
    mask = torch.full((n + padding, words), -5, dtype=torch.int32, device=DEVICE)
    tree_positions_and_mask(parents, expected.cu_tree, expected.prefix_lens, positions, mask)
    assert positions[:n].tolist() == expected.positions.tolist()
    assert mask[:n].tolist() == expected.tree_mask.tolist()
    assert positions[n:].tolist() == [0] * padding and not mask[n:].any()


def test_empty_padding_sessions_are_skipped() -> None:
    """Sessions with no rows (a bucket's padding) between real ones leave the real rows unchanged."""
    blocks = [BlockSpec.chain(10, [1, 2, 3], []), BlockSpec.chain(20, [4, 5], [])]
    parents = torch.tensor(packed_parents(blocks), dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 3, 3, 5, 5], dtype=torch.int32, device=DEVICE)
    prefix_lens = torch.tensor([10, 0, 20, 0], dtype=torch.int32, device=DEVICE)
    positions = torch.empty(5, dtype=torch.int64, device=DEVICE)
    mask = torch.empty(5, 1, dtype=torch.int32, device=DEVICE)
    tree_positions_and_mask(parents, cu, prefix_lens, positions, mask)
    assert positions.tolist() == [10, 11, 12, 20, 21]
    assert mask.flatten().tolist() == [1, 3, 7, 1, 3]
