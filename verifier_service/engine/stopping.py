"""Stop conditions: max_new_tokens, stop token ids, stop strings. Nothing past a stop is emitted."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from verifier_service.engine.sampling import SamplingParams


class StopReason(str, Enum):
    LENGTH = "length"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    CONTEXT_LIMIT = "context_limit"  # the session filled the model's context


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...],
                 decode: Callable[[list[int]], str] | None):
        if params.stop_strings and decode is None:
            raise ValueError("stop_strings need a tokenizer")
        self.max_new_tokens = params.max_new_tokens
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.stop_strings = params.stop_strings
        self.decode = decode
        self.generated: list[int] = []

    def feed(self, tokens: list[int]) -> tuple[list[int], StopReason | None]:
        """Accept candidate tokens in order; return those to emit and the reason if generation ends."""
        for i, token in enumerate(tokens):
            self.generated.append(token)
            reason = self._reason(token)
            if reason is not None:
                return tokens[: i + 1], reason
        return tokens, None

    def _reason(self, token: int) -> StopReason | None:
        if token in self.stop_ids:
            return StopReason.STOP_TOKEN
        if self.stop_strings and self._hit_stop_string():
            return StopReason.STOP_STRING
        if len(self.generated) >= self.max_new_tokens:
            return StopReason.LENGTH
        return None

    def _hit_stop_string(self) -> bool:
        # NOTE: only the tail can hold a newly completed stop string; a character spans at most 4 byte
        # tokens, so a bounded window of recent tokens suffices.
        window = 4 * max(len(s) for s in self.stop_strings) + 4
        tail = self.decode(self.generated[-window:])
        return any(s in tail for s in self.stop_strings)
