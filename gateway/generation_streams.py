"""The gateway's generations on a verifier, all over one Verifier.GenerateStream call: a verify step of many
sessions arrives as one message instead of one per session (verifier_service/generation_stream.py).

Seen from a generation, the stream behaves as a Generate call of its own: its steps in order, then the end; a
failure raises grpc.aio.AioRpcError with the status the verifier gave it; a deadline raises DEADLINE_EXCEEDED;
closing it early cancels the generation at the verifier; a caller that stops reading holds its generation back
(the verifier waits once WINDOW of its events are untaken, as HTTP/2 flow control would hold a call of its own).
A stream that breaks (the verifier went away) fails every generation on it with its status, and the next
generation opens a new one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc

from proto import verifier_pb2, verifier_pb2_grpc

CODES = {code.value[0]: code for code in grpc.StatusCode}
# NOTE: events a generation may have under way (sent by the verifier, or queued here) before its caller takes them:
# its producer waits at that many, so a caller that stops reading holds back its own generation, not the stream's
# others, and nothing piles up. Roomy for the same reason as the verifier's run-ahead bound; credit goes back at
# half of it, so one report travels per several events.
WINDOW = 16


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a Generate call would raise with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class GenerationStream:
    """One GenerateStream call and the generations running on it."""

    def __init__(self, stub: verifier_pb2_grpc.VerifierStub):
        self.outgoing: asyncio.Queue[verifier_pb2.VerifierStreamRequest] = asyncio.Queue()
        self.call = stub.GenerateStream(self._requests())
        self.inboxes: dict[int, asyncio.Queue] = {}
        self.request_ids = itertools.count(1)
        self.failure: grpc.aio.AioRpcError | None = None
        self.reader = asyncio.ensure_future(self._read())

    @property
    def broken(self) -> bool:
        return self.reader.done()

    async def _requests(self) -> AsyncIterator[verifier_pb2.VerifierStreamRequest]:
        while True:
            yield await self.outgoing.get()

    async def _read(self) -> None:
        try:
            async for reply in self.call:
                for event in reply.events:
                    inbox = self.inboxes.get(event.request_id)
                    if inbox is not None:  # NOTE: a generation closed early may still get its last events
                        inbox.put_nowait(event)
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, "the verifier ended the generation stream")
        except grpc.aio.AioRpcError as error:
            failure = error
        self.failure = failure
        for inbox in self.inboxes.values():
            inbox.put_nowait(failure)

    async def generate(self, request: verifier_pb2.VerifierGenerateRequest,
                       timeout: float | None) -> AsyncIterator[verifier_pb2.VerifierGenerateStep]:
        """The generation's steps, as a Generate call with this timeout would give them."""
        if self.failure is not None:
            raise self.failure
        request_id, inbox = next(self.request_ids), asyncio.Queue()
        self.inboxes[request_id] = inbox
        deadline = None
        if timeout is not None:  # NOTE: the verifier stops it too; this holds even if its answer is lost
            expired = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            deadline = asyncio.get_running_loop().call_later(timeout + 1.0, inbox.put_nowait, expired)
        self.outgoing.put_nowait(verifier_pb2.VerifierStreamRequest(request_id=request_id, generate=request,
                                                                    timeout_s=timeout or 0.0, window=WINDOW))
        ended, consumed = False, 0
        try:
            while True:
                event = await inbox.get()
                if isinstance(event, grpc.aio.AioRpcError):
                    ended = event is self.failure
                    raise event
                if event.WhichOneof("kind") == "error":
                    ended = True
                    raise rpc_error(CODES.get(event.error.code, grpc.StatusCode.UNKNOWN), event.error.message)
                yield event.step
                if event.step.finished:
                    ended = True
                    return
                consumed += 1  # NOTE: the caller came back for the next one: it took this one
                if consumed >= WINDOW // 2:
                    self.outgoing.put_nowait(verifier_pb2.VerifierStreamRequest(request_id=request_id,
                                                                                consumed=consumed))
                    consumed = 0
        finally:
            del self.inboxes[request_id]
            if deadline is not None:
                deadline.cancel()
            if not ended and not self.broken:
                self.outgoing.put_nowait(verifier_pb2.VerifierStreamRequest(request_id=request_id, cancel=True))

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
