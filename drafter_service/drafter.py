"""What the drafter service hosts: per-session mirrors that turn committed tokens into draft trees.

Two implementations share this interface: the DFlash drafter (features in, DDTree out) and the n-gram
drafter (tokens in, trie out). The gRPC layer and `ddtree offline` talk to either through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from modeling.speculation import DrafterSeed, DraftStep
from modeling.tree import DraftTree


@dataclass(frozen=True)
class DrafterInfo:
    kind: str  # "dflash" | "ngram"
    block_size: int  # trees are at most block_size - 1 deep
    context_window: int | None  # W: recent committed tokens the drafter attends to (None = all)
    target_layer_ids: tuple[int, ...]  # the target layers a feature concatenates (empty for n-gram)
    feature_dim: int
    max_budget: int
    dtype: str = ""  # the model's ("" without one)
    device: str = "cpu"
    max_sessions: int = 0  # mirrors open at once (0: no limit)


class Drafter(Protocol):
    info: DrafterInfo
    captured_graphs: int  # CUDA graphs captured so far; 0 while drafts run eagerly

    def open(self, session_id: str, seed: DrafterSeed) -> None:
        """Start or replace a mirror: seed.tokens are committed, tokens[i] at seed.start_position + i;
        seed.features belong to the last rows of seed.tokens."""
        ...

    def draft(self, steps: list[DraftStep]) -> list[DraftTree]:
        """Apply each step's committed tokens and draft every session in one batch. Raises on an invalid
        step (unknown session, stale step, malformed features) without changing any mirror."""
        ...

    def close(self, session_id: str) -> None:
        ...

