"""Concurrent prefills take the engine in turns, shortest remaining first: the order itself, cancellations, and
through the verifier service (prompts prefilled one after another rather than chunk by chunk in rotation, decode
bursts cut short while a prefill is under way, and still exact)."""

from __future__ import annotations

import asyncio
import time

from tests.engine_helpers import GREEDY, make_engine, plain_generate
from verifier_service.metrics import VerifierMetrics
from verifier_service.prefill_turns import PrefillTurns
from verifier_service.service import VerifierService
from verifier_service.step_loop import StepEvent


async def prefill(turns: PrefillTurns, name: str, chunks: int, order: list[str], arrive_s: float = 0.0) -> None:
    """A prefill of `chunks` one-token chunks, each taking 10 ms of the engine, sent after `arrive_s`."""
    await asyncio.sleep(arrive_s)
    async with turns.turn(chunks) as between:
        for left in range(chunks - 1, -1, -1):
            order.append(name)
            await asyncio.sleep(0.01)
            if left:
                await between(left)


def test_the_prefill_with_the_fewest_tokens_left_goes_next_then_the_earliest() -> None:
    async def main() -> list[str]:
        turns, order = PrefillTurns(), []
        await asyncio.gather(prefill(turns, "a", 4, order), prefill(turns, "b", 2, order, 0.004),
                             prefill(turns, "c", 3, order, 0.005), prefill(turns, "d", 3, order, 0.006))
        assert turns.waiting == 0
        return order

    # b (2 left) overtakes a (3 left) after a's first chunk; a then keeps the turn against c and d (3 left each,
    # later), and c goes before d
    assert asyncio.run(main()) == list("abbaaacccddd")


def test_a_cancelled_prefill_gives_its_turn_and_its_place_up() -> None:
    async def main() -> list[str]:
        turns, order = PrefillTurns(), []
        holder = asyncio.ensure_future(prefill(turns, "a", 5, order))
        waiter = asyncio.ensure_future(prefill(turns, "b", 1, order, 0.002))
        after = asyncio.ensure_future(prefill(turns, "c", 2, order, 0.003))
        await asyncio.sleep(0.005)
        waiter.cancel()  # waiting: the others never wait for it
        await asyncio.sleep(0.01)
        holder.cancel()  # in the middle of its chunks: c goes on
        await asyncio.gather(holder, waiter, after, return_exceptions=True)
        assert holder.cancelled() and waiter.cancelled() and after.done() and not after.cancelled()
        late: list[str] = []
        await prefill(turns, "d", 1, late)  # the turn is free again
        return order + late

    order = asyncio.run(main())
    assert order[-3:] == ["c", "c", "d"] and "b" not in order


def test_concurrent_prompts_prefill_one_after_another_and_stay_exact(tiny_target) -> None:
    """Two prompts of 8 chunks sent together prefill one after the other (before: a chunk of each in turn, so both
    first tokens came at the end), and a prompt of 2 chunks sent during them goes ahead of their remaining chunks.
    Every output equals plain greedy decoding."""
    engine, metrics = make_engine(tiny_target), VerifierMetrics()
    chunks: list[int] = []
    waiting: list[float] = []  # the prefills-awaiting-turn gauge at each chunk
    prefill_chunk = engine._prefill_chunk

    def counted_chunk(table, tokens, *span):
        chunks.append(tokens[0])
        waiting.append(metrics.prefills_awaiting_turn.collect()[0].samples[0].value)
        return prefill_chunk(table, tokens, *span)

    engine._prefill_chunk = counted_chunk
    prompts = {name: [first] + [1 + i % 250 for i in range(length - 1)]
               for name, first, length in (("first", 7, 8 * 24), ("second", 8, 8 * 24), ("short", 9, 2 * 24))}

    async def main() -> dict[str, list[int]]:
        service = VerifierService(engine, None, metrics)
        await service.start()

        async def run(name: str, arrive_after_chunks: int = 0) -> list[int]:
            while len(chunks) < arrive_after_chunks:
                await asyncio.sleep(0.001)
            session = await service.create_session(prompts[name])
            return [t async for e in service.generate(session.session_id, [], GREEDY, False)
                    if isinstance(e, StepEvent) for t in e.result.emitted]

        outputs = await asyncio.gather(run("first"), run("second"), run("short", arrive_after_chunks=3))
        await service.stop()
        return dict(zip(["first", "second", "short"], outputs))

    outputs = asyncio.run(main())
    owner = {7: "f", 8: "s", 9: "x"}
    order = "".join(owner[first] for first in chunks)
    # each prompt's chunks in one run, the short one's as soon as it came, the second prompt's after the first's
    assert sorted(order) == sorted("f" * 8 + "s" * 8 + "x" * 2)
    assert order.index("x") >= 3 and "xx" in order and order.replace("xx", "") == "f" * 8 + "s" * 8
    assert max(waiting) >= 1 and waiting[-1] == 0  # the second prompt waits while the first's chunks run
    for name, tokens in outputs.items():
        assert tokens == plain_generate(engine, prompts[name])


def test_decode_bursts_hold_a_prefill_under_way_up_about_one_chunks_time_and_stay_exact(tiny_target) -> None:
    """A prompt of 4 chunks arrives while another generation decodes in bursts of 8: while its prefill is under way
    the loop asks for bursts of one step (each step made to take 30 ms, a chunk of the tiny model a few: the service
    has timed the first prompt's chunk), before and after it for all 8; both outputs equal plain greedy decoding."""
    engine = make_engine(tiny_target, decode_burst_steps=8)
    service = VerifierService(engine, None, VerifierMetrics())
    asked: list[tuple[bool, int]] = []  # (a prefill under way, steps asked) per burst
    burst_length, decode = engine.burst_length, engine.decode

    def recorded_burst_length(session_ids: list[str], wanted: int) -> int:
        asked.append((service.prefill_turns.under_way, wanted))
        return burst_length(session_ids, wanted)

    def slow_decode(session_ids: list[str], steps: int):
        time.sleep(0.03 * steps)
        return decode(session_ids, steps)

    engine.burst_length, engine.decode = recorded_burst_length, slow_decode
    prompts = [[7] + [1 + i % 250 for i in range(23)], [8] + [1 + i % 250 for i in range(4 * 24 - 1)]]

    async def main() -> list[list[int]]:
        await service.start()

        async def run(prompt: list[int], after_bursts: int = 0) -> list[int]:
            while len(asked) < after_bursts:
                await asyncio.sleep(0.001)
            session = await service.create_session(prompt)
            return [t async for e in service.generate(session.session_id, [], GREEDY, False)
                    if isinstance(e, StepEvent) for t in e.result.emitted]

        outputs = await asyncio.gather(run(prompts[0]), run(prompts[1], after_bursts=1))
        await service.stop()
        return outputs

    outputs = asyncio.run(main())
    assert service.step_costs.prefill_chunk_s() is not None
    during = {wanted for under_way, wanted in asked if under_way}
    assert during == {1} and 8 in {wanted for under_way, wanted in asked if not under_way}
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == plain_generate(engine, prompt)
