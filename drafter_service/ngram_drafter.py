"""The n-gram drafter behind the Drafter interface: tokens in, prompt-lookup trie out (CPU)."""

from __future__ import annotations

from drafter_service.drafter import DrafterInfo
from drafter_service.errors import SessionNotFound
from drafter_service.ngram_index import NgramIndex
from modeling.speculation import DrafterSeed, DraftStep
from modeling.tree import DraftTree

MAX_DEPTH = 16  # deepest draft; the verifier's tree budget bounds the width


class NgramDrafter:
    captured_graphs = 0

    def __init__(self, min_n: int = 1, max_n: int = 4, max_budget: int = 255, max_depth: int = MAX_DEPTH):
        self.ngram = NgramIndex(min_n, max_n)
        self.max_depth = max_depth
        self.info = DrafterInfo("ngram", max_depth + 1, None, (), 0, max_budget)

    def open(self, session_id: str, seed: DrafterSeed) -> None:
        # NOTE: the history is positional; a seed that starts late only shortens what can be matched.
        self.ngram.open(session_id, list(seed.tokens))

    def _advance(self, step: DraftStep) -> None:
        """Bring the history to committed tokens + pending root: it ends with the previous root, which is
        normally committed[0] at `position`; anything else (a rollback) rebuilds it."""
        history = self.ngram.history(step.session_id)
        position, committed = step.position, step.committed
        if not committed and len(history) == position:
            self.ngram.extend(step.session_id, [step.root])
        elif committed and len(history) == position + 1 and history[-1] == committed[0]:
            self.ngram.extend(step.session_id, committed[1:] + [step.root])
        else:
            self.ngram.open(step.session_id, history[:position] + committed + [step.root])

    def draft(self, steps: list[DraftStep]) -> list[DraftTree]:
        for step in steps:
            if step.session_id not in self.ngram:
                raise SessionNotFound(f"session {step.session_id!r} is not open on this drafter")
            if step.position > len(self.ngram.history(step.session_id)):
                raise ValueError(f"step.position {step.position} is past the session's history")
        for step in steps:
            self._advance(step)
        return [self.ngram.draft(s.session_id, min(s.budget, self.info.max_budget), self.max_depth) for s in steps]

    def close(self, session_id: str) -> None:
        self.ngram.close(session_id)
