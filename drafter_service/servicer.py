"""The Drafter gRPC servicer: many verifier streams, one batched draft per forward.

Steps of all streams' sessions queue in one scheduler; whatever is queued while a forward runs forms the
next batch. A newer step for a session whose older step is still queued absorbs it (its committed tokens
are kept, its reply is dropped as stale).

Drafts run on the event loop itself: a hop to a worker thread and back cost ~0.5 ms of GIL hand-over
next to gRPC's poller (measured), more than an n-gram draft or a graph-replayed DFlash forward. Nothing
else needs the loop while a draft runs: messages arriving meanwhile wait in gRPC and form the next batch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc
import torch

from drafter_service.drafter import SessionDrafter, StepRequest, UnknownSession
from modeling.tree import DraftTree
from proto import common_pb2, drafter_pb2, drafter_pb2_grpc
from proto.tensors import from_proto

log = logging.getLogger(__name__)


@dataclass
class _Queued:
    request: StepRequest
    outbox: asyncio.Queue


def _merge(older: StepRequest, newer: StepRequest) -> StepRequest:
    features = None
    if older.features is not None or newer.features is not None:
        parts = [f for f in (older.features, newer.features) if f is not None]
        features = torch.cat(parts) if len(parts) > 1 else parts[0]
    return replace(newer, committed=older.committed + newer.committed, features=features, position=older.position)


def _tree_pb(tree: DraftTree) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(tokens=tree.tokens, parents=tree.parents, depths=tree.depths, logprobs=tree.logprobs)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, drafter: SessionDrafter, replica_id: str):
        self.drafter, self.replica_id = drafter, replica_id
        self.queued: dict[str, _Queued] = {}
        self.wakeup = asyncio.Event()
        self.open_ids: set[str] = set()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._draft_forever(), name="draft-scheduler")

    def _error(self, session_id: str, step: int, code: grpc.StatusCode, message: str) -> drafter_pb2.DrafterReply:
        return drafter_pb2.DrafterReply(error=drafter_pb2.DrafterSessionError(
            session_id=session_id, step=step, code=code.value[0], message=message, replica_id=self.replica_id))

    # ---- the stream ------------------------------------------------------------------------------------

    async def Draft(self, request_iterator, context) -> AsyncIterator[drafter_pb2.DrafterReply]:
        outbox: asyncio.Queue = asyncio.Queue()
        opened: set[str] = set()
        reader = asyncio.create_task(self._read(request_iterator, outbox, opened))
        try:
            while (reply := await outbox.get()) is not None:
                yield reply
        finally:
            reader.cancel()
            for session_id in list(opened):  # the verifier is gone: its mirrors are orphans
                self._close(session_id, opened)

    async def _read(self, request_iterator, outbox: asyncio.Queue, opened: set[str]) -> None:
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if kind == "open":
                    self._open(request.open, outbox, opened)
                elif kind == "step":
                    self._enqueue(request.step, outbox)
                elif kind == "close":
                    self._close(request.close.session_id, opened)
        except grpc.aio.AioRpcError:
            pass
        finally:
            outbox.put_nowait(None)

    def _close(self, session_id: str, opened: set[str]) -> None:
        self.queued.pop(session_id, None)
        opened.discard(session_id)
        self.open_ids.discard(session_id)
        self.drafter.close(session_id)

    def _open(self, message: drafter_pb2.DrafterOpen, outbox: asyncio.Queue, opened: set[str]) -> None:
        self.queued.pop(message.session_id, None)  # steps for the old mirror are stale
        try:
            features = from_proto(message.features)
            self.drafter.open(message.session_id, list(message.token_ids), features, message.start_position)
            opened.add(message.session_id)
            self.open_ids.add(message.session_id)
        except ValueError as error:
            outbox.put_nowait(self._error(message.session_id, 0, grpc.StatusCode.INVALID_ARGUMENT, str(error)))

    def _enqueue(self, message: drafter_pb2.DrafterStep, outbox: asyncio.Queue) -> None:
        try:
            features = from_proto(message.features)
        except ValueError as error:
            outbox.put_nowait(self._error(message.session_id, message.step, grpc.StatusCode.INVALID_ARGUMENT,
                                          str(error)))
            return
        request = StepRequest(message.session_id, message.step, list(message.committed_token_ids), features,
                              message.bonus_token_id, message.position, message.tree_budget)
        older = self.queued.get(message.session_id)
        if older is not None:
            request = _merge(older.request, request)
        self.queued[message.session_id] = _Queued(request, outbox)
        self.wakeup.set()

    # ---- the scheduler -----------------------------------------------------------------------------------

    async def _draft_forever(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            batch, self.queued = list(self.queued.values()), {}
            if batch:
                self._draft(batch)
                await asyncio.sleep(0)  # NOTE: the streams send these replies before the next batch runs

    def _draft(self, batch: list[_Queued]) -> None:
        started = time.perf_counter()
        try:
            trees = self.drafter.draft([q.request for q in batch])
        except Exception as error:  # noqa: BLE001 - becomes a per-session error reply
            if len(batch) > 1:
                for queued in batch:  # isolate the session at fault; the others still get trees
                    self._draft([queued])
                return
            code = grpc.StatusCode.NOT_FOUND if isinstance(error, UnknownSession) else (
                grpc.StatusCode.INVALID_ARGUMENT if isinstance(error, ValueError) else grpc.StatusCode.INTERNAL)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("draft failed")
            request = batch[0].request
            batch[0].outbox.put_nowait(self._error(request.session_id, request.step, code, str(error)))
            return
        draft_ms = (time.perf_counter() - started) * 1e3
        for queued, tree in zip(batch, trees):
            queued.outbox.put_nowait(drafter_pb2.DrafterReply(tree=drafter_pb2.DrafterTree(
                session_id=queued.request.session_id, step=queued.request.step, tree=_tree_pb(tree),
                replica_id=self.replica_id, draft_ms=draft_ms)))

    async def Info(self, request, context) -> drafter_pb2.DrafterInfoReply:
        info = self.drafter.info
        return drafter_pb2.DrafterInfoReply(
            replica_id=self.replica_id, drafter_kind=info.kind, block_size=info.block_size,
            context_window=info.context_window or 0, target_layer_ids=list(info.target_layer_ids),
            feature_dim=info.feature_dim, max_tree_budget=info.max_budget, open_sessions=len(self.open_ids))
