"""The verifier's errors, engine and service alike; each names its gRPC status (proto/status.py)."""

import grpc

from proto.status import InvalidArgument, SessionBusy, SessionNotFound, StatusError

__all__ = ["CapacityError", "EngineDown", "InvalidArgument", "NoFreePages", "PrefillStopped", "SessionBusy",
           "SessionNotFound"]


class CapacityError(StatusError):
    """The KV page pool cannot hold what was asked; nothing was allocated."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NoFreePages(CapacityError):
    """A prefill's pages are not free now; it took none and may try again once others are released."""


class PrefillStopped(StatusError):
    """The caller of a prefill went away; the prefill stopped between chunks and gave its pages back."""

    code = grpc.StatusCode.CANCELLED


class EngineDown(StatusError):
    """The engine can no longer run (a tensor-parallel rank died): retry elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE
