"""What a verifier tells a drafter, step by step: one DraftStep type from the proto boundary to the model.

The verifier's generation loop (verifier_service/service.py) and the reference loop (ddtree/offline.py)
both walk a session with a StepCursor and seed its drafter with `drafter_seed`, so the offline loop is the
service's loop without gRPC, not a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class DraftStep:
    """One session's draft request for one verify step."""

    session_id: str
    step: int  # increases per session; a reply for an older step is stale
    committed: list[int]  # tokens committed since the previous step (old root + accepted path)
    features: torch.Tensor | None  # [len(committed), F] their target features (None for n-gram)
    root: int  # the pending token the tree hangs under: sampled by the target, not yet in its KV
    position: int  # position of committed[0] (of the root when nothing was committed)
    budget: int  # nodes wanted

    def after_seed(self) -> DraftStep:
        """The same step for a mirror seeded just now: the seed already holds the committed tokens."""
        return replace(self, committed=[], features=None, position=self.position + len(self.committed))


@dataclass
class StepCursor:
    """Where a session's drafting stands between verify steps: what the next DraftStep must carry."""

    session_id: str
    position: int  # KV length when generation starts; then the position of `committed[0]`
    step: int = 0
    committed: list[int] = field(default_factory=list)
    # NOTE: the target features of `committed`, by step: joined when read. Joined at every step that skipped the
    # drafter, a session at budget 0 copied all its features since its last draft at each step (quadratic: 40 KB a
    # token for a Qwen3-8B-shaped DFlash drafter)
    feature_chunks: list[torch.Tensor] = field(default_factory=list)

    @property
    def features(self) -> torch.Tensor | None:
        """[len(committed), F], or None without features (an n-gram drafter's session)."""
        if len(self.feature_chunks) > 1:
            dtype = self.feature_chunks[0].dtype
            self.feature_chunks = [torch.cat([chunk.to(dtype) for chunk in self.feature_chunks])]
        return self.feature_chunks[0] if self.feature_chunks else None

    def draft_step(self, root: int, budget: int) -> DraftStep:
        return DraftStep(self.session_id, self.step, self.committed, self.features, root, self.position, budget)

    def advance(self, committed: list[int], features: torch.Tensor | None, commit_start: int,
                drafted: bool = True) -> None:
        """A verify step committed `committed` (root + accepted path) at `commit_start`. `drafted`: the step's
        draft request carried what the cursor held; a step that skipped the drafter (budget 0) adds its tokens
        to those, so the next draft brings the drafter's mirror up to date instead of re-seeding it."""
        self.step += 1
        if drafted or not self.committed:
            self.committed, self.position = committed, commit_start
            self.feature_chunks = [] if features is None else [features]
            return
        self.committed = self.committed + committed
        if features is not None:
            self.feature_chunks.append(features)


class DrafterSeed(NamedTuple):
    """What opens a session's mirror: committed tokens from `start_position`, features of the last ones."""

    tokens: list[int]
    features: torch.Tensor | None
    start_position: int


def feature_tail(uses_features: bool, window: int | None, max_context: int) -> int:
    """How many of the latest tokens' target features a drafter needs: its window W, or all (W = None)."""
    return (window or max_context) if uses_features else 0


def drafter_seed(committed: list[int], features: torch.Tensor | None, uses_features: bool,
                 window: int | None) -> DrafterSeed:
    """The seed of a session with these committed tokens: a drafter that reads features sees only the last W
    tokens, so only those travel; a token-only drafter (n-gram) gets the whole history."""
    if not uses_features:
        return DrafterSeed(committed, None, 0)
    tokens = committed[-window:] if window else committed
    if features is not None and window:
        features = features[-window:]
    return DrafterSeed(tokens, features, len(committed) - len(tokens))
