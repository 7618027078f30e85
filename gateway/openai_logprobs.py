"""OpenAI's `logprobs` objects from a generation's TokenLogprob (proto/common.proto), each token spelled on its own;
an echoed prompt's, and vLLM's `prompt_logprobs`, from its PromptLogprobs (proto/gateway.proto).

NOTE (stop strings): the logprobs cover every generated token, as `usage.completion_tokens` counts them and as vLLM
reports them: also the token that completed a stop string (and an EOS that ended the reply), though the text stops
before it. So the tokens' strings joined may run past the reply's text, never short of it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

from modeling.tokenizer import Tokenizer
from proto import common_pb2, gateway_pb2


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

    def __call__(self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprob | None]) -> dict:
        """None in `logprobs`: a token nothing scored (a prompt's first), null in completions' lists."""
        if self.chat:
            return {"content": [{**self.spelling.entry(token, lp.logprob), "top_logprobs": [
                self.spelling.entry(i, v) for i, v in zip(lp.top_token_ids, lp.top_logprobs)]}
                for token, lp in zip(token_ids, logprobs)]}
        tokens = [self.spelling.text(token) for token in token_ids]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.offset))
        self.offset = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp is None else self._top(token, lp)
                                 for token, lp in zip(token_ids, logprobs)],
                "text_offset": offsets}

    def prompt(self, scored: gateway_pb2.PromptLogprobs, alternatives: int) -> dict:
        """Completions' `logprobs` of an echoed prompt, ahead of the generated tokens': null for the first token of a
        new prompt (nothing conditions it), `alternatives` best tokens for the others."""
        return self(scored.token_ids, _aligned(scored, lambda lp: common_pb2.TokenLogprob(
            logprob=lp.logprob, top_token_ids=lp.top_token_ids[:alternatives],
            top_logprobs=lp.top_logprobs[:alternatives])))

    def _top(self, token: int, logprob: common_pb2.TokenLogprob) -> dict[str, float]:
        """Completions' alternatives: the N best by their strings, and the chosen token always (up to N + 1, as
        OpenAI documents)."""
        top: dict[str, float] = {}
        for i, value in [*zip(logprob.top_token_ids, logprob.top_logprobs), (token, logprob.logprob)]:
            top.setdefault(self.spelling.text(i), value)  # NOTE: two tokens spelled alike keep the better one
        return top


def joined(parts: Sequence[dict | None]) -> dict | None:
    """Completions' `logprobs` objects of consecutive tokens (an echoed prompt's, then a reply's) as one."""
    present = [p for p in parts if p is not None]
    return {key: [v for p in present for v in p[key]] for key in present[0]} if present else None


def prompt_logprobs(spelling: TokenSpelling, scored: gateway_pb2.PromptLogprobs, alternatives: int
                    ) -> list[dict[int, dict] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, null where nothing scored it (a new prompt's first),
    else {token id: {logprob, rank, decoded_token}} for the token itself and then its place's `alternatives` best."""
    def entry(token: int, lp: common_pb2.TokenLogprob) -> dict[int, dict]:
        ranked = [(token, lp.logprob, lp.rank),
                  *zip(lp.top_token_ids[:alternatives], lp.top_logprobs[:alternatives], itertools.count(1))]
        found: dict[int, dict] = {}
        for i, value, rank in ranked:
            found.setdefault(i, {"logprob": value, "rank": rank, "decoded_token": spelling.text(i)})
        return found
    return [None if lp is None else entry(token, lp)
            for token, lp in zip(scored.token_ids, _aligned(scored, lambda lp: lp))]


def _aligned(scored: gateway_pb2.PromptLogprobs, convert: Callable) -> list:
    """One entry per prompt token: None for those nothing scored (they lead: the first of a new prompt), `convert`
    of the logprob for the others."""
    return [None] * (len(scored.token_ids) - len(scored.logprobs)) + [convert(lp) for lp in scored.logprobs]
