"""The gateway's errors, each naming its gRPC status (proto/status.py), and the status a verifier's failure
reaches the client with."""

from __future__ import annotations

import grpc

from proto.status import InvalidArgument, SessionBusy, SessionNotFound, Status, StatusError, TooManySessions

__all__ = ["InvalidArgument", "ModelNotFound", "NoVerifier", "PromptTooLong", "QuotaExceeded", "SessionBusy",
           "SessionForbidden", "SessionNotFound", "TooManySessions", "Unauthenticated", "verifier_status"]


class Unauthenticated(StatusError):
    """Keys are on and the call carries no key, or an unknown one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PromptTooLong(InvalidArgument):
    """The prompt cannot fit the model's context: INVALID_ARGUMENT over gRPC, 413 over HTTP."""


class ModelNotFound(StatusError):
    """An HTTP request names a model this gateway does not serve."""

    code = grpc.StatusCode.NOT_FOUND


class SessionForbidden(StatusError):
    """The handle belongs to another API key."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NoVerifier(StatusError):
    """No verifier answers now: the caller should retry."""

    code = grpc.StatusCode.UNAVAILABLE


class QuotaExceeded(StatusError):
    """The caller's account would hold more KV than its share."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


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


def verifier_status(error: Exception) -> Status | None:
    """The status a verifier's failed call reaches the client with: its code, and its details where they are
    meant for the caller; None for an error that is no verifier call's."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return None
    code = error.code()
    if code in _VERIFIER_DETAILS_PASSED_ON:
        return code, error.details() or ""
    return code, _VERIFIER_MESSAGES.get(code, f"the verifier failed ({code.name})")
