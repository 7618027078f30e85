"""Walking the draft tree with the target's choices (docs/design.md section 5)."""

from __future__ import annotations

from modeling.tree import DraftTree


def accept_path(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """target_tokens[0] is the target's token at the root, target_tokens[i + 1] at node i.

    From the root, move to the child whose token equals the target's token at the current node, while
    one exists. Returns the accepted node indices (root excluded) and the next root: the target's token
    at the last accepted node. Each emitted token is the target's own choice, hence exact.
    """
    children: dict[tuple[int, int], int] = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault((parent, token), node)  # first sibling wins on duplicate tokens
    path: list[int] = []
    node = -1
    while (child := children.get((node, target_tokens[node + 1]))) is not None:
        path.append(child)
        node = child
    return path, target_tokens[node + 1]
