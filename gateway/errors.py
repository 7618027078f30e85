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


class QuotaExceeded(RuntimeError):
    """The caller's account would hold more KV than its share (RESOURCE_EXHAUSTED)."""


# NOTE: the verifier writes these statuses' details for the caller (which field, how much room) and names no
# session or address in them; every other status comes from gRPC itself (which names addresses) or from an
# internal failure, so the client gets a fixed message and the log keeps the original.
_VERIFIER_DETAILS_PASSED_ON = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               grpc.StatusCode.FAILED_PRECONDITION}
_VERIFIER_MESSAGES = {
    grpc.StatusCode.UNAVAILABLE: "the verifier is unavailable; retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline exceeded",
    grpc.StatusCode.CANCELLED: "the call was cancelled",
    grpc.StatusCode.NOT_FOUND: "session: unknown or expired handle",
}


_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionForbidden, grpc.StatusCode.PERMISSION_DENIED),
    (TooManySessions, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (NoVerifier, grpc.StatusCode.UNAVAILABLE),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status for a known failure; a verifier's status keeps its code, and its details where they are
    meant for the caller."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code in _VERIFIER_DETAILS_PASSED_ON:
            return code, exc.details() or ""
        return code, _VERIFIER_MESSAGES.get(code, f"the verifier failed ({code.name})")
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return None
