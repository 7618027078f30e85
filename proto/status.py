"""The one mapping from exceptions to gRPC status codes, shared by every service.

A domain error names its status as the class attribute `code` (a StatusError subclass) and its message is the
status's details, written for the caller. Servicers wrap each RPC with `maps_status`, which aborts the call
with that status; the drafter, whose stream outlives one session's failure, puts `status_of(error)` into a
per-session error reply instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar, TypeVar

import grpc

log = logging.getLogger(__name__)

Status = tuple[grpc.StatusCode, str]  # (code, details)
Kinds = type[Exception] | tuple[type[Exception], ...]
Fallbacks = Sequence[tuple[Kinds, grpc.StatusCode]]  # for errors that are no StatusError; the first match wins
M = TypeVar("M", bound=Callable[..., Any])


class StatusError(Exception):
    """An error that ends its call with the status its class names."""

    code: ClassVar[grpc.StatusCode]


class InvalidArgument(StatusError, ValueError):
    """A request field is out of range; the message names the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class SessionNotFound(StatusError, KeyError):
    """The session is unknown, released or expired."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:
        return BaseException.__str__(self)  # NOTE: the message itself, where KeyError's str is its repr


class SessionBusy(StatusError):
    """A call needs the session idle, but a generation runs on it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class TooManySessions(StatusError):
    """As many sessions are open as the limit allows; one must close first."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def _details(error: Exception) -> str:
    # NOTE: a stray KeyError's str is the repr of its argument; the argument itself reads better.
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def _known(error: Exception, fallbacks: Fallbacks) -> Status | None:
    if isinstance(error, StatusError):
        return error.code, str(error)
    for kinds, code in fallbacks:
        if isinstance(error, kinds):
            return code, _details(error)
    return None


def status_of(error: Exception, fallbacks: Fallbacks = ()) -> Status:
    """The status `error` ends its call with: its class's code, else the first fallback it matches, else
    INTERNAL; the details are its message."""
    return _known(error, fallbacks) or (grpc.StatusCode.INTERNAL, str(error))


def reported_status(error: Exception, fallbacks: Fallbacks, where: str) -> Status:
    """The status a caller is told for `error`: `status_of`'s, except that an unexpected exception is logged
    and told as a fixed INTERNAL message (its text may name paths, addresses or internals)."""
    status = _known(error, fallbacks)
    if status is None:
        log.error("unexpected failure in %s", where, exc_info=error)
        status = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"
    return status


def maps_status(*, fallbacks: Fallbacks = (), translate: Callable[[Exception], Status | None] | None = None,
                on_status: Callable[[Any, grpc.StatusCode], None] | None = None) -> Callable[[M], M]:
    """A decorator for unary and server-streaming servicer methods `(self, request, context)`: an exception
    aborts the call with its status (`status_of`), and an abort the method made itself passes through.

    `translate` maps errors first, for kinds this module does not know (an upstream call's AioRpcError); None
    leaves an error to the usual mapping. `on_status(servicer, code)` sees every status a call ends with,
    CANCELLED included when the caller goes away (a service's error metric). An unexpected exception is logged
    and reaches the caller as a fixed INTERNAL message: its text may name paths, addresses or internals.
    """

    @contextlib.asynccontextmanager
    async def mapped(servicer: Any, context: grpc.aio.ServicerContext, name: str) -> AsyncIterator[None]:
        try:
            yield
        except asyncio.CancelledError:
            if on_status is not None:
                on_status(servicer, grpc.StatusCode.CANCELLED)
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - the one place errors become statuses
            status = (translate(error) if translate is not None else None) or reported_status(error, fallbacks, name)
            if on_status is not None:
                on_status(servicer, status[0])
            await context.abort(*status)

    def decorate(method: M) -> M:
        name = method.__qualname__
        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async with mapped(self, context, name):
                    async for reply in method(self, request, context):
                        yield reply
            return stream  # type: ignore[return-value]

        @functools.wraps(method)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with mapped(self, context, name):
                return await method(self, request, context)
        return unary  # type: ignore[return-value]
    return decorate
