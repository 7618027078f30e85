"""The log-probabilities of emitted tokens (OpenAI's `logprobs`) and of prompt tokens (`echo`, vLLM's
`prompt_logprobs`).

NOTE (semantics): raw log-probabilities, as vLLM's default `raw_logprobs`: the log_softmax of the target's
unprocessed fp32 logits, before temperature, top-k and top-p, at the verify row that predicted the token (the
root's row for a step's first token, then the row of each accepted tree node). Those are the rows plain decoding
reads, so speculation never changes them, and a sampled token's logprob does not depend on how it was drawn. A
prompt token's row is the prefill's row of the token before it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely tokens at its row, best first; a prompt token's rank in its
    row (1 = the most likely; None where not computed: emitted tokens)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    rank: int | None = None


@dataclass(frozen=True)
class RowLogprobs:
    """On the device, for R verify rows: the chosen token's logprob [R] and the `width` best tokens [R, width]."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @staticmethod
    def of(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> RowLogprobs:
        """logits: [R, V] fp32, unprocessed; tokens: [R] the rows' chosen tokens."""
        return RowLogprobs.of_logprobs(logits.log_softmax(-1), tokens, width)

    @staticmethod
    def of_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, width: int) -> RowLogprobs:
        """As `of`, from the rows' log_softmax [R, V]."""
        top = logprobs.topk(width, dim=-1)  # NOTE: sorted, best first; the argmax token comes first
        return RowLogprobs(logprobs.gather(-1, tokens[:, None])[:, 0], top.indices, top.values)

    @staticmethod
    def stacked(steps: list[RowLogprobs]) -> RowLogprobs:
        """The same R rows over S steps (a decode burst) as R x S rows, each row's steps together."""
        def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(tensors, dim=1).flatten(0, 1)
        return RowLogprobs(*(stack([getattr(s, name) for s in steps])
                             for name in ("chosen", "top_ids", "top_logprobs")))


def asking_spans(asks: list[int | None], offsets: list[int]) -> list[tuple[int, int]]:
    """The verify rows ([lo, hi) ranges) of the sessions that ask for logprobs; session i has rows
    offsets[i]:offsets[i + 1] and asks for `asks[i]` alternatives (None: no logprobs)."""
    return [(lo, hi) for ask, lo, hi in zip(asks, offsets, offsets[1:]) if ask is not None]


def read_back(tokens: torch.Tensor, logprobs: RowLogprobs | None, asks: list[int | None], sizes: list[int]
              ) -> tuple[list, list[list[TokenLogprob] | None]]:
    """`tokens.tolist()`, and per session the logprobs of its `sizes[i]` rows with its `asks[i]` alternatives (None
    for a session that does not ask): one wait for the device, every copy queued before it. Without logprobs, the
    tokens' copy alone, as on the hot path."""
    if logprobs is None:
        return tokens.tolist(), [None] * len(asks)
    token_list, chosen, top_ids, top_logprobs = _to_host(tokens, logprobs.chosen, logprobs.top_ids,
                                                         logprobs.top_logprobs)
    rows = iter(zip(chosen, top_ids, top_logprobs))
    per_session: list[list[TokenLogprob] | None] = []
    for ask, size in zip(asks, sizes):
        per_session.append(None if ask is None else [
            TokenLogprob(c, tuple(ids[:ask]), tuple(values[:ask])) for c, ids, values in itertools.islice(rows, size)])
    return token_list, per_session


def ranked_logprobs(logits: torch.Tensor, tokens: torch.Tensor, width: int) -> list[TokenLogprob]:
    """Each row's token's logprob, its rank and the row's `width` best tokens, read back at once: a prompt's rows.
    logits: [R, V] fp32, unprocessed; tokens: [R] the tokens the rows predict."""
    logprobs = logits.log_softmax(-1)
    rows = RowLogprobs.of_logprobs(logprobs, tokens, width)
    ranks = 1 + (logprobs > rows.chosen[:, None]).sum(-1)  # NOTE: as vLLM ranks: ties share the better rank
    chosen, rank, top_ids, top_logprobs = _to_host(rows.chosen, ranks, rows.top_ids, rows.top_logprobs)
    return [TokenLogprob(c, tuple(ids), tuple(values), r)
            for c, r, ids, values in zip(chosen, rank, top_ids, top_logprobs)]


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """The tensors as lists: every copy queued first, then one wait for the device."""
    copies = [t.to("cpu", non_blocking=True) for t in tensors]
    if tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()
    return [c.tolist() for c in copies]
