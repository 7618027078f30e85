"""OpenAI's `logprobs` objects from a generation's TokenLogprob (proto/common.proto), each token spelled on its own.

NOTE (stop strings): the logprobs cover every generated token, as `usage.completion_tokens` counts them and as vLLM
reports them: also the token that completed a stop string (and an EOS that ended the reply), though the text stops
before it. So the tokens' strings joined may run past the reply's text, never short of it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

from modeling.tokenizer import Tokenizer
from proto import common_pb2


class TokenSpelling:
    """Each token's string and bytes on its own, remembered across replies (they name the same tokens again and
    again)."""

    def __init__(self, tokenizer: Tokenizer, cached: int = 1 << 16):
        self.bytes = functools.lru_cache(maxsize=cached)(tokenizer.token_bytes)

    def text(self, token_id: int) -> str:
        """Its text, or for a piece of a multi-byte character (not UTF-8 on its own) its bytes escaped, `\\xe2\\x80`,
        as OpenAI spells those (their `bytes` say which they are)."""
        raw = self.bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" for b in raw)

    def entry(self, token_id: int, logprob: float) -> dict:
        """Chat's {token, logprob, bytes}."""
        return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.bytes(token_id))}


class ChoiceLogprobs:
    """One choice's `logprobs`, chunk by chunk (all of a reply's chunks at once when it does not stream): chat's
    `{"content": [...]}`, or completions' `{tokens, token_logprobs, top_logprobs, text_offset}`, whose offsets run on
    across a stream's chunks (each token's offset is the length of the token strings before it, as vLLM counts)."""

    def __init__(self, spelling: TokenSpelling, chat: bool):
        self.spelling = spelling
        self.chat = chat
        self.offset = 0

    def __call__(self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [{**self.spelling.entry(token, lp.logprob), "top_logprobs": [
                self.spelling.entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                for token, lp in zip(token_ids, logprobs)]}
        tokens = [self.spelling.text(token) for token in token_ids]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.offset))
        self.offset = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [self._top(token, lp) for token, lp in zip(token_ids, logprobs)],
                "text_offset": offsets}

    def _top(self, token: int, logprob: common_pb2.TokenLogprob) -> dict[str, float]:
        """Completions' alternatives: the N best by their strings, and the chosen token always (up to N + 1, as
        OpenAI documents)."""
        top: dict[str, float] = {}
        for i, value in [*zip(logprob.top_token_ids, logprob.top_logprobs), (token, logprob.logprob)]:
            top.setdefault(self.spelling.text(i), value)  # NOTE: two tokens spelled alike keep the better one
        return top
