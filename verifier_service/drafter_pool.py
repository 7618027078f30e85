"""The verifier's side of the drafters: one multiplexed Draft stream per replica, each session pinned to
one replica and re-seeded on another when its replica disappears. Every failure degrades to a step
without speculation (still exact), never to an error for the client."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch

from modeling.tree import DraftTree
from proto import drafter_pb2, drafter_pb2_grpc
from proto.tensors import to_proto
from verifier_service.metrics import VerifierMetrics

log = logging.getLogger(__name__)


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


class ReplicaLink:
    """One replica: a channel, its Draft stream, and the replies awaited on it."""

    def __init__(self, address: str, on_session_error: Callable[[str], None], on_lost: Callable[[], None]):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.outbox: asyncio.Queue[drafter_pb2.DrafterRequest | None] = asyncio.Queue()
        self.waiting: dict[tuple[str, int], asyncio.Future] = {}
        self.on_session_error = on_session_error
        self.on_lost = on_lost
        self.info: drafter_pb2.DrafterInfoReply | None = None
        self.alive = False
        self.reader: asyncio.Task | None = None

    async def connect(self, timeout_s: float) -> drafter_pb2.DrafterInfoReply:
        self.info = await self.stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=timeout_s)
        self.call = self.stub.Draft(self._requests())
        self.alive = True
        self.reader = asyncio.create_task(self._read(), name=f"drafter-{self.address}")
        return self.info

    async def _requests(self) -> AsyncIterator[drafter_pb2.DrafterRequest]:
        while (request := await self.outbox.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for reply in self.call:
                kind = reply.WhichOneof("kind")
                message = getattr(reply, kind)
                future = self.waiting.pop((message.session_id, message.step), None)
                if future is not None and not future.done():
                    future.set_result(reply)
                elif kind == "error":
                    self.on_session_error(message.session_id)  # a failed Open or a stale step's error
        except grpc.aio.AioRpcError as error:
            log.warning("drafter %s lost: %s", self.address, error.code())
        finally:
            was_alive, self.alive = self.alive, False
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(ConnectionError(f"drafter {self.address} lost"))
            self.waiting.clear()
            if was_alive:
                self.on_lost()

    def send(self, request: drafter_pb2.DrafterRequest) -> None:
        self.outbox.put_nowait(request)

    async def ask(self, session_id: str, step: int, request: drafter_pb2.DrafterRequest,
                  timeout_s: float) -> drafter_pb2.DrafterReply:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting[(session_id, step)] = future
        self.send(request)
        # NOTE: a timer on the future itself, not asyncio.wait_for: that adds two loop turns to every reply
        expiry = loop.call_later(timeout_s, _expire, future)
        try:
            return await future
        finally:
            expiry.cancel()
            self.waiting.pop((session_id, step), None)  # a late reply is stale and dropped

    async def close(self) -> None:
        self.alive = False
        self.outbox.put_nowait(None)
        await self.channel.close()
        if self.reader:
            await asyncio.gather(self.reader, return_exceptions=True)


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(asyncio.TimeoutError())


@dataclass
class SessionDraftState:
    tokens: Callable[[], list[int]]  # the session's committed tokens (KV contents), read when re-seeding
    features: torch.Tensor | None  # [<= W, F] features of the last committed tokens
    link: ReplicaLink | None = None


class DrafterPool:
    def __init__(self, target: str, metrics: VerifierMetrics, timeout_s: float = 1.0, refresh_s: float = 2.0):
        self.target, self.metrics, self.timeout_s, self.refresh_s = target, metrics, timeout_s, refresh_s
        self.links: dict[str, ReplicaLink] = {}
        self.sessions: dict[str, SessionDraftState] = {}
        self.round_robin = itertools.count()
        self.info: drafter_pb2.DrafterInfoReply | None = None
        self.on_info: Callable[[drafter_pb2.DrafterInfoReply], None] = lambda info: None
        self.task: asyncio.Task | None = None
        self.refreshing = asyncio.Lock()

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
            link = ReplicaLink(address, self._session_error, self._reconnect_soon)
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

    def live_links(self) -> list[ReplicaLink]:
        return [link for link in self.links.values() if link.alive]

    def _session_error(self, session_id: str) -> None:
        state = self.sessions.get(session_id)
        if state is not None:
            state.link = None  # re-seed before the next step

    # ---- sessions ---------------------------------------------------------------------------------

    @property
    def window(self) -> int | None:
        return (self.info.context_window or None) if self.info else None

    def attach(self, session_id: str, tokens: Callable[[], list[int]], features: torch.Tensor | None) -> None:
        """Track a session; its mirror opens on a replica at its first draft."""
        self.sessions[session_id] = SessionDraftState(tokens, self._trim(features))

    def add_features(self, session_id: str, features: torch.Tensor | None) -> None:
        state = self.sessions[session_id]
        if features is not None:
            old = state.features
            state.features = self._trim(features if old is None else torch.cat([old, features.to(old.dtype)]))

    def close_mirror(self, session_id: str) -> None:
        """End of a generation: free the replica's mirror; the next generation re-opens it."""
        state = self.sessions.get(session_id)
        if state is not None and state.link is not None:
            if state.link.alive:
                state.link.send(drafter_pb2.DrafterRequest(close=drafter_pb2.DrafterClose(session_id=session_id)))
            state.link = None

    def detach(self, session_id: str) -> None:
        self.close_mirror(session_id)
        self.sessions.pop(session_id, None)

    def _trim(self, features: torch.Tensor | None) -> torch.Tensor | None:
        if features is None or self.window is None:
            return features
        return features[-self.window:]

    def _seed(self, session_id: str, state: SessionDraftState) -> bool:
        links = self.live_links()
        if not links:
            return False
        reseed = state.link is not None
        state.link = links[next(self.round_robin) % len(links)]
        tokens = state.tokens()
        uses_features = bool(self.info and self.info.feature_dim)
        if uses_features and self.window is not None:
            tokens = tokens[-self.window:]
        features = state.features if uses_features else None
        state.link.send(drafter_pb2.DrafterRequest(open=drafter_pb2.DrafterOpen(
            session_id=session_id, token_ids=tokens, features=to_proto(features),
            start_position=len(state.tokens()) - len(tokens))))
        if reseed:
            self.metrics.reseeds.inc()
        return True

    async def draft(self, session_id: str, step: int, committed: list[int], features: torch.Tensor | None,
                    bonus: int, position: int, budget: int) -> DraftTree | None:
        """The tree under `bonus` for this step, or None (no replica, timeout, error)."""
        self.add_features(session_id, features)
        state = self.sessions[session_id]
        if state.link is None or not state.link.alive:
            if not self._seed(session_id, state):
                return None
            committed, features, position = [], None, position + len(committed)  # the seed holds them
        link = state.link
        request = drafter_pb2.DrafterRequest(step=drafter_pb2.DrafterStep(
            session_id=session_id, step=step, committed_token_ids=committed, features=to_proto(features),
            bonus_token_id=bonus, position=position, tree_budget=budget))
        try:
            reply = await link.ask(session_id, step, request, self.timeout_s)
        except (ConnectionError, asyncio.TimeoutError):
            return None  # NOTE: a dead link stays recorded, so the next step re-seeds and counts it
        if reply.WhichOneof("kind") == "error":
            if reply.error.code == grpc.StatusCode.NOT_FOUND.value[0]:
                state.link = None
            return None
        self.metrics.trees.labels(reply.tree.replica_id).inc()
        tree = reply.tree.tree
        return DraftTree(tuple(tree.tokens), tuple(tree.parents), tuple(tree.depths), tuple(tree.logprobs))
