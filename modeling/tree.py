"""The draft tree that travels from a drafter to the verifier.

Nodes hang under a root (the session's pending token, not part of the tree) and are listed in
topological order: a node's parent is -1 (the root) or an earlier node.
"""

from __future__ import annotations

from dataclasses import dataclass


class TreeError(ValueError):
    """A draft tree that breaks the contract; the message names the offending field."""


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # -1 = root, else index of an earlier node
    depths: tuple[int, ...]  # children of the root have depth 1
    logprobs: tuple[float, ...] = ()  # drafter's path log-probability per node (informational)

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree((), (), ())

    @staticmethod
    def chain(tokens: list[int] | tuple[int, ...]) -> DraftTree:
        """A linear draft: every node is the child of the previous one."""
        n = len(tokens)
        return DraftTree(tuple(tokens), tuple(range(-1, n - 1)), tuple(range(1, n + 1)))

    def validate(self, vocab_size: int, max_nodes: int) -> None:
        """Raise TreeError unless this is a well-formed tree the verifier can run."""
        n = len(self.tokens)
        if len(self.parents) != n or len(self.depths) != n:
            raise TreeError(f"tree.parents ({len(self.parents)}) and tree.depths ({len(self.depths)}) "
                            f"must have one entry per token ({n})")
        if self.logprobs and len(self.logprobs) != n:
            raise TreeError(f"tree.logprobs has {len(self.logprobs)} entries for {n} tokens")
        if n > max_nodes:
            raise TreeError(f"tree has {n} nodes, more than the maximum {max_nodes}")
        for i, (tok, parent, depth) in enumerate(zip(self.tokens, self.parents, self.depths)):
            if not 0 <= tok < vocab_size:
                raise TreeError(f"tree.tokens[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
            if not -1 <= parent < i:
                raise TreeError(f"tree.parents[{i}] = {parent} must be -1 or an earlier node index")
            expected = 1 if parent < 0 else self.depths[parent] + 1
            if depth != expected:
                raise TreeError(f"tree.depths[{i}] = {depth} is inconsistent with its parent (expected {expected})")

    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def kept(self, max_depth: int) -> list[int]:
        """The indices of the nodes at depth <= max_depth: node i of `truncated(max_depth)` is node kept[i] here."""
        return [i for i, d in enumerate(self.depths) if d <= max_depth]

    def truncated(self, max_depth: int) -> DraftTree:
        """The subtree of nodes at depth <= max_depth (parents re-indexed)."""
        if self.max_depth() <= max_depth:
            return self
        keep = self.kept(max_depth)
        new_index = {old: new for new, old in enumerate(keep)}
        new_index[-1] = -1
        return DraftTree(tuple(self.tokens[i] for i in keep), tuple(new_index[self.parents[i]] for i in keep),
                         tuple(self.depths[i] for i in keep),
                         tuple(self.logprobs[i] for i in keep) if self.logprobs else ())

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root, node = -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
