"""Sampling parameters and the choice of the target's token at every verify row."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from proto.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS
from verifier_service.engine.uploads import upload
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


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of a batch's verify rows, one per row on the device (each session's for its rows), so
    that every row of every session is chosen in one pass of kernels rather than a few per session (one session at
    a time took ~10 kernel launches each a step). `largest_k` (0: no row has a top-k below the vocabulary) and
    `any_top_p` are known on the host: a batch pays for a top-k or a sort only where some row asks for one."""

    temperature: torch.Tensor  # [N] float, 1 at greedy rows (their choice is the argmax)
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float, inf = off
    greedy: torch.Tensor  # [N] bool
    largest_k: int
    any_top_p: bool
    any_sampled: bool  # NOTE: False: every row takes its argmax, and no distribution is computed

    @classmethod
    def of(cls, params: list[SamplingParams], rows: list[int], vocab: int, device: torch.device) -> RowSampling:
        """params[i] for the next rows[i] rows."""
        top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        settings = np.array([[p.temperature or 1.0 for p in params], [float(k) for k in top_ks],
                             [p.top_p if p.top_p < 1.0 else math.inf for p in params],
                             [float(p.greedy) for p in params]], dtype=np.float32)
        per_row = upload(settings.repeat(rows, axis=1), torch.float32, device)
        return cls(per_row[0], per_row[1].long(), per_row[2], per_row[3].bool(), max(top_ks),
                   any(p.top_p < 1.0 for p in params), not all(p.greedy for p in params))


def target_distribution(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """logits: [N, V] fp32 -> probabilities [N, V] after each row's temperature, top-k and top-p."""
    logits = logits / rows.temperature[:, None]
    if rows.largest_k:
        kth = logits.topk(rows.largest_k, dim=-1).values.gather(1, (rows.top_k.clamp(min=1) - 1)[:, None])
        logits = logits.masked_fill((logits < kth) & (rows.top_k > 0)[:, None], float("-inf"))
    probs = logits.softmax(-1)
    if rows.any_top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # NOTE: keep a token when the mass before it is below top_p (the top token always survives).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= rows.top_p[:, None]
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, rows: RowSampling, draws: torch.Tensor) -> torch.Tensor:
    """The target's own token at each row: the argmax at greedy rows, else the token at the row's draw (uniform in
    [0, 1), [N] on the device) on the inverse CDF of its distribution: one independent draw per row, from the
    session's own generator (`draws` is made on the host, so a seed gives the same tokens whatever the batch).
    logits: [N, V] -> [N] int64."""
    if not rows.any_sampled:
        return logits.argmax(-1)
    probs = target_distribution(logits, rows)
    cdf = probs.cumsum(-1)
    # NOTE: the first token whose cumulative mass exceeds the draw (right=True: never one of zero mass)
    sampled = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return torch.where(rows.greedy, logits.argmax(-1), sampled.clamp_(max=logits.shape[-1] - 1))
