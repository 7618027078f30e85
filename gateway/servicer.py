"""The public Gateway gRPC servicer: authenticate, check the request, call one GatewayService method.

Every RPC goes through `_maps_errors`, which turns its exceptions into status codes (proto/status.py, with
gateway/errors.py for a verifier's failures) and counts them; each first learns its caller (`_caller`) inside
it, so a refused key ends the call UNAUTHENTICATED.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from gateway.auth import ApiKeys
from gateway.errors import verifier_status
from gateway.service import Caller, GatewayService
from proto import gateway_pb2, gateway_pb2_grpc
from proto.status import maps_status


def peer_host(peer: str) -> str:
    """The client's address without its port: `ipv4:10.0.0.7:53412` -> `ipv4:10.0.0.7`."""
    kind, _, rest = peer.partition(":")
    return f"{kind}:{rest.rpartition(':')[0]}" if kind in ("ipv4", "ipv6") else peer


def _count(servicer: GatewayServicer, code: grpc.StatusCode) -> None:
    servicer.service.metrics.errors.labels(code.name).inc()


_maps_errors = maps_status(translate=verifier_status, on_status=_count)


def _prompt_logprobs(request: gateway_pb2.GenerateRequest | gateway_pb2.CreateSessionRequest) -> int | None:
    return request.prompt_logprobs if request.HasField("prompt_logprobs") else None


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService, keys: ApiKeys):
        self.service = service
        self.keys = keys

    @_maps_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateReply]:
        caller = self._caller(context)
        prompt = await self.service.prompt(request.text, request.token_ids, required=not request.session)
        params = self.service.params(request.params)
        async for reply in self.service.generate(caller, prompt, params, request.session, request.keep_session,
                                                 tree_budget=request.tree_budget,
                                                 prompt_logprobs=_prompt_logprobs(request)):
            yield reply

    @_maps_errors
    async def Chat(self, request: gateway_pb2.ChatRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateReply]:
        caller = self._caller(context)
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        prompt = await self.service.chat_prompt(caller, messages, request.session)
        params = self.service.params(request.params)
        async for reply in self.service.generate(caller, prompt, params, request.session, request.keep_session,
                                                 tree_budget=request.tree_budget):
            yield reply

    @_maps_errors
    async def CreateSession(self, request: gateway_pb2.CreateSessionRequest,
                            context: grpc.aio.ServicerContext) -> gateway_pb2.CreateSessionReply:
        caller = self._caller(context)
        prompt = await self.service.prompt(request.text, request.token_ids, required=True)
        return await self.service.create_session(caller, prompt, _prompt_logprobs(request))

    @_maps_errors
    async def ForkSession(self, request: gateway_pb2.ForkSessionRequest,
                          context: grpc.aio.ServicerContext) -> gateway_pb2.SessionInfo:
        return await self.service.fork_session(self._caller(context), request.session)

    @_maps_errors
    async def ReleaseSession(self, request: gateway_pb2.ReleaseSessionRequest,
                             context: grpc.aio.ServicerContext) -> gateway_pb2.ReleaseSessionReply:
        await self.service.release_session(self._caller(context), request.session)
        return gateway_pb2.ReleaseSessionReply()

    @_maps_errors
    async def GetSession(self, request: gateway_pb2.GetSessionRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.SessionInfo:
        return await self.service.get_session(self._caller(context), request.session)

    @_maps_errors
    async def ListSessions(self, request: gateway_pb2.ListSessionsRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.ListSessionsReply:
        return await self.service.list_sessions(self._caller(context))

    @_maps_errors
    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsReply:
        self._caller(context)  # NOTE: authenticates; the models are the same for every caller
        return gateway_pb2.ListModelsReply(models=[self.service.model_info()])

    @_maps_errors
    async def Info(self, request: gateway_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.InfoReply:
        self._caller(context)  # NOTE: authenticates; the answer is the same for every caller
        return self.service.info(auth_required=self.keys.enabled)

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        owner = self.keys.authenticate(context.invocation_metadata() or ())
        return self.service.caller(owner, peer_host(context.peer()), context.time_remaining())
