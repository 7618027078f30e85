"""A session: its tokens, its pages, and the state of the generation in progress."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verifier_service.engine.block_table import BlockTable
from verifier_service.engine.penalties import LogitAdjustment
from verifier_service.engine.prefix_cache import Indexed
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.stopping import StopChecker


@dataclass
class Generation:
    params: SamplingParams
    stop: StopChecker
    generator: np.random.Generator | None  # NOTE: the draws of its sampled rows, on the host (None when greedy)
    adjustment: LogitAdjustment | None = None  # NOTE: None unless the params adjust the logits (the fast paths)


@dataclass
class Session:
    """NOTE (invariant): the KV pages hold `tokens[:-1]`; `tokens[-1]` is the pending root of the
    next verify step (the last prompt token, or the last emitted token)."""

    session_id: str
    tokens: list[int]
    block_table: BlockTable
    generation: Generation | None = None
    cached_tokens: int = 0  # positions of its latest prefill whose K/V came from the prefix cache
    # NOTE: how far the prefix cache indexed its pages (Engine._index): the full pages of its KV never change while it
    # lives (steps and prefills write from kv_len on, copies of shared pages included), so the next index resumes there
    indexed: Indexed = Indexed()

    @property
    def kv_len(self) -> int:
        return len(self.tokens) - 1

    @property
    def root(self) -> int:
        return self.tokens[-1]
