"""The verifier's side of the drafters: one multiplexed Draft stream per replica, each session pinned to
one replica and re-seeded on another when its replica disappears. Every failure degrades to a step
without speculation (still exact), never to an error for the client."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import grpc
import torch
from prometheus_client import Counter

from modeling.speculation import DraftStep, drafter_seed
from modeling.tree import DraftTree
from proto import drafter_pb2, drafter_pb2_grpc
from proto.security import NO_AUTH, InternalAuth
from verifier_service.drafter_messages import (
    Outgoing,
    batch_request,
    close_request,
    open_request,
    step_request,
    tree_from_reply,
)
from verifier_service.metrics import VerifierMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


def resolve_targets(target: str) -> list[str]:
    """`host:port,host:port` as given, or `dns:///name:port` resolved to every address behind the name
    (one per scaled replica)."""
    if not target.startswith("dns:///"):
        return [t.strip() for t in target.split(",") if t.strip()]
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({f"{info[4][0]}:{port}" for info in infos})


# NOTE: requests waiting to be written to one replica's stream. A healthy replica drains them at once; a
# stalled one would otherwise grow the queue by a request per session and step.
OUTBOX_LIMIT = 1024
# NOTE: the most one batch message of requests holds. Batching pays for many small steps; a seed's features can
# take megabytes, and a batch of them would pass the 64 MB message limit (proto/serving.py).
BATCH_BYTES = 1 << 20
# NOTE: how long a session whose Open was not acknowledged yet steps without drafts; past this its steps go behind
# the Open anyway (a replica handles its stream's requests in order), as with a replica that does not acknowledge
OPEN_ACK_PATIENCE_S = 10.0


async def within(timeout_s: float, awaitable: Awaitable[T]) -> T:
    """`awaitable`, cancelled past `timeout_s` (asyncio.TimeoutError); on Python 3.11+ without a task of its own,
    which would cost a turn of the loop before it starts."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)


class ReplicaLink:
    """One replica: a channel, its Draft stream, and the replies awaited on it.

    `alive` while the stream is open; `healthy` unless a reply timed out, after which no step waits on the
    replica until a probe (Info) answers again: a frozen replica costs one timeout, not one per step."""

    def __init__(self, address: str, on_session_error: Callable[[str], None], on_lost: Callable[[], None],
                 channel_options: Sequence[tuple[str, int]] = (), auth: InternalAuth = NO_AUTH,
                 on_opened: Callable[[ReplicaLink, str], None] = lambda link, session_id: None):
        self.address = address
        self.channel = auth.channel(address, channel_options)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.outbox: collections.deque[Outgoing] = collections.deque()
        self.call: grpc.aio.StreamStreamCall | None = None
        self.writing = False  # a write is under way on the stream (gRPC allows one at a time)
        self.writer: asyncio.Future | None = None  # the task that writes what send() queued, unless done
        self.waiting: dict[tuple[str, int], tuple[_Round, int]] = {}  # a step's round and its place in it
        self.on_session_error, self.on_lost, self.on_opened = on_session_error, on_lost, on_opened
        self.info: drafter_pb2.DrafterInfoReply | None = None
        self.alive = False
        self.healthy = True
        self.reader: asyncio.Task | None = None
        self.prober: asyncio.Task | None = None
        self.orphans: set[str] = set()  # sessions moved away while it did not answer: close their mirrors
        self.mirrors: set[str] = set()  # sessions holding one of its slots, as far as this verifier knows

    async def connect(self, timeout_s: float) -> drafter_pb2.DrafterInfoReply:
        self.info = await self.stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout_s)
        self.call = self.stub.Draft()  # NOTE: written to with write(): see write_queued
        self.alive = True
        self.reader = asyncio.create_task(self._read(), name=f"drafter-{self.address}")
        return self.info

    def send(self, outgoing: Outgoing, write_soon: bool = True) -> None:
        """Queue a request; raises asyncio.QueueFull when the replica has stopped reading. A task writes it in the
        loop's next turn, unless the sender says it writes it itself (a draft round: `flush`)."""
        if len(self.outbox) >= OUTBOX_LIMIT:
            raise asyncio.QueueFull
        self.outbox.append(outgoing)
        if write_soon:
            self._write_soon()

    def _write_soon(self) -> None:
        if self.writer is None or self.writer.done():
            self.writer = asyncio.ensure_future(self.write_queued())

    async def flush(self, timeout_s: float) -> None:
        """A draft round's requests, written by the round itself: left to the writer task, they waited a turn of the
        loop behind whatever else was ready (~0.17 ms a round on the H100 host, inside every decode step). Only
        what fits one message: a seed among them goes to the writer task, whose write may outlast the round. A
        write the replica does not take within `timeout_s` is cancelled, and gRPC then ends the whole call (a
        message cannot be taken back halfway): the link is lost, and its sessions are seeded elsewhere."""
        if self.writing or self.call is None:
            return
        if sum(outgoing.size for outgoing in self.outbox) > BATCH_BYTES:
            self._write_soon()
            return
        try:
            await within(timeout_s, self.write_queued())
        except asyncio.TimeoutError:
            log.warning("drafter %s took no request for %.1f s: its stream ends", self.address, timeout_s)

    async def write_queued(self) -> None:
        """Write what is queued: those that wait together in one batch message where the replica takes them (the
        sessions of a draft round queue theirs at once), up to BATCH_BYTES a message (an Open carries its seed's
        features, and a batch must stay far below the message limit); one write at a time on the stream, and
        what queues meanwhile goes with the next."""
        if self.writing or self.call is None:
            return
        self.writing = True
        try:
            while self.outbox and self.alive:
                await self.call.write(self._next_message())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
            log.debug("drafter %s: stream closed to writes: %r", self.address, error)  # NOTE: its reader ends it
            self.outbox.clear()
        finally:
            self.writing = False

    def _next_message(self) -> drafter_pb2.DrafterRequest:
        first = self.outbox.popleft()
        if not (self.info and self.info.batches) or not self.outbox:
            return first.request
        batch, size = [first.request], first.size
        while self.outbox and size + self.outbox[0].size <= BATCH_BYTES:
            more = self.outbox.popleft()
            batch.append(more.request)
            size += more.size
        return batch[0] if len(batch) == 1 else batch_request(batch)

    async def _read(self) -> None:
        try:
            async for reply in self.call:
                for each in reply.batch.replies if reply.WhichOneof("kind") == "batch" else (reply,):
                    self._deliver(each)
        except grpc.aio.AioRpcError as error:
            log.warning("drafter %s lost: %s", self.address, error.code())
        finally:
            was_alive, self.alive = self.alive, False
            lost = ConnectionError(f"drafter {self.address} lost")
            for waiting, index in self.waiting.values():
                waiting.answer(index, lost)
            self.waiting.clear()
            if was_alive:
                self.on_lost()

    def _deliver(self, reply: drafter_pb2.DrafterReply) -> None:
        kind = reply.WhichOneof("kind")
        message = getattr(reply, kind)
        if kind == "opened":
            self.on_opened(self, message.session_id)
            return
        asked = self.waiting.pop((message.session_id, message.step), None)
        if asked is not None:
            asked[0].answer(asked[1], reply)
        elif kind == "error":
            self.on_session_error(message.session_id)  # a failed Open or a stale step's error

    def usable(self) -> bool:
        return self.alive and self.healthy

    def has_room(self, session_id: str) -> bool:
        """Whether the replica can take the session's mirror (its Info's max_sessions; one it holds it has)."""
        limit = self.info.max_sessions if self.info is not None else 0
        return not limit or len(self.mirrors) < limit or session_id in self.mirrors

    def probe_until_healthy(self, interval_s: float, timeout_s: float, on_healthy: Callable[[], None]) -> None:
        """Stop using the replica; ask for its Info every `interval_s` until it answers within `timeout_s`."""
        self.healthy = False
        if self.prober is None or self.prober.done():
            self.prober = asyncio.create_task(self._probe(interval_s, timeout_s, on_healthy),
                                              name=f"probe-{self.address}")

    async def _probe(self, interval_s: float, timeout_s: float, on_healthy: Callable[[], None]) -> None:
        while self.alive:
            await asyncio.sleep(interval_s)
            try:
                await self.stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError:
                continue
            self.healthy = True
            on_healthy()
            return

    def request(self, session_id: str, step: int, request: Outgoing, waiting: _Round) -> int:
        """Queue a step's request for the round's `flush`; `waiting` gets its reply (ConnectionError when the
        stream ends first) at the returned index. Raises asyncio.QueueFull when the replica has stopped reading."""
        self.send(request, write_soon=False)
        index = waiting.expect()
        self.waiting[(session_id, step)] = (waiting, index)
        return index

    def forget(self, session_id: str, step: int) -> None:
        """No one waits for the step's reply any more: a late one is stale and dropped."""
        self.waiting.pop((session_id, step), None)

    async def close(self) -> None:
        self.alive = False
        if self.prober is not None:
            self.prober.cancel()
        if self.call is not None and not self.writing:  # NOTE: the end of the stream closes every mirror
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                await self.call.done_writing()
        await self.channel.close()
        await asyncio.gather(*(task for task in (self.reader, self.prober, self.writer) if task),
                             return_exceptions=True)


class _Round:
    """The replies one `draft_all` waits for, by index: a ConnectionError where the stream ended first, None while
    unanswered. One future for the round, done once every reply is in: a future per step would wake the loop once
    per reply."""

    def __init__(self) -> None:
        self.replies: list[drafter_pb2.DrafterReply | ConnectionError | None] = []
        self.left = 0
        self.done = asyncio.get_running_loop().create_future()

    def expect(self) -> int:
        self.replies.append(None)
        self.left += 1
        return len(self.replies) - 1

    def answer(self, index: int, reply: drafter_pb2.DrafterReply | ConnectionError) -> None:
        self.replies[index] = reply
        self.left -= 1
        if not self.left and not self.done.done():
            self.done.set_result(None)


class FeatureWindow:
    """The target features of a session's latest committed tokens, for its next seed: the last W rows (all rows
    without a window). Steps add a few rows each; they are joined only when a seed reads them or they reach twice
    the window. Joining at every step copied the whole window per session-step (42 MB for a Qwen3-8B-shaped DFlash
    drafter: ~1 ms of the GPU's time per step at 64 sessions)."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.rows = 0

    def add(self, features: torch.Tensor, window: int | None) -> None:
        if self.chunks:
            features = features.to(self.chunks[0].dtype)
        self.chunks.append(features)
        self.rows += features.shape[0]
        if window is not None and self.rows >= 2 * window:
            self.latest(window)

    def latest(self, window: int | None) -> torch.Tensor | None:
        """[<= W, F], or None before any row."""
        if not self.chunks:
            return None
        joined = self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)
        if window is not None:
            joined = joined[-window:]
        self.chunks, self.rows = [joined], joined.shape[0]
        return joined


@dataclass
class SessionDraftState:
    tokens: Callable[[], list[int]]  # the session's committed tokens (KV contents), read when re-seeding
    features: FeatureWindow
    link: ReplicaLink | None = None
    opening: float | None = None  # when its Open went to `link`, until the replica acknowledged it
    synced: int = 0  # the committed positions its mirror holds, as of the last request sent to `link`
    parked: float | None = None  # when its last generation ended with its mirror open, until it drafts again
    # NOTE: a generation numbers its steps from 0, a mirror refuses a step number it has seen: a mirror kept from
    # the last turn takes this turn's numbers past the last one it got
    step_offset: int = 0
    last_step: int = -1  # the step number of the last request sent


@dataclass
class _Asked:
    """A step's request in flight: its reply goes to `index` of its round."""

    state: SessionDraftState
    link: ReplicaLink
    session_id: str
    step: int
    index: int


class DrafterPool:
    def __init__(self, target: str, metrics: VerifierMetrics, timeout_s: float = 1.0, refresh_s: float = 2.0,
                 channel_options: Sequence[tuple[str, int]] = (), auth: InternalAuth = NO_AUTH):
        """channel_options: of every replica's channel (keepalive, so a frozen replica's stream breaks); auth:
        the deployment's credentials, shown on every call."""
        self.target, self.metrics, self.timeout_s, self.refresh_s = target, metrics, timeout_s, refresh_s
        self.channel_options, self.auth = tuple(channel_options), auth
        self.links: dict[str, ReplicaLink] = {}
        self.sessions: dict[str, SessionDraftState] = {}
        self.round_robin = itertools.count()
        self.info: drafter_pb2.DrafterInfoReply | None = None
        self.on_info: Callable[[drafter_pb2.DrafterInfoReply], None] = lambda info: None
        self.task: asyncio.Task | None = None
        self.refreshing = asyncio.Lock()
        self.tree_counters: dict[str, Counter] = {}  # NOTE: per replica; labels() per tree costs a lookup and a lock

    # ---- replicas ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.create_task(self._refresh_forever(), name="drafter-refresh")

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await asyncio.gather(*(link.close() for link in self.links.values()), return_exceptions=True)

    def _reconnect_soon(self) -> None:
        """A stream ended (a replica died, or aged its connection out): reconnect now, not at the next tick."""
        asyncio.get_running_loop().create_task(self.refresh())

    async def refresh(self) -> None:
        """Connect replicas that appeared (or came back); forget the ones that are gone."""
        async with self.refreshing:
            await self._refresh()

    async def _refresh(self) -> None:
        for address in resolve_targets(self.target):
            link = self.links.get(address)
            if link is not None and link.alive:
                continue
            if link is not None:
                await link.close()
            link = ReplicaLink(address, self._session_error, self._reconnect_soon, self.channel_options, self.auth,
                               self._opened)
            try:
                info = await link.connect(self.timeout_s)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                await link.close()
                self.links.pop(address, None)
                continue
            self.links[address] = link
            if self.info is None:
                self.info = info
                self.on_info(info)
            log.info("drafter %s connected (%s)", address, info.replica_id)

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    def usable_links(self) -> list[ReplicaLink]:
        return [link for link in self.links.values() if link.usable()]

    def _stalled(self, link: ReplicaLink) -> None:
        """A step waited in vain (or the outbox is full): no step waits on the replica until it answers again."""
        if not link.healthy:
            return
        log.warning("drafter %s did not answer within %.1f s: steps go on without it until it answers a probe",
                    link.address, self.timeout_s)
        self.metrics.drafter_stalls.inc()
        link.probe_until_healthy(self.refresh_s, self.timeout_s, lambda: self._recovered(link))

    def _recovered(self, link: ReplicaLink) -> None:
        log.info("drafter %s answers again", link.address)
        for session_id in link.orphans:
            state = self.sessions.get(session_id)
            if state is None or state.link is not link:
                self._send_close(link, session_id)
        link.orphans.clear()

    def _forget_mirror(self, link: ReplicaLink, session_id: str) -> None:
        """The session's mirror on `link` is no longer used: close it now, or once the replica answers again."""
        if link.usable():
            self._send_close(link, session_id)
        elif link.alive:
            link.orphans.add(session_id)

    @staticmethod
    def _send_close(link: ReplicaLink, session_id: str) -> None:
        link.mirrors.discard(session_id)
        with contextlib.suppress(asyncio.QueueFull):  # NOTE: the stream's end closes every mirror anyway
            link.send(close_request(session_id))

    def _session_error(self, session_id: str) -> None:
        state = self.sessions.get(session_id)
        if state is not None:
            if state.link is not None:
                state.link.mirrors.discard(session_id)  # NOTE: a failed Open took no slot; a lost mirror holds none
            state.link, state.opening = None, None  # re-seed before the next step

    def _opened(self, link: ReplicaLink, session_id: str) -> None:
        state = self.sessions.get(session_id)
        if state is not None and state.link is link and state.opening is not None:
            self.metrics.seed_seconds.observe(time.perf_counter() - state.opening)
            state.opening = None

    # ---- sessions ---------------------------------------------------------------------------------

    @property
    def window(self) -> int | None:
        return (self.info.context_window or None) if self.info else None

    def attach(self, session_id: str, tokens: Callable[[], list[int]], features: torch.Tensor | None) -> None:
        """Track a session; its mirror opens on a replica at its first draft."""
        self.sessions[session_id] = SessionDraftState(tokens, FeatureWindow())
        self.add_features(session_id, features)

    def add_features(self, session_id: str, features: torch.Tensor | None) -> None:
        if features is not None:
            self.sessions[session_id].features.add(features, self.window)

    def features(self, session_id: str) -> torch.Tensor | None:
        """The features of the session's latest committed tokens, W of them at most (what its seed carries)."""
        return self.sessions[session_id].features.latest(self.window)

    def is_open(self, session_id: str) -> bool:
        """Whether the session's mirror is open on a usable replica (its next draft sends no seed)."""
        state = self.sessions.get(session_id)
        return state is not None and state.link is not None and state.link.usable()

    def opening(self, session_id: str) -> bool:
        """Whether the session's Open is on its way on a usable replica that will acknowledge it: its steps go
        without drafts meanwhile, rather than wait for the seed (0.3 s for 42 MB of DFlash features)."""
        state = self.sessions.get(session_id)
        return (state is not None and state.opening is not None and self.is_open(session_id)
                and time.perf_counter() - state.opening < OPEN_ACK_PATIENCE_S)

    def open_soon(self, session_id: str) -> None:
        """Send the session's seed now, ahead of its first draft (a generation's first step needs none), unless its
        mirror is open and can take the tokens since (`_caught_up`); with no usable replica its first draft tries
        again."""
        state = self.sessions.get(session_id)
        if state is not None and not (self.is_open(session_id)
                                      and self._resumable(state, len(state.tokens()) - state.synced)):
            self._seed(session_id, state, ahead=True)

    def park(self, session_id: str) -> None:
        """End of a generation of a session that stays: its mirror stays open, so the next turn's first draft
        carries the tokens since (its prompt, the features its prefill computed) rather than a seed of the W latest
        tokens' features (42 MB for a Qwen3-8B-shaped DFlash drafter); a replica that runs out of room closes the
        mirrors parked longest first."""
        state = self.sessions.get(session_id)
        if state is not None and state.link is not None:
            state.parked, state.step_offset = time.perf_counter(), state.last_step + 1

    def detach(self, session_id: str) -> None:
        state = self.sessions.pop(session_id, None)
        if state is not None and state.link is not None:
            self._forget_mirror(state.link, session_id)

    def _seed(self, session_id: str, state: SessionDraftState, ahead: bool = False) -> bool:
        """Open the session's mirror on a replica with room for it; none has: False, the session steps without drafts
        (an Open past a replica's max_sessions would fail, and the next step would send its seed again). `ahead` of
        its drafts, a replica that acknowledges Opens is asked to, and the session is `opening` until it does;
        otherwise the seed goes in front of a step."""
        links = [link for link in self.usable_links() if link.has_room(session_id)]
        evicted = None if links else self._evict_parked()
        if evicted is not None:
            links = [evicted]
        if not links:
            return False
        old = state.link
        link = old if old in links else links[next(self.round_robin) % len(links)]  # NOTE: an Open replaces a mirror
        if old is not None and old is not link:
            self._forget_mirror(old, session_id)
        uses_features = bool(self.info and self.info.feature_dim)
        seed = drafter_seed(state.tokens(), state.features.latest(self.window), uses_features, self.window)
        acknowledge = ahead and link.info is not None and link.info.open_acks
        try:
            link.send(open_request(session_id, seed, acknowledge))
        except asyncio.QueueFull:
            self._stalled(link)
            return False
        state.link, state.opening = link, time.perf_counter() if acknowledge else None
        state.synced, state.parked = seed.start_position + len(seed.tokens), None
        link.mirrors.add(session_id)
        if old is not None and old is not link:
            self.metrics.reseeds.inc()
        return True

    def _evict_parked(self) -> ReplicaLink | None:
        """Close the mirror parked longest on a usable replica to make room there (its session is between turns;
        its next turn seeds again); that replica, or None where none is parked."""
        parked = [(state.parked, session_id) for session_id, state in self.sessions.items()
                  if state.parked is not None and state.link is not None and state.link.usable()]
        if not parked:
            return None
        _, session_id = min(parked)
        state = self.sessions[session_id]
        link = state.link
        self._forget_mirror(link, session_id)
        state.link = state.parked = None
        self.metrics.mirror_evictions.inc()
        return link

    def _caught_up(self, state: SessionDraftState, step: DraftStep) -> DraftStep | None:
        """The step with the tokens its mirror has not seen in front of its own (a parked mirror: the last turn's
        tail and this turn's prompt), their features the window's latest rows; None where the window no longer
        holds them all (a prompt longer than it, which a seed covers as cheaply) or the tokens disagree."""
        tokens = state.tokens()
        missing = tokens[state.synced:]
        if tokens[step.position:] != step.committed or not self._resumable(state, len(missing)):
            return None
        features = None
        if self.info is not None and self.info.feature_dim:
            rows = state.features.latest(self.window)
            features = rows[rows.shape[0] - len(missing):]
        return replace(step, committed=missing, features=features, position=state.synced)

    def _resumable(self, state: SessionDraftState, missing: int) -> bool:
        """Whether the session's feature window holds the features of the `missing` tokens its mirror has not
        seen."""
        if self.info is None or not self.info.feature_dim:
            return True
        return min(state.features.rows, self.window or state.features.rows) >= missing

    def _trees_from(self, replica_id: str) -> Counter:
        counter = self.tree_counters.get(replica_id)
        if counter is None:
            counter = self.tree_counters[replica_id] = self.metrics.trees.labels(replica_id)
        return counter

    async def draft(self, step: DraftStep) -> DraftTree | None:
        """One session's tree (see `draft_all`)."""
        return (await self.draft_all([step]))[0]

    async def draft_all(self, steps: Sequence[DraftStep]) -> list[DraftTree | None]:
        """The tree under each step's root, or None (no replica, timeout, error). Every request is sent before any
        is awaited, so each replica takes them in one message, and they share one deadline."""
        waiting = _Round()
        asked = [self._ask(step, waiting) for step in steps]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            for link in {ask.link for ask in asked if ask is not None}:
                await link.flush(max(0.0, deadline - loop.time()))
            if waiting.left:
                await asyncio.wait((waiting.done,), timeout=max(0.0, deadline - loop.time()))
            trees = [self._tree(ask, waiting.replies) for ask in asked]
            self._tally(waiting.replies)
            return trees
        finally:
            for ask in asked:
                if ask is not None and waiting.replies[ask.index] is None:
                    ask.link.forget(ask.session_id, ask.step)

    def _ask(self, step: DraftStep, waiting: _Round) -> _Asked | None:
        session_id = step.session_id
        self.add_features(session_id, step.features)
        state = self.sessions[session_id]
        caught_up = None
        if state.link is not None and state.link.usable():
            caught_up = step if step.position <= state.synced else self._caught_up(state, step)
            if caught_up is not None and caught_up is not step and state.parked is not None:
                self.metrics.mirror_resumes.inc()
        if caught_up is not None:
            step = caught_up
        elif self._seed(session_id, state):
            step = step.after_seed()
        else:
            return None
        link, state.parked = state.link, None
        if state.step_offset:
            step = replace(step, step=step.step + state.step_offset)
        try:
            index = link.request(session_id, step.step, step_request(step), waiting)
            state.synced, state.last_step = step.position + len(step.committed), step.step
            return _Asked(state, link, session_id, step.step, index)
        except asyncio.QueueFull:
            self._stalled(link)  # NOTE: the link stays recorded, so the next step re-seeds and counts it
            return None

    def _tree(self, ask: _Asked | None, replies: list[drafter_pb2.DrafterReply | ConnectionError | None]
              ) -> DraftTree | None:
        if ask is None:
            return None
        reply = replies[ask.index]
        if reply is None:
            self._stalled(ask.link)  # NOTE: the link stays recorded, so the next step re-seeds and counts it
            return None
        if isinstance(reply, ConnectionError):  # NOTE: the stream ended
            return None
        if reply.WhichOneof("kind") == "error":
            if reply.error.code == grpc.StatusCode.NOT_FOUND.value[0]:
                ask.link.mirrors.discard(ask.session_id)
                ask.state.link = None
            return None
        return tree_from_reply(reply.tree.tree)

    def _tally(self, replies: list[drafter_pb2.DrafterReply | ConnectionError | None]) -> None:
        """The round's trees per replica, one increment each (an increment takes a lock), and the drafters' own
        time in it: the round waited for its slowest reply."""
        counts: dict[str, int] = {}
        compute_ms = None
        for reply in replies:
            if isinstance(reply, drafter_pb2.DrafterReply) and reply.WhichOneof("kind") == "tree":
                counts[reply.tree.replica_id] = counts.get(reply.tree.replica_id, 0) + 1
                compute_ms = max(compute_ms or 0.0, reply.tree.draft_ms)
        for replica_id, count in counts.items():
            self._trees_from(replica_id).inc(count)
        if compute_ms is not None:
            self.metrics.drafter_compute_seconds.observe(compute_ms / 1e3)
