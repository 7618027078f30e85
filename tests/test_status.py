"""The one exception -> status mapping (proto/status.py): codes per error class, fallbacks, and the decorator
on unary and server-streaming methods, against a fake servicer context."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from gateway import errors as gateway_errors
from proto.status import (
    InvalidArgument,
    SessionBusy,
    SessionNotFound,
    StatusError,
    TooManySessions,
    maps_status,
    status_of,
)
from verifier_service import errors as verifier_errors

Code = grpc.StatusCode


class FakeContext:
    """Records the status a call aborted with and raises AbortError, as grpc.aio's context does."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.aborted.append((code, details))
        raise grpc.aio.AbortError()


@pytest.mark.parametrize(("kind", "code"), [
    (InvalidArgument, Code.INVALID_ARGUMENT),
    (SessionNotFound, Code.NOT_FOUND),
    (SessionBusy, Code.FAILED_PRECONDITION),
    (TooManySessions, Code.RESOURCE_EXHAUSTED),
    (gateway_errors.Unauthenticated, Code.UNAUTHENTICATED),
    (gateway_errors.SessionForbidden, Code.PERMISSION_DENIED),
    (gateway_errors.NoVerifier, Code.UNAVAILABLE),
    (gateway_errors.QuotaExceeded, Code.RESOURCE_EXHAUSTED),
    (verifier_errors.CapacityError, Code.RESOURCE_EXHAUSTED),
    (verifier_errors.InvalidArgument, Code.INVALID_ARGUMENT),
    (verifier_errors.PrefillStopped, Code.CANCELLED),
    (verifier_errors.EngineDown, Code.UNAVAILABLE),
])
def test_each_error_class_names_its_code(kind: type[StatusError], code: grpc.StatusCode) -> None:
    assert status_of(kind("the message")) == (code, "the message")


def test_shared_errors_keep_their_builtin_kinds_and_messages() -> None:
    assert isinstance(InvalidArgument("x"), ValueError)
    missing = SessionNotFound("session: unknown or expired handle")
    assert isinstance(missing, KeyError)
    assert str(missing) == "session: unknown or expired handle"  # not KeyError's quoted repr


def test_fallbacks_map_stray_builtin_errors() -> None:
    fallbacks = ((ValueError, Code.INVALID_ARGUMENT), (KeyError, Code.NOT_FOUND))
    assert status_of(ValueError("bad"), fallbacks) == (Code.INVALID_ARGUMENT, "bad")
    assert status_of(KeyError("no such session"), fallbacks) == (Code.NOT_FOUND, "no such session")
    assert status_of(RuntimeError("boom"), fallbacks) == (Code.INTERNAL, "boom")
    assert status_of(ValueError("bad")) == (Code.INTERNAL, "bad")  # no fallback: unknown
    # a StatusError's own code wins over a fallback for its builtin kind
    assert status_of(SessionNotFound("gone"), ((KeyError, Code.INTERNAL),)) == (Code.NOT_FOUND, "gone")


class Servicer:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.statuses: list[grpc.StatusCode] = []


def _record(servicer: Servicer, code: grpc.StatusCode) -> None:
    servicer.statuses.append(code)


def _translate(error: Exception) -> tuple[grpc.StatusCode, str] | None:
    return (Code.UNAVAILABLE, "upstream is down; retry") if isinstance(error, ConnectionError) else None


mapped = maps_status(fallbacks=((ValueError, Code.INVALID_ARGUMENT),), translate=_translate, on_status=_record)


@mapped
async def unary(self: Servicer, request: str, context: FakeContext) -> str:
    if self.error is not None:
        raise self.error
    return request.upper()


@mapped
async def stream(self: Servicer, request: str, context: FakeContext) -> AsyncIterator[str]:
    yield request
    if self.error is not None:
        raise self.error
    yield request.upper()


async def _run_unary(servicer: Servicer, context: FakeContext) -> str | None:
    try:
        return await unary(servicer, "ok", context)
    except grpc.aio.AbortError:
        return None


async def _run_stream(servicer: Servicer, context: FakeContext) -> list[str]:
    replies: list[str] = []
    try:
        async for reply in stream(servicer, "ok", context):
            replies.append(reply)
    except grpc.aio.AbortError:
        pass
    return replies


@pytest.mark.parametrize(("error", "status"), [
    (None, None),
    (SessionBusy("session: busy"), (Code.FAILED_PRECONDITION, "session: busy")),
    (ValueError("temperature: out of range"), (Code.INVALID_ARGUMENT, "temperature: out of range")),
    (ConnectionError("10.0.0.7:50051 refused"), (Code.UNAVAILABLE, "upstream is down; retry")),
])
def test_unary_and_stream_abort_with_the_mapped_status(error: Exception | None, status) -> None:
    servicer, context = Servicer(error), FakeContext()
    assert asyncio.run(_run_unary(servicer, context)) == (None if error else "OK")
    assert asyncio.run(_run_stream(servicer, context)) == (["ok"] if error else ["ok", "OK"])
    assert context.aborted == ([status] * 2 if status else [])
    assert servicer.statuses == ([status[0]] * 2 if status else [])


def test_an_unexpected_error_is_logged_and_hidden(caplog: pytest.LogCaptureFixture) -> None:
    servicer, context = Servicer(RuntimeError("CUDA error at /opt/secret/path")), FakeContext()
    with caplog.at_level(logging.ERROR, logger="proto.status"):
        asyncio.run(_run_unary(servicer, context))
    assert context.aborted == [(Code.INTERNAL, "internal error: RuntimeError")]
    assert servicer.statuses == [Code.INTERNAL]
    assert "unary" in caplog.text and "/opt/secret/path" in caplog.text  # the log keeps the original


def test_an_abort_the_method_made_passes_through() -> None:
    @mapped
    async def aborts(self: Servicer, request: str, context: FakeContext) -> str:
        await context.abort(Code.OUT_OF_RANGE, "made by the method")
        return request

    servicer, context = Servicer(), FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(aborts(servicer, "x", context))
    assert context.aborted == [(Code.OUT_OF_RANGE, "made by the method")]  # not aborted a second time
    assert servicer.statuses == []


def test_a_cancelled_stream_counts_cancelled_and_stays_cancelled() -> None:
    servicer, context = Servicer(asyncio.CancelledError()), FakeContext()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_run_stream(servicer, context))
    assert context.aborted == [] and servicer.statuses == [Code.CANCELLED]
