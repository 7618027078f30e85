"""The n-gram drafter behind the Drafter interface: tokens in, prompt-lookup trie out (CPU)."""

from __future__ import annotations

import torch

from drafter_service.drafter import DrafterInfo, StepRequest, UnknownSession
from drafter_service.ngram_index import NgramIndex
from modeling.tree import DraftTree

MAX_DEPTH = 16  # deepest draft; the verifier's tree budget bounds the width


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4, max_budget: int = 255, max_depth: int = MAX_DEPTH):
        self.ngram = NgramIndex(min_n, max_n)
        self.max_depth = max_depth
        self.info = DrafterInfo("ngram", max_depth + 1, None, (), 0, max_budget)

    def open(self, session_id: str, tokens: list[int], features: torch.Tensor | None, start_position: int) -> None:
        # NOTE: the history is positional; a seed that starts late only shortens what can be matched.
        self.ngram.open(session_id, list(tokens))

    def _advance(self, request: StepRequest) -> None:
        """Bring the history to committed tokens + pending root: it ends with the previous root, which is
        normally committed[0] at `position`; anything else (a rollback) rebuilds it."""
        history = self.ngram.history(request.session_id)
        position, committed = request.position, request.committed
        if not committed and len(history) == position:
            self.ngram.extend(request.session_id, [request.bonus])
        elif committed and len(history) == position + 1 and history[-1] == committed[0]:
            self.ngram.extend(request.session_id, committed[1:] + [request.bonus])
        else:
            self.ngram.open(request.session_id, history[:position] + committed + [request.bonus])

    def draft(self, requests: list[StepRequest]) -> list[DraftTree]:
        for request in requests:
            if request.session_id not in self.ngram:
                raise UnknownSession(f"session {request.session_id!r} is not open on this drafter")
            if request.position > len(self.ngram.history(request.session_id)):
                raise ValueError(f"step.position {request.position} is past the session's history")
        for request in requests:
            self._advance(request)
        return [self.ngram.draft(r.session_id, min(r.budget, self.info.max_budget), self.max_depth) for r in requests]

    def close(self, session_id: str) -> None:
        self.ngram.close(session_id)
