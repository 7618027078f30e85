"""The one place where the gateway's exceptions become gRPC status codes."""

from __future__ import annotations

import grpc

from gateway.auth import Unauthenticated
from gateway.sessions import SessionForbidden, SessionNotFound, TooManySessions


class InvalidArgument(ValueError):
    """A request field is out of range; the message starts with the field's name."""


class SessionBusy(RuntimeError):
    """A call needs the session idle, but a generation runs on it."""


class NoVerifier(RuntimeError):
    """No verifier answers now (UNAVAILABLE: the caller should retry)."""


_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionForbidden, grpc.StatusCode.PERMISSION_DENIED),
    (TooManySessions, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (NoVerifier, grpc.StatusCode.UNAVAILABLE),
)


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status for a known failure; a verifier's own status passes through unchanged."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return None
