"""The public Gateway gRPC servicer: authenticate, check the request, call one GatewayService method.

Every RPC goes through `_unary` or `_stream`, which hand it the caller's identity and remaining
deadline and turn exceptions into status codes (gateway/errors.py) in one place.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from gateway.auth import ApiKeys
from gateway.errors import status_of
from gateway.service import Caller, GatewayService
from proto import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


def peer_host(peer: str) -> str:
    """The client's address without its port: `ipv4:10.0.0.7:53412` -> `ipv4:10.0.0.7`."""
    kind, _, rest = peer.partition(":")
    return f"{kind}:{rest.rpartition(':')[0]}" if kind in ("ipv4", "ipv6") else peer


def _unary(method: Callable[[Any, Any, Caller], Awaitable[Any]]):
    @functools.wraps(method)
    async def handler(self: GatewayServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, self._caller(context))
        except Exception as exc:  # noqa: BLE001 - mapped to a status in one place
            await self._abort(context, exc)
    return handler


def _stream(method: Callable[[Any, Any, Caller], AsyncIterator[Any]]):
    @functools.wraps(method)
    async def handler(self: GatewayServicer, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for reply in method(self, request, self._caller(context)):
                yield reply
        except asyncio.CancelledError:
            self.service.metrics.errors.labels(grpc.StatusCode.CANCELLED.name).inc()
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status in one place
            await self._abort(context, exc)
    return handler


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService, keys: ApiKeys):
        self.service = service
        self.keys = keys

    @_stream
    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       caller: Caller) -> AsyncIterator[gateway_pb2.GenerateReply]:
        prompt = await self.service.prompt(request.text, request.token_ids, required=not request.session)
        params = self.service.params(request.params)
        async for reply in self.service.generate(caller, prompt, params, request.session, request.keep_session):
            yield reply

    @_unary
    async def CreateSession(self, request: gateway_pb2.CreateSessionRequest,
                            caller: Caller) -> gateway_pb2.CreateSessionReply:
        prompt = await self.service.prompt(request.text, request.token_ids, required=True)
        return await self.service.create_session(caller, prompt)

    @_unary
    async def ForkSession(self, request: gateway_pb2.ForkSessionRequest, caller: Caller) -> gateway_pb2.SessionInfo:
        return await self.service.fork_session(caller, request.session)

    @_unary
    async def ReleaseSession(self, request: gateway_pb2.ReleaseSessionRequest,
                             caller: Caller) -> gateway_pb2.ReleaseSessionReply:
        await self.service.release_session(caller, request.session)
        return gateway_pb2.ReleaseSessionReply()

    @_unary
    async def GetSession(self, request: gateway_pb2.GetSessionRequest, caller: Caller) -> gateway_pb2.SessionInfo:
        return await self.service.get_session(caller, request.session)

    @_unary
    async def ListSessions(self, request: gateway_pb2.ListSessionsRequest,
                           caller: Caller) -> gateway_pb2.ListSessionsReply:
        return await self.service.list_sessions(caller)

    @_unary
    async def ListModels(self, request: gateway_pb2.ListModelsRequest, caller: Caller) -> gateway_pb2.ListModelsReply:
        return gateway_pb2.ListModelsReply(models=[self.service.model_info()])

    @_unary
    async def Info(self, request: gateway_pb2.InfoRequest, caller: Caller) -> gateway_pb2.InfoReply:
        return self.service.info(auth_required=self.keys.enabled)

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        owner = self.keys.authenticate(context.invocation_metadata() or ())
        account = peer_host(context.peer()) if self.service.config.quota_by == "peer" else owner
        return Caller(owner, account, context.time_remaining())

    async def _abort(self, context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc
        status = status_of(exc)
        if status is None:
            log.exception("unexpected failure in a gateway call")
            status = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
        code, details = status
        self.service.metrics.errors.labels(code.name).inc()
        await context.abort(code, details)
