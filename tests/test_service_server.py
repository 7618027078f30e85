"""ServiceServer, the start-up every ddtree.v1 service shares: bound on construction, health and reflection."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto import drafter_pb2, drafter_pb2_grpc
from proto.serving import BindError, ServiceServer, server_options

SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class InfoOnly(drafter_pb2_grpc.DrafterServicer):
    async def Info(self, request, context):  # noqa: N802 - the generated name
        return drafter_pb2.DrafterInfoReply(replica_id="r0")


def new_server(listen: str = "127.0.0.1:0") -> ServiceServer:
    return ServiceServer(SERVICE, drafter_pb2_grpc.add_DrafterServicer_to_server, InfoOnly(), listen, server_options())


async def health(channel: grpc.aio.Channel) -> list[int]:
    stub = health_pb2_grpc.HealthStub(channel)
    return [(await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)).status
            for name in ("", SERVICE)]


async def listed_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for reply in stub.ServerReflectionInfo(iter([request]), timeout=10):
        return {service.name for service in reply.list_services_response.service}
    return set()


def test_a_started_server_serves_its_service_health_and_reflection():
    async def scenario() -> None:
        server = new_server()
        assert server.port > 0
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                reply = await drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(), timeout=10)
                assert reply.replica_id == "r0"
                assert await health(channel) == [SERVING, SERVING]
                assert {SERVICE, "grpc.health.v1.Health"} <= await listed_services(channel)

                await server.set_serving(False)
                assert await health(channel) == [NOT_SERVING, NOT_SERVING]
        finally:
            await server.server.stop(0)
    asyncio.run(scenario())


def test_a_taken_address_fails_on_construction():
    async def scenario() -> None:
        first = new_server()
        await first.start()
        try:
            with pytest.raises(BindError, match="already in use"):
                new_server(f"127.0.0.1:{first.port}")
        finally:
            await first.server.stop(0)
    asyncio.run(scenario())
