"""What the drafter service hosts: per-session mirrors that turn committed tokens into draft trees.

Two implementations share this interface: the DFlash drafter (features in, DDTree out) and the n-gram
drafter (tokens in, trie out). The gRPC layer and `ddtree offline` talk to either through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from modeling.tree import DraftTree


@dataclass(frozen=True)
class StepRequest:
    session_id: str
    step: int
    committed: list[int]  # tokens committed since the previous step (old root + accepted path)
    features: torch.Tensor | None  # [len(committed), F] their target features (None for n-gram)
    bonus: int  # the pending root the tree hangs under
    position: int  # position of committed[0] (of the bonus when nothing was committed)
    budget: int  # nodes wanted


@dataclass(frozen=True)
class DrafterInfo:
    kind: str  # "dflash" | "ngram"
    block_size: int  # trees are at most block_size - 1 deep
    context_window: int | None  # W: recent committed tokens the drafter attends to (None = all)
    target_layer_ids: tuple[int, ...]  # the target layers a feature concatenates (empty for n-gram)
    feature_dim: int
    max_budget: int


class Drafter(Protocol):
    info: DrafterInfo

    def open(self, session_id: str, tokens: list[int], features: torch.Tensor | None, start_position: int) -> None:
        """Start or replace a mirror: `tokens` are committed, tokens[i] at start_position + i; `features`
        belong to the last rows of `tokens`."""
        ...

    def draft(self, requests: list[StepRequest]) -> list[DraftTree]:
        """Apply each request's committed tokens and draft every session in one batch. Raises on an
        invalid request (unknown session, stale step, malformed features) without changing any mirror."""
        ...

    def close(self, session_id: str) -> None:
        ...


class UnknownSession(KeyError):
    """The session is not open on this replica: the verifier must re-seed it (NOT_FOUND)."""
