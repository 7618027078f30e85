"""Many generations over one gRPC stream (Verifier.GenerateStream): a gateway keeps one such stream per verifier, and
each reply carries the events of every generation that has one ready. A verify step of 64 sessions then costs one
stream message, where 64 Generate calls cost 64 (each some tens of microseconds of the event loop, which the
engine's step waits on).

Each generation runs as a task of its own and puts its prefill progress into the stream's Outbox; its steps go in
from the verifier's step loop itself, through the generation's `StreamSlot` (no task wakes per step). The writer
sends whatever the outbox holds each time it comes round. A generation that fails ends with an error event carrying
its status, the other generations carry on. A cancel request, or the end of the stream, cancels generations as
cancelling their Generate calls would. A generation started with a window waits while that many of its events are
unconsumed: the caller reports what it handed on (`consumed`), so one stalled reader holds back its own generation
and no other.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from proto import verifier_pb2
from proto.status import Fallbacks, reported_status

# one generation's messages as a Generate call of the stream request's `generate` would send them: those it yields,
# then (or instead) those it puts into its slot
Generation = Callable[[verifier_pb2.VerifierStreamRequest, "StreamSlot"],
                      AsyncGenerator[verifier_pb2.VerifierGenerateStep, None]]

# NOTE: events a generation may run ahead of its stream's writes (a Generate call's too): a reader that stalls holds
# the producer here instead of letting finished steps (and their features) pile up. Roomy: a write that lags a step
# or two behind (the gateway's loop was busy) must not stall the drafting of the next steps.
RUN_AHEAD_EVENTS = 16


class Outbox:
    """The events not yet sent. A generation waits before adding more while it has `limit` events unsent, or, when
    its caller gave it a window, that many unconsumed (queued or sent, and not yet reported handed on): a stalled
    reader holds its producer instead of letting events pile up, here or in the caller."""

    def __init__(self, limit: int = RUN_AHEAD_EVENTS, on_room: Callable[[], None] = lambda: None):
        """on_room: called whenever generations may have room again (events taken, credit given back), for those
        that put without waiting (StreamSlot)."""
        self.limit, self.on_room = limit, on_room
        self.events: list[verifier_pb2.VerifierStreamEvent] = []
        self.ready = asyncio.Event()
        self.unsent: collections.Counter[int] = collections.Counter()
        self.windows: dict[int, int] = {}  # request id -> its window, for generations that have one
        self.unconsumed: collections.Counter[int] = collections.Counter()
        self.room: dict[int, asyncio.Event] = {}

    def open(self, request_id: int, window: int) -> None:
        """A generation starts; window 0: only `limit` bounds it (a gateway that sends no credit)."""
        if window:
            self.windows[request_id] = window

    def close(self, request_id: int) -> None:
        """The generation ended: its credit goes (a late `consumed` is ignored)."""
        self.windows.pop(request_id, None)
        self.unconsumed.pop(request_id, None)
        self.room.pop(request_id, None)

    def full(self, request_id: int) -> bool:
        window = self.windows.get(request_id, 0)
        return self.unsent[request_id] >= self.limit or (window > 0 and self.unconsumed[request_id] >= window)

    async def put(self, event: verifier_pb2.VerifierStreamEvent) -> None:
        request_id = event.request_id
        while self.full(request_id):
            room = self.room.setdefault(request_id, asyncio.Event())
            room.clear()
            await room.wait()
        self.put_nowait(event)

    def put_nowait(self, event: verifier_pb2.VerifierStreamEvent) -> None:
        self.events.append(event)
        self.unsent[event.request_id] += 1
        if event.request_id in self.windows:
            self.unconsumed[event.request_id] += 1
        self.ready.set()

    def consumed(self, request_id: int, count: int) -> None:
        """The caller handed `count` more of the generation's events on; more than it has out counts as all."""
        if request_id in self.windows:
            self.unconsumed[request_id] = max(0, self.unconsumed[request_id] - count)
            self._wake(request_id)
            self.on_room()

    def wake(self) -> None:
        self.ready.set()

    def _wake(self, request_id: int) -> None:
        if request_id in self.room and not self.full(request_id):
            self.room.pop(request_id).set()

    async def take(self) -> list[verifier_pb2.VerifierStreamEvent]:
        """Every event queued so far; waits for one, or for `wake` (then it may return none)."""
        if not self.events:
            self.ready.clear()
            await self.ready.wait()
        events, self.events = self.events, []
        self.unsent.subtract(event.request_id for event in events)
        for request_id in [r for r, count in self.unsent.items() if count <= 0]:
            del self.unsent[request_id]
        for request_id in list(self.room):
            self._wake(request_id)
        self.on_room()
        return events


class StreamSlot:
    """One generation's place on the stream, for events put without waiting: its owner checks `has_room` first
    and is told through the outbox's `on_room` when there is room again."""

    def __init__(self, outbox: Outbox, request_id: int):
        self.outbox, self.request_id = outbox, request_id

    def put(self, step: verifier_pb2.VerifierGenerateStep) -> None:
        self.outbox.put_nowait(verifier_pb2.VerifierStreamEvent(request_id=self.request_id, step=step))

    def has_room(self) -> bool:
        return not self.outbox.full(self.request_id)


def error_event(request_id: int, code: grpc.StatusCode, message: str) -> verifier_pb2.VerifierStreamEvent:
    return verifier_pb2.VerifierStreamEvent(
        request_id=request_id, error=verifier_pb2.VerifierStreamError(code=code.value[0], message=message))


async def serve_generations(requests: AsyncIterator[verifier_pb2.VerifierStreamRequest], generate: Generation,
                            fallbacks: Fallbacks, on_room: Callable[[], None] = lambda: None
                            ) -> AsyncIterator[verifier_pb2.VerifierStreamReply]:
    """The replies of one GenerateStream call; `generate` runs one generation (a Generate call's messages);
    `on_room`: see Outbox."""

    outbox, running, expired = Outbox(on_room=on_room), {}, set()

    async def run(request_id: int, request: verifier_pb2.VerifierStreamRequest) -> None:
        try:
            # NOTE: closed here, not when collected: a generation cancelled while it waits in `put` (for credit, most
            # often) sits at a yield, and its cleanup (the session's release) must run before the stream moves on
            async with contextlib.aclosing(generate(request, StreamSlot(outbox, request_id))) as steps:
                async for step in steps:
                    await outbox.put(verifier_pb2.VerifierStreamEvent(request_id=request_id, step=step))
        except asyncio.CancelledError:
            if request_id not in expired:
                raise
            outbox.put_nowait(error_event(request_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        except Exception as error:  # noqa: BLE001 - the generation's status, sent as its last event
            outbox.put_nowait(error_event(request_id, *reported_status(error, fallbacks, "GenerateStream")))
        finally:
            expired.discard(request_id)
            running.pop(request_id, None)
            outbox.close(request_id)
            outbox.wake()  # NOTE: the writer may be waiting for the last generation to end

    def expire(request_id: int, task: asyncio.Task) -> None:
        if running.get(request_id) is task:
            expired.add(request_id)
            task.cancel()

    async def read() -> None:
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "generate" and message.request_id not in running:
                outbox.open(message.request_id, message.window)
                task = running[message.request_id] = asyncio.create_task(run(message.request_id, message))
                if message.timeout_s > 0:
                    asyncio.get_running_loop().call_later(message.timeout_s, expire, message.request_id, task)
            elif kind == "generate":
                outbox.put_nowait(error_event(message.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                              f"request_id: {message.request_id} is already running on this stream"))
            elif kind == "cancel" and message.request_id in running:
                running[message.request_id].cancel()
            elif kind == "consumed":
                outbox.consumed(message.request_id, message.consumed)

    reader = asyncio.create_task(read())
    reader.add_done_callback(lambda _: outbox.wake())
    try:
        while not (reader.done() and not running and not outbox.events):  # NOTE: the caller half-closed
            events = await outbox.take()
            if events:
                yield verifier_pb2.VerifierStreamReply(events=events)
        reader.result()  # NOTE: a broken request stream raises here
    finally:
        tasks = [reader, *running.values()]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
