"""Many generations over one GenerateStream call: events batched per reply, per-generation errors, cancels,
deadlines, the stream's end, back-pressure, and each generation's window of credit from the gateway
(verifier_service/generation_stream.py, gateway/generation_streams.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from gateway.generation_streams import WINDOW, GenerationStream
from proto import verifier_pb2, verifier_pb2_grpc
from proto.status import InvalidArgument
from verifier_service.generation_stream import RUN_AHEAD_EVENTS, Outbox, StreamSlot, serve_generations

STEPS = 3


def start(request_id: int, session: str, timeout_s: float = 0.0) -> verifier_pb2.VerifierStreamRequest:
    return verifier_pb2.VerifierStreamRequest(
        request_id=request_id, timeout_s=timeout_s, generate=verifier_pb2.VerifierGenerateRequest(session_id=session))


def cancel(request_id: int) -> verifier_pb2.VerifierStreamRequest:
    return verifier_pb2.VerifierStreamRequest(request_id=request_id, cancel=True)


class Generations:
    """Sessions named "ok*" step in lockstep (one shared clock tick per step); "bad" fails at its second step;
    "slow" waits forever after its first. Records which generations were cancelled."""

    def __init__(self) -> None:
        self.tick = asyncio.Event()
        self.cancelled: list[str] = []

    async def __call__(self, message: verifier_pb2.VerifierStreamRequest, slot: StreamSlot):
        session = message.generate.session_id
        try:
            for step in range(STEPS):
                if session == "bad" and step == 1:
                    raise InvalidArgument("params.top_p: 2 is not in (0, 1]")
                if session == "slow" and step == 1:
                    await asyncio.Event().wait()
                yield verifier_pb2.VerifierGenerateStep(step=step, token_ids=[step], finished=step == STEPS - 1)
                await self.tick.wait()
        except asyncio.CancelledError:
            self.cancelled.append(session)
            raise


async def feed(queue: asyncio.Queue):
    while (message := await queue.get()) is not None:
        yield message


async def collect(replies, until) -> list[list[tuple[int, str]]]:
    """Each reply as (request_id, what) pairs, until `until(replies so far)`."""
    seen = []
    async for reply in replies:
        seen.append([(e.request_id, f"step {e.step.step}" if e.WhichOneof("kind") == "step"
                      else f"error {e.error.code}: {e.error.message}") for e in reply.events])
        if until(seen):
            break
    return seen


def test_the_steps_of_concurrent_generations_share_replies_and_a_failure_stays_with_its_generation() -> None:
    async def scenario():
        generations, requests = Generations(), asyncio.Queue()
        replies = serve_generations(feed(requests), generations, ())
        for request_id, session in enumerate(("ok1", "ok2", "bad"), start=1):
            requests.put_nowait(start(request_id, session))

        async def clock():
            while True:
                await asyncio.sleep(0.01)
                generations.tick.set()
                generations.tick.clear()

        ticking = asyncio.ensure_future(clock())
        seen = await collect(replies, lambda seen: sum(len(r) for r in seen) == 3 + 3 + 2)
        ticking.cancel()
        await replies.aclose()
        return seen

    seen = asyncio.run(scenario())
    assert seen[0] == [(1, "step 0"), (2, "step 0"), (3, "step 0")]  # one reply for the first step of all three
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (3, f"error {code}: params.top_p: 2 is not in (0, 1]") in seen[1]
    events = [event for reply in seen for event in reply]
    assert [e for e in events if e[0] == 1] == [(1, "step 0"), (1, "step 1"), (1, "step 2")]


def test_cancel_deadline_and_the_streams_end_stop_generations() -> None:
    async def scenario():
        generations, requests = Generations(), asyncio.Queue()
        replies = serve_generations(feed(requests), generations, ())
        requests.put_nowait(start(1, "slow"))
        requests.put_nowait(start(2, "slow", timeout_s=0.05))
        requests.put_nowait(start(3, "slow"))
        seen = await collect(replies, lambda seen: sum(len(r) for r in seen) == 3)
        requests.put_nowait(cancel(1))
        seen += await collect(replies, lambda seen: any(e[0] == 2 for r in seen for e in r))
        cancelled_before_end = list(generations.cancelled)
        await replies.aclose()  # the gateway went away: generation 3 is cancelled too
        return seen, cancelled_before_end, generations.cancelled

    seen, before_end, cancelled = asyncio.run(scenario())
    code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert seen[-1] == [(2, f"error {code}: Deadline Exceeded")]
    assert before_end == ["slow", "slow"] and cancelled == ["slow"] * 3


def test_a_request_id_already_running_is_refused_and_a_half_closed_stream_ends_after_its_generations() -> None:
    async def scenario():
        generations, requests = Generations(), asyncio.Queue()
        generations.tick.set()  # NOTE: no waiting between steps
        for message in (start(7, "ok"), start(7, "ok"), None):
            requests.put_nowait(message)
        return [event for reply in await collect(serve_generations(feed(requests), generations, ()),
                                                 lambda seen: False) for event in reply]

    events = asyncio.run(scenario())
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (7, f"error {code}: request_id: 7 is already running on this stream") in events
    assert [e for e in events if e[1].startswith("step")] == [(7, "step 0"), (7, "step 1"), (7, "step 2")]


def test_a_generation_waits_while_the_stream_holds_its_limit_of_unsent_events() -> None:
    async def scenario():
        outbox = Outbox(limit=2)
        event = verifier_pb2.VerifierStreamEvent(request_id=1)
        await outbox.put(event)
        await outbox.put(event)
        third = asyncio.ensure_future(outbox.put(event))
        await asyncio.sleep(0.01)
        held = not third.done()
        taken = await outbox.take()
        await asyncio.wait_for(third, 1.0)
        return held, len(taken), len(outbox.events)

    assert asyncio.run(scenario()) == (True, 2, 1)


def test_a_generation_with_a_window_waits_for_credit_not_for_the_writes() -> None:
    """Sent is not enough: the window counts events until the caller reports them consumed. Credit for more than
    is out, or for a generation without a window, changes nothing; the unsent bound holds whatever the window."""
    async def scenario():
        outbox = Outbox(limit=8)
        outbox.open(1, window=2)
        event = verifier_pb2.VerifierStreamEvent(request_id=1)
        await outbox.put(event)
        await outbox.put(event)
        await outbox.take()  # both sent
        third = asyncio.ensure_future(outbox.put(event))
        await asyncio.sleep(0.01)
        held = not third.done()
        outbox.consumed(1, 5)  # more than it has out: no negative credit
        await asyncio.wait_for(third, 1.0)
        outbox.consumed(1, 1)
        await asyncio.wait_for(outbox.put(event), 1.0)
        outbox.consumed(2, 3)  # no window (or ended): ignored
        outbox.open(3, window=100)
        for request_id in (2, 3):
            for _ in range(8):
                await asyncio.wait_for(outbox.put(verifier_pb2.VerifierStreamEvent(request_id=request_id)), 1.0)
        ninth = asyncio.ensure_future(outbox.put(verifier_pb2.VerifierStreamEvent(request_id=3)))
        await asyncio.sleep(0.01)
        unsent_bound = not ninth.done()
        ninth.cancel()
        return held, outbox.unconsumed[1], 2 in outbox.unconsumed, unsent_bound

    assert asyncio.run(scenario()) == (True, 1, False, True)


class Counting(verifier_pb2_grpc.VerifierServicer):
    """A verifier's GenerateStream whose generations step freely: `made` counts each session's steps, `ended` the
    sessions whose generation ended (ran out, failed or was closed)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.made, self.ended = steps, collections.Counter(), set()

    async def generation(self, message: verifier_pb2.VerifierStreamRequest, slot: StreamSlot):
        session = message.generate.session_id
        try:
            for step in range(self.steps):
                self.made[session] += 1
                yield verifier_pb2.VerifierGenerateStep(step=step, token_ids=[step], finished=step == self.steps - 1)
                await asyncio.sleep(0)
        finally:
            self.ended.add(session)

    async def GenerateStream(self, request_iterator, context):
        async for reply in serve_generations(request_iterator, self.generation, ()):
            yield reply


@contextlib.asynccontextmanager
async def gateway_stream(verifier: Counting) -> AsyncIterator[GenerationStream]:
    """A gateway's GenerationStream to `verifier`, served over real gRPC on loopback."""
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = GenerationStream(verifier_pb2_grpc.VerifierStub(channel))
            yield stream
            await stream.close()
    finally:
        await server.stop(None)


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def request(session: str) -> verifier_pb2.VerifierGenerateRequest:
    return verifier_pb2.VerifierGenerateRequest(session_id=session)


async def read(steps: AsyncIterator[verifier_pb2.VerifierGenerateStep]) -> list[int]:
    """The step numbers to the end; a generation stuck for want of credit fails the test instead of hanging it."""
    async def rest() -> list[int]:
        return [step.step async for step in steps]
    return await asyncio.wait_for(rest(), 10.0)


def test_a_caller_that_stops_reading_holds_back_its_generation_and_no_other() -> None:
    """Gateway side to verifier side: the stalled generation's producer stops at the window, and the gateway holds
    no more than that, while another on the same stream runs to its end; once read again, it gives every step."""
    async def scenario():
        verifier = Counting(steps=100)
        async with gateway_stream(verifier) as stream:
            stalled = stream.generate(request("stalled"), None)
            first = await anext(stalled)
            other = await read(stream.generate(request("other"), None))
            await asyncio.sleep(0.05)
            held, queued = verifier.made["stalled"], stream.inboxes[1].qsize()
            rest = await read(stalled)
        return first.step, other, held, queued, rest

    first, other, held, queued, rest = asyncio.run(scenario())
    assert other == list(range(100)) and first == 0
    assert held == WINDOW + 1  # the window, and the one its producer made and now holds
    assert queued <= WINDOW
    assert rest == list(range(1, 100))


def test_a_generation_waiting_for_credit_ends_promptly_when_its_caller_closes_it() -> None:
    async def scenario():
        verifier = Counting(steps=100)
        async with gateway_stream(verifier) as stream:
            stalled = stream.generate(request("stalled"), 60.0)
            await anext(stalled)
            await asyncio.wait_for(until(lambda: verifier.made["stalled"] > WINDOW), 5.0)
            await asyncio.sleep(0.01)  # NOTE: let its producer settle into the wait for credit
            await stalled.aclose()
            await asyncio.wait_for(until(lambda: "stalled" in verifier.ended), 1.0)
        return verifier.made["stalled"]

    assert asyncio.run(scenario()) == WINDOW + 1


def test_without_a_window_a_generation_runs_ahead_only_to_the_unsent_bound() -> None:
    """An older gateway sends no window and no credit: its generation waits only while RUN_AHEAD_EVENTS of its
    events are unsent, and runs to its end as its replies are read."""
    async def scenario():
        verifier, requests = Counting(steps=100), asyncio.Queue()
        replies = serve_generations(feed(requests), verifier.generation, ())
        requests.put_nowait(verifier_pb2.VerifierStreamRequest(request_id=9, consumed=3))  # unknown: ignored
        requests.put_nowait(start(1, "old"))
        steps = [event.step.step for event in (await asyncio.wait_for(anext(replies), 5.0)).events]
        await asyncio.sleep(0.05)
        held = verifier.made["old"] - len(steps)
        while steps[-1] != 99:
            steps += [event.step.step for event in (await asyncio.wait_for(anext(replies), 5.0)).events]
        await replies.aclose()
        return held, steps

    held, steps = asyncio.run(scenario())
    assert held == RUN_AHEAD_EVENTS + 1  # unsent, and the one its producer made and now holds
    assert steps == list(range(100))
