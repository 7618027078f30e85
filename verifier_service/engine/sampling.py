"""Sampling parameters and the choice of the target's token at every verify row."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from proto.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS
from verifier_service.errors import InvalidArgument

MAX_TOP_K = 1 << 20
MAX_NEW_TOKENS = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; else each emitted token's logprob and this many alternatives
    # NOTE: the logit adjustments (engine/penalties.py says how and where they apply); 1, 0, 0, () = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs, each token once

    def validate(self) -> None:
        self._validate_adjustments()
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidArgument(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidArgument(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidArgument(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids must be non-negative")
        if any(not s for s in self.stop_strings):
            raise InvalidArgument("stop_strings must not contain empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def _validate_adjustments(self) -> None:
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidArgument(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(f"logit_bias names {len(self.logit_bias)} tokens, at most {MAX_LOGIT_BIAS}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidArgument("logit_bias names a token twice")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise InvalidArgument(f"logit_bias: token {token} -> {bias}: tokens are >= 0, biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies: the tokens seen so far change the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the choice: penalties or logit_bias."""
        return self.penalized or bool(self.logit_bias)

    @property
    def raw_argmax(self) -> bool:
        """Whether the token is the argmax of the raw logits (greedy, nothing adjusted): the head then computes
        argmaxes alone, never the full logits."""
        return self.greedy and not self.adjusts_logits


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [T, V] fp32 -> probabilities [T, V] after temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # NOTE: keep a token when the mass before it is below top_p (the top token always survives).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The target's own token at each row: argmax when greedy, else an independent draw per row.
    logits: [T, V] -> [T] int64."""
    if params.greedy:
        return logits.argmax(-1)
    probs = target_distribution(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
