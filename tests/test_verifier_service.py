"""The verifier's generation loop without gRPC: it stays exact when no drafter answers and when a drafter
sends malformed trees (each costs one step of speculation and is counted)."""

from __future__ import annotations

import asyncio

from modeling.tree import DraftTree
from tests.engine_helpers import GREEDY, make_engine, plain_generate
from verifier_service.drafter_pool import DrafterPool
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import VerifierService

PROMPT = list(b"no drafter, no problem")


class MalformedDrafters(DrafterPool):
    """A pool whose every tree names a parent after its child."""

    async def refresh(self) -> None:
        pass

    async def draft(self, *args, **kwargs) -> DraftTree:
        return DraftTree((1, 2), (1, -1), (2, 1))


def generate(service: VerifierService) -> list[int]:
    async def run() -> list[int]:
        await service.start()
        try:
            session = await service.create_session(PROMPT)
            tokens = []
            async for event in service.generate(session.session_id, [], GREEDY, keep_session=False):
                tokens += event.result.emitted
            return tokens
        finally:
            await service.stop()
    return asyncio.run(run())


def test_no_reachable_drafter_still_generates_exactly(tiny_target) -> None:
    engine = make_engine(tiny_target)
    metrics = VerifierMetrics()
    pool = DrafterPool("127.0.0.1:9", metrics, timeout_s=0.2)  # nothing listens on the discard port
    assert generate(VerifierService(engine, pool, metrics)) == plain_generate(engine, PROMPT)
    assert metrics.draft_misses._value.get() == GREEDY.max_new_tokens
    assert engine.pool.num_free == engine.pool.num_pages


def test_malformed_trees_are_counted_and_change_nothing(tiny_target) -> None:
    engine = make_engine(tiny_target)
    metrics = VerifierMetrics()
    assert generate(VerifierService(engine, MalformedDrafters("", metrics), metrics)) == plain_generate(engine, PROMPT)
    assert metrics.bad_trees._value.get() == GREEDY.max_new_tokens
