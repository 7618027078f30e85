"""Prompts that find the KV cache full wait for pages, first come first served, up to --admission-timeout-s; a
prompt larger than the whole cache fails at once. The queue alone, then through the verifier service."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from tests.engine_helpers import GREEDY, make_engine, plain_generate
from verifier_service.admission import KVAdmission
from verifier_service.errors import CapacityError, NoFreePages
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import PrefillEvent, VerifierService
from verifier_service.step_loop import StepEvent

EIGHT_PAGES = 8 * 16 * 2 * 4 * 2 * 16 * 4  # bytes of 8 pages of 16 tokens of the tiny model


class Pool:
    """Free pages; `reserve(n)` takes n of them if it can, like Prefill.reserve on the engine thread."""

    def __init__(self, free: int):
        self.free = free

    def reserve(self, pages: int):
        async def take() -> bool:
            await asyncio.sleep(0)  # NOTE: an engine call: the loop runs others meanwhile
            if self.free < pages:
                return False
            self.free -= pages
            return True
        return take


async def until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


def test_the_first_waiting_prompt_goes_first_even_when_a_later_one_would_fit() -> None:
    async def main() -> list[str]:
        admission, pool, admitted = KVAdmission(timeout_s=5), Pool(free=1), []

        async def prefill(name: str, pages: int) -> None:
            await admission.admit(pool.reserve(pages), f"{pages}")
            admitted.append(name)

        tasks = [asyncio.ensure_future(prefill(name, pages)) for name, pages in (("big", 4), ("small", 1))]
        await until(lambda: admission.waiting == 2)
        await asyncio.sleep(0.05)
        assert admitted == [] and pool.free == 1  # "small" would fit, but "big" came first
        pool.free += 2
        admission.pages_freed()
        await asyncio.sleep(0.05)
        assert admitted == []
        pool.free += 2
        admission.pages_freed()
        await asyncio.gather(*tasks)
        assert admission.waiting == 0 and pool.free == 0
        return admitted

    assert asyncio.run(main()) == ["big", "small"]


def test_a_wait_ends_in_capacity_error_after_the_timeout_and_a_cancelled_wait_leaves_the_queue() -> None:
    async def main() -> None:
        admission, pool = KVAdmission(timeout_s=0.2), Pool(free=0)
        with pytest.raises(CapacityError, match="waited 0.2 s for 3 pages to be free"):
            await admission.admit(pool.reserve(3), "3")
        first = asyncio.ensure_future(admission.admit(pool.reserve(3), "3"))
        second = asyncio.ensure_future(admission.admit(pool.reserve(1), "1"))
        await until(lambda: admission.waiting == 2)
        first.cancel()
        pool.free = 1
        admission.pages_freed()
        await asyncio.wait_for(second, 1.0)  # the head went away: the next one goes without waiting for it
        assert first.cancelled() and admission.waiting == 0 and pool.free == 0
        with pytest.raises(CapacityError):  # timeout 0: no waiting at all
            await KVAdmission(timeout_s=0).admit(pool.reserve(1), "1")

    asyncio.run(main())


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def test_a_prompt_waits_for_a_released_session_and_one_larger_than_the_cache_fails_at_once(tiny_target) -> None:
    engine = make_engine(tiny_target, kv_budget_bytes=EIGHT_PAGES)
    assert engine.pool.num_pages == 8
    waiting_prompt = prompt_of(60, 2)  # 4 pages

    async def main() -> list[int]:
        metrics = VerifierMetrics()
        service = VerifierService(engine, None, metrics, admission_timeout_s=10)
        await service.start()
        holder = await service.create_session(prompt_of(90, 1))  # 6 pages of the 8
        appending = await service.create_session([5])  # no page yet: its one token is the pending root
        waiting = asyncio.ensure_future(service.create_session(waiting_prompt))
        await until(lambda: service.admission.waiting == 1)
        assert metrics.waiting_requests.collect()[0].samples[0].value == 1
        with pytest.raises(CapacityError, match="more pages than the cache holds"):
            await service.create_session(prompt_of(200, 3))
        await asyncio.sleep(0.1)
        assert not waiting.done() and engine.pool.num_free == 2
        gone = asyncio.ensure_future(service.create_session(prompt_of(40, 4)))  # behind the first: then cancelled
        await until(lambda: service.admission.waiting == 2)
        gone.cancel()
        await until(lambda: service.admission.waiting == 1)
        assert engine.pool.num_free == 2 and len(engine.sessions) == 2
        events = service.generate(appending.session_id, prompt_of(30, 5), GREEDY, False)  # a turn that waits too:
        assert await asyncio.wait_for(anext(events), 5) == PrefillEvent(0, 30)  # its stream says so at once
        await events.aclose()  # NOTE: the caller goes away: the one-shot's session goes
        assert engine.pool.num_free == 2 and len(engine.sessions) == 1
        await service.release_session(holder.session_id)
        session = await asyncio.wait_for(waiting, 5)
        (waited,) = [s.value for s in metrics.admission_wait_seconds.collect()[0].samples if s.name.endswith("_count")]
        assert waited == 3  # NOTE: the waits that were cancelled count too
        tokens = [t async for e in service.generate(session.session_id, [], GREEDY, False)
                  if isinstance(e, StepEvent) for t in e.result.emitted]
        short = VerifierService(engine, None, VerifierMetrics(), admission_timeout_s=0.2)
        await short.start()
        holder = await short.create_session(prompt_of(90, 1))
        with pytest.raises(CapacityError, match="waited 0.2 s"):
            await short.create_session(waiting_prompt)
        assert engine.pool.num_free == 2 and len(engine.sessions) == 1  # the refused prompt left nothing
        await short.release_session(holder.session_id)
        await short.stop()
        await service.stop()
        return tokens

    assert asyncio.run(main()) == plain_generate(engine, waiting_prompt)


def test_a_generation_starts_only_when_its_growth_fits_beside_those_under_way(tiny_target) -> None:
    """Pages: 8 of 16 tokens. A generation of 40 new tokens after 30 owes 3 pages beyond its 2; a second one
    cannot start beside it until it ends; a prompt whose generation is promised keeps those pages from others."""
    engine = make_engine(tiny_target, kv_budget_bytes=EIGHT_PAGES)
    first, _ = engine.create_session(prompt_of(31, 1))  # 30 positions: 2 pages
    second, _ = engine.create_session(prompt_of(31, 2))
    engine.start_generation(first.session_id, replace(GREEDY, max_new_tokens=40))
    assert engine.pages_owed() == 3 and engine.room() == 8 - 4 - 3
    with pytest.raises(NoFreePages):
        engine.start_generation(second.session_id, replace(GREEDY, max_new_tokens=40))
    assert second.generation is None  # nothing changed
    engine.end_generation(first.session_id)
    assert engine.pages_owed() == 0
    prefill = engine.begin_extend(second.session_id, prompt_of(16, 3), then_generate=32)  # to 78 positions: 5 pages
    assert prefill.pages_to_keep == 3 and prefill.reserve() and engine.promised[second.session_id] == 78
    assert engine.room() == 8 - 2 - 3 - 2  # first's 2, second's 3 held and 2 more kept for its generation
    with pytest.raises(NoFreePages):
        engine.start_generation(first.session_id, replace(GREEDY, max_new_tokens=40))
    while not prefill.advance():
        pass
    engine.start_generation(second.session_id, replace(GREEDY, max_new_tokens=32))  # its pages were kept
    assert second.session_id not in engine.promised and engine.pages_owed() == 2
    with pytest.raises(CapacityError, match="more pages than the cache holds"):
        engine.start_generation(first.session_id, replace(GREEDY, max_new_tokens=200))
    engine.end_generation(second.session_id)
    aborted = engine.begin_extend(first.session_id, prompt_of(16, 4), then_generate=32)
    assert aborted.reserve() and first.session_id in engine.promised
    aborted.abort()  # its caller went away before the prompt was in: neither its pages nor its promise stay
    assert first.session_id not in engine.promised and engine.room() == 8 - 2 - 3


def test_more_prompts_than_the_cache_holds_at_once_all_finish_exactly(tiny_target) -> None:
    """32 pages; twelve one-shot requests (a one-token session, then 105 appended tokens and 48 new ones: 10 pages
    each) sent together: they go in two or three at a time, and every output equals plain greedy decoding."""
    engine = make_engine(tiny_target, kv_budget_bytes=4 * EIGHT_PAGES)
    params = replace(GREEDY, max_new_tokens=48, ignore_eos=True)
    appends = [prompt_of(105, 10 + i) for i in range(12)]

    async def main() -> list[list[int]]:
        service = VerifierService(engine, None, VerifierMetrics(), admission_timeout_s=30)
        await service.start()

        async def one(append: list[int]) -> list[int]:
            session = await service.create_session([5])
            return [t async for e in service.generate(session.session_id, append, params, False)
                    if isinstance(e, StepEvent) for t in e.result.emitted]

        outputs = await asyncio.gather(*(one(append) for append in appends))
        await service.stop()
        return outputs

    outputs = asyncio.run(main())
    assert engine.pool.num_free == engine.pool.num_pages and not engine.promised
    for append, tokens in zip(appends, outputs):
        assert tokens == plain_generate(engine, [5] + append, params)
