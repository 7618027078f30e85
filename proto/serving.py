"""What every ddtree.v1 server runs alongside its service: message limits, connection ageing (so clients
re-resolve and find new replicas), grpc.health.v1 and server reflection."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20


def message_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, max_connection_age_s: float | None = None,
                   max_connection_age_grace_s: float = 10.0) -> list[tuple[str, int]]:
    """Connection ageing is for servers found through DNS (scaled replicas): clients re-resolve on reconnect.
    NOTE: streams still open when the grace ends are cut, so servers with long streams keep it off."""
    options = message_options(max_message_bytes)
    if max_connection_age_s is not None:
        options += [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000))]
    return options


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def wait_for_termination_signal() -> None:
    """Until SIGINT or SIGTERM (the process's main thread only)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
