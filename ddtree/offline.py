"""The whole speculative loop in one process: target engine + an in-process drafter, no gRPC.
Used by `ddtree offline` (offline generation, benchmarks) and as the reference the services must equal."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from drafter_service.drafter import Drafter
from modeling.speculation import StepCursor, drafter_seed, feature_tail
from modeling.tree import DraftTree
from verifier_service.engine.engine import Engine
from verifier_service.engine.sampling import SamplingParams


@dataclass(frozen=True)
class OfflineResult:
    token_ids: list[int]  # generated only
    text: str
    acceptance_lengths: list[int]  # one per verify step, counting the target's own next token
    stop_reason: str
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.decode_s if self.decode_s else 0.0

    def to_json(self) -> dict:
        mean = sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))
        return {**asdict(self), "steps": len(self.acceptance_lengths), "mean_acceptance_length": mean,
                "tokens_per_s": self.tokens_per_s}


def _open_drafter(engine: Engine, drafter: Drafter, prompt: list[int]) -> str:
    info = drafter.info
    uses_features = bool(info.feature_dim)
    engine.feature_layers = info.target_layer_ids
    tail = feature_tail(uses_features, info.context_window, engine.max_context)
    session, features = engine.create_session(prompt, feature_tail=tail)
    drafter.open(session.session_id, drafter_seed(session.tokens[:-1], features, uses_features, info.context_window))
    return session.session_id


def generate_offline(engine: Engine, drafter: Drafter | None, prompt: list[int], params: SamplingParams,
                     tree_budget: int = 15) -> OfflineResult:
    started = time.perf_counter()
    session_id = _open_drafter(engine, drafter, prompt) if drafter else engine.create_session(prompt)[0].session_id
    session = engine.session(session_id)
    engine.start_generation(session_id, params)
    prefilled = time.perf_counter()
    generated: list[int] = []
    acceptance: list[int] = []
    cursor = StepCursor(session_id, session.kv_len)
    while True:
        tree = DraftTree.empty()
        if drafter is not None and cursor.step:  # NOTE: the first step emits the first token (as the service's)
            (tree,) = drafter.draft([cursor.draft_step(session.root, tree_budget)])
        (result,) = engine.step([(session_id, tree)])
        generated += result.emitted
        acceptance.append(result.acceptance_length)
        if result.finished:
            break
        cursor.advance(result.committed, result.features, result.commit_start)
    finished = time.perf_counter()
    if drafter is not None:
        drafter.close(session_id)
    engine.release_session(session_id)
    text = engine.tokenizer.decode(generated) if engine.tokenizer else ""
    return OfflineResult(generated, text, acceptance, result.finished.value, prefilled - started, finished - prefilled)
