"""The Drafter gRPC servicer: many verifier streams, one batched draft per forward.

A verifier sends the requests of many sessions as one batch message (once Info says the replica takes them),
and gets their replies back as one. Steps that arrive while the drafter is idle (nothing queued, no reply being
written) are drafted by their stream's reader at once, together, and their replies written straight to the
stream: no hand-off to another task, each of which costs a loop turn on every decode step's round trip. A step
that arrives while replies are still being written, or while others wait, queues in one scheduler; whatever is
queued then forms the next batch, so streams that arrive together still share a forward. A newer step for a
session whose older step is still queued absorbs it (its committed tokens are kept, its reply is dropped as
stale).

Drafts run on the event loop itself: a hop to a worker thread and back (GIL hand-overs next to gRPC's
poller) cost more than an n-gram draft or a graph-replayed DFlash forward. Nothing else needs the loop
while a draft runs: messages arriving meanwhile wait in gRPC and form the next batch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import grpc
import torch

from drafter_service.drafter import Drafter
from modeling.speculation import DrafterSeed, DraftStep
from modeling.tree import DraftTree
from proto import drafter_pb2, drafter_pb2_grpc
from proto.status import status_of
from proto.tensors import from_proto

log = logging.getLogger(__name__)

# NOTE: replies waiting for a verifier that reads slowly. Past this many the stream's reader stops taking
# requests until writes catch up (backpressure through gRPC flow control), so they cannot pile up.
PENDING_REPLIES_LIMIT = 256


class _TreeReply(NamedTuple):
    """A drafted tree waiting to be written: it goes into its slot of the outgoing message field by field when the
    message is built (nested message constructors copy every level, once more into a batch)."""

    session_id: str
    step: int
    tree: DraftTree
    replica_id: str
    draft_ms: float

    def fill(self, message: drafter_pb2.DrafterReply) -> None:
        reply = message.tree
        reply.session_id, reply.step, reply.replica_id, reply.draft_ms = (
            self.session_id, self.step, self.replica_id, self.draft_ms)
        tree, out = self.tree, reply.tree
        out.tokens.extend(tree.tokens)
        out.parents.extend(tree.parents)
        out.depths.extend(tree.depths)
        out.logprobs.extend(tree.logprobs)


_Reply = drafter_pb2.DrafterReply | _TreeReply


def _message(reply: _Reply) -> drafter_pb2.DrafterReply:
    if isinstance(reply, drafter_pb2.DrafterReply):
        return reply
    message = drafter_pb2.DrafterReply()
    reply.fill(message)
    return message


class _Stream:
    """One verifier's Draft stream: the sessions it opened, and its replies, written one at a time in order
    (gRPC allows one write in flight per call); replies that wait together go as one batch once the verifier has
    sent one (each message costs the verifier's event loop tens of microseconds)."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self.context = context
        self.batches = False
        self.opened: set[str] = set()
        self.pending: deque[_Reply] = deque()
        self.writing = False
        self.writer: asyncio.Task | None = None
        self.ended = False
        self.drained = asyncio.Event()

    async def room(self) -> None:
        """Wait until the replies under way are below the limit."""
        while len(self.pending) >= PENDING_REPLIES_LIMIT and not self.ended:
            self.drained.clear()
            await self.drained.wait()

    async def write(self, *replies: _Reply) -> None:
        """The reader's path: write now, or behind the write under way (which then sends these too)."""
        self.pending.extend(replies)
        if not self.writing:
            self.writing = True
            await self._write_pending()

    def write_soon(self, reply: _Reply) -> None:
        """The scheduler's path: it serves many streams, so a task does the waiting."""
        if self.ended:
            return
        self.pending.append(reply)
        if not self.writing:
            self.writing = True
            self.writer = asyncio.create_task(self._write_in_background())

    async def _write_pending(self) -> None:
        try:
            while self.pending:
                await self.context.write(self._next_message())
                if len(self.pending) < PENDING_REPLIES_LIMIT:
                    self.drained.set()
        finally:
            self.writing = False
            self.drained.set()

    def _next_message(self) -> drafter_pb2.DrafterReply:
        if not self.batches or len(self.pending) == 1:
            return _message(self.pending.popleft())
        pending, self.pending = self.pending, deque()
        message = drafter_pb2.DrafterReply()
        replies = message.batch.replies
        for reply in pending:
            if isinstance(reply, _TreeReply):
                reply.fill(replies.add())
            else:
                replies.append(reply)
        return message

    async def _write_in_background(self) -> None:
        try:
            await self._write_pending()
        except Exception as error:  # noqa: BLE001 - the stream broke; its reader ends it
            log.debug("reply not written: %r", error)

    async def finish(self) -> None:
        """The verifier closed its side: send the replies under way, take no more."""
        self.ended = True
        if self.writer is not None:
            await self.writer

    def end(self) -> None:
        """The call is over (finished or cancelled): a write still under way has no stream left."""
        self.ended = True
        self.drained.set()
        if self.writer is not None:
            self.writer.cancel()


@dataclass
class _Queued:
    step: DraftStep
    stream: _Stream


def _merge(older: DraftStep, newer: DraftStep) -> DraftStep:
    features = None
    if older.features is not None or newer.features is not None:
        parts = [f for f in (older.features, newer.features) if f is not None]
        features = torch.cat(parts) if len(parts) > 1 else parts[0]
    return replace(newer, committed=older.committed + newer.committed, features=features, position=older.position)


def _step_from_pb(message: drafter_pb2.DrafterStep) -> DraftStep:
    """ValueError for malformed features."""
    return DraftStep(message.session_id, message.step, message.committed_token_ids[:], from_proto(message.features),
                     message.root_token_id, message.position, message.tree_budget)


# NOTE: a malformed tensor or position from the verifier raises a plain ValueError deep in the drafter.
FALLBACKS = ((ValueError, grpc.StatusCode.INVALID_ARGUMENT),)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter, replica_id: str):
        self.drafter, self.replica_id = drafter, replica_id
        self.queued: dict[str, _Queued] = {}
        self.wakeup = asyncio.Event()
        self.streams: set[_Stream] = set()
        self.open_ids: set[str] = set()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._draft_forever(), name="draft-scheduler")

    def _error(self, session_id: str, step: int, error: Exception) -> drafter_pb2.DrafterReply:
        """The session's error reply; the stream and the other sessions on it go on."""
        code, details = status_of(error, FALLBACKS)
        if code == grpc.StatusCode.INTERNAL:
            log.error("session %s, step %d: draft failed", session_id, step, exc_info=error)
        return drafter_pb2.DrafterReply(error=drafter_pb2.DrafterSessionError(
            session_id=session_id, step=step, code=code.value[0], message=details, replica_id=self.replica_id))

    # ---- the stream ------------------------------------------------------------------------------------

    async def Draft(self, request_iterator: AsyncIterator[drafter_pb2.DrafterRequest],
                    context: grpc.aio.ServicerContext) -> None:
        stream = _Stream(context)
        self.streams.add(stream)
        try:
            async for request in request_iterator:
                await stream.room()
                if request.WhichOneof("kind") == "batch":
                    stream.batches = True
                    await self._handle(request.batch.requests, stream)
                else:
                    await self._handle((request,), stream)
            await stream.finish()
        finally:
            stream.end()
            self.streams.discard(stream)
            for session_id in list(stream.opened):  # the verifier is gone: its mirrors are orphans
                self._close(session_id, stream.opened)

    def _close(self, session_id: str, opened: set[str]) -> None:
        self.queued.pop(session_id, None)
        opened.discard(session_id)
        self.open_ids.discard(session_id)
        self.drafter.close(session_id)

    async def _open(self, message: drafter_pb2.DrafterOpen, stream: _Stream) -> None:
        """Open (or replace) the session's mirror; say so where asked (the verifier steps without drafts until
        then)."""
        self.queued.pop(message.session_id, None)  # steps for the old mirror are stale
        started = time.perf_counter()
        try:
            seed = DrafterSeed(list(message.token_ids), from_proto(message.features), message.start_position)
            self.drafter.open(message.session_id, seed)
        except Exception as error:  # noqa: BLE001 - becomes the session's error reply
            await stream.write(self._error(message.session_id, 0, error))
            return
        stream.opened.add(message.session_id)
        self.open_ids.add(message.session_id)
        if message.acknowledge:
            await stream.write(drafter_pb2.DrafterReply(opened=drafter_pb2.DrafterOpened(
                session_id=message.session_id, replica_id=self.replica_id,
                open_ms=(time.perf_counter() - started) * 1e3)))

    async def _handle(self, requests: Sequence[drafter_pb2.DrafterRequest], stream: _Stream) -> None:
        """Requests in order; the steps among them are drafted together."""
        steps = []
        for request in requests:
            kind = request.WhichOneof("kind")
            if kind == "step":
                try:
                    steps.append(_step_from_pb(request.step))
                except ValueError as error:
                    await stream.write(self._error(request.step.session_id, request.step.step, error))
            elif kind == "open":
                await self._open(request.open, stream)
            elif kind == "close":
                self._close(request.close.session_id, stream.opened)
        if steps and self._idle() and len({step.session_id for step in steps}) == len(steps):
            await stream.write(*(reply for _, reply in self._draft([_Queued(step, stream) for step in steps])))
        else:
            for step in steps:
                self._enqueue(step, stream)

    def _idle(self) -> bool:
        """Nothing queued and no reply being written: a step now has no batch to join."""
        return not self.queued and not any(stream.writing for stream in self.streams)

    def _enqueue(self, step: DraftStep, stream: _Stream) -> None:
        older = self.queued.get(step.session_id)
        if older is not None:
            step = _merge(older.step, step)
        self.queued[step.session_id] = _Queued(step, stream)
        self.wakeup.set()

    # ---- the scheduler -----------------------------------------------------------------------------------

    async def _draft_forever(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            batch, self.queued = list(self.queued.values()), {}
            if batch:
                for stream, reply in self._draft(batch):
                    stream.write_soon(reply)  # NOTE: its writer task runs before a later step can wake us again

    def _draft(self, batch: list[_Queued]) -> list[tuple[_Stream, _Reply]]:
        """One forward for the batch; a failure is retried one session at a time, to isolate the one at fault."""
        started = time.perf_counter()
        try:
            trees = self.drafter.draft([queued.step for queued in batch])
        except Exception as error:  # noqa: BLE001 - becomes a per-session error reply
            if len(batch) > 1:
                return [reply for queued in batch for reply in self._draft([queued])]
            step = batch[0].step
            return [(batch[0].stream, self._error(step.session_id, step.step, error))]
        draft_ms = (time.perf_counter() - started) * 1e3
        return [(queued.stream, _TreeReply(queued.step.session_id, queued.step.step, tree, self.replica_id, draft_ms))
                for queued, tree in zip(batch, trees)]

    async def Info(self, request, context) -> drafter_pb2.DrafterInfoReply:
        info = self.drafter.info
        return drafter_pb2.DrafterInfoReply(
            replica_id=self.replica_id, drafter_kind=info.kind, block_size=info.block_size,
            context_window=info.context_window or 0, target_layer_ids=list(info.target_layer_ids),
            feature_dim=info.feature_dim, max_tree_budget=info.max_budget, open_sessions=len(self.open_ids),
            dtype=info.dtype, device=info.device, cuda_graphs=self.drafter.captured_graphs, batches=True,
            open_acks=True, max_sessions=info.max_sessions)
