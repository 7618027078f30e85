"""The text of a generation, cut before its first stop string."""

from __future__ import annotations

from collections.abc import Sequence

from modeling.tokenizer import TextStream, Tokenizer


class OutputText:
    """Text deltas for each step's tokens that never contain a stop string or anything after it.

    The verifier stops on the token that completes a stop string, but earlier steps may already
    hold its start: so a tail that could begin a stop string is held back until later text shows
    that it does not (or the generation ends).
    """

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str]):
        self._stream = TextStream(tokenizer)
        self._stops = [s for s in stop_strings if s]
        self._held = ""
        self._stopped = False

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The next delta; `final` releases the held-back tail."""
        if self._stopped:
            return ""
        text = self._held + self._stream.push(list(token_ids), final)
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._stopped, self._held = True, ""
            return text[: min(hits)]
        keep = 0 if final else self._stop_prefix_length(text)
        self._held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        return max((k for s in self._stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
