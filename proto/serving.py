"""What every ddtree.v1 server runs alongside its service: message limits, connection ageing (so clients
re-resolve and find new replicas), keepalive, binding (plaintext or TLS: proto/security.py), grpc.health.v1 and
server reflection, and how a server's start fails; plus the channel options its clients use."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from proto.security import NO_AUTH, InternalAuth, is_loopback
from proto.undecodable import RejectUndecodable

MAX_MESSAGE_BYTES = 64 << 20
# Clients ping idle and busy connections to notice a peer that stopped answering; a server's defaults allow
# one ping per 5 minutes and answer more with GOAWAY too_many_pings, which would cut every call on it.
KEEPALIVE_SERVER_OPTIONS = [("grpc.keepalive_permit_without_calls", 1),
                            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                            ("grpc.http2.max_ping_strikes", 0)]
log = logging.getLogger(__name__)
_serving = threading.Event()  # set once a server waits for its stop signal: what fails before is a start failure


class BindError(OSError):
    """The server cannot listen on an address; the message names it and says why."""


def message_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES, keepalive_s: float = 10.0,
                    keepalive_timeout_s: float = 5.0) -> list[tuple[str, int]]:
    """A client's: keepalive pings, so the calls to a peer that stopped answering (a frozen process, a dropped
    link) fail with UNAVAILABLE within about keepalive_s + keepalive_timeout_s instead of hanging.
    NOTE: a keepalive ping due while another ping (gRPC's own flow-control probe) is unanswered waits on that
    one, whose timeout is ping_timeout_ms (60 s by default): it gets keepalive_timeout_s too."""
    return [*message_options(max_message_bytes),
            ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, max_connection_age_s: float | None = None,
                   max_connection_age_grace_s: float = 10.0) -> list[tuple[str, int]]:
    """Connection ageing is for servers found through DNS (scaled replicas): clients re-resolve on reconnect.
    NOTE: streams still open when the grace ends are cut, so servers with long streams keep it off.
    SO_REUSEPORT (gRPC's default) is off: with it a second server on a taken port starts and splits the traffic."""
    options = [*message_options(max_message_bytes), ("grpc.so_reuseport", 0), *KEEPALIVE_SERVER_OPTIONS]
    if max_connection_age_s is not None:
        options += [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000))]
    return options


def new_server(options: list[tuple[str, int]],
               interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """Every ddtree.v1 server: requests that do not parse get INVALID_ARGUMENT naming the field. `interceptors`
    (a caller check) run first."""
    return grpc.aio.server(options=options, interceptors=[*interceptors, RejectUndecodable()])


def check_bindable(address: str) -> None:
    """Raise BindError when a host:port address is taken, unresolvable or out of range (other forms, such as
    unix:PATH, pass): gRPC's own failure says neither which address nor why."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    if int(port) > 65535:
        raise BindError(f"{address}: the port must be at most 65535")
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise BindError(f"{address}: cannot resolve the host ({error.strerror})") from None
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: a TIME_WAIT port is free
            try:
                probe.bind(sockaddr)
            except OSError as error:  # NOTE: others (no IPv6 for [::], ...) are gRPC's to judge: it falls back
                if error.errno == errno.EADDRINUSE:
                    raise BindError(f"{address} is already in use (another server?)") from None


def serve_metrics(registry: CollectorRegistry, port: int, addr: str):
    """Prometheus /metrics over HTTP in a thread; a taken port fails like a gRPC one (BindError naming it).
    Returns the HTTP server (call shutdown())."""
    check_bindable(f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}")
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on `address`, with TLS when there are `credentials`, failing with a BindError that names the
    address and the cause."""
    check_bindable(address)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        raise BindError(f"cannot listen on {address} (gRPC's log line above says why)") from None


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def mark_serving(health_servicer: health.aio.HealthServicer, service_names: list[str],
                       serving: bool = True) -> None:
    """The health status of the server ("") and of each named service: SERVING, or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, status)


class ServiceServer:
    """One ddtree.v1 service on a server of its own (see new_server) beside grpc.health.v1 and reflection,
    bound to `listen` on construction: a taken address fails before the caller starts its own machinery.
    `add_servicer` is the generated `add_<Service>Servicer_to_server`; every call, health checks included, must
    show `auth`."""

    def __init__(self, service_name: str, add_servicer: Callable[[Any, grpc.aio.Server], None], servicer: Any,
                 listen: str, options: list[tuple[str, int]], auth: InternalAuth = NO_AUTH):
        self.service_names = [service_name]
        self.server = new_server(options, auth.server_interceptors())
        add_servicer(servicer, self.server)
        self.health = add_health_and_reflection(self.server, self.service_names)
        self.port = bind(self.server, listen, auth.server_credentials())
        if auth.kind == "nothing" and not is_loopback(listen):
            log.warning("%s on %s accepts internal calls from anyone who reaches it: give it the deployment's "
                        "credentials (--internal-*, docs/security.md)", service_name, listen)

    async def start(self) -> None:
        """Accept calls and report SERVING."""
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        await mark_serving(self.health, self.service_names, serving)

    async def serve_until_signal(self, grace_s: float) -> None:
        """Until SIGINT or SIGTERM; then report NOT_SERVING and stop, giving running calls `grace_s`."""
        await wait_for_termination_signal()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace_s)


async def wait_for_termination_signal() -> None:
    """Until SIGINT or SIGTERM (the process's main thread only). A server calls it once it serves."""
    _serving.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def describe(error: BaseException) -> str:
    """An exception as one line for a user: a missing file as 'PATH not found'; the type is named unless the
    error is one whose message is written for users (bad values, files)."""
    if isinstance(error, FileNotFoundError) and error.filename:
        return f"{error.filename} not found"
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    if text and isinstance(error, (ValueError, OSError)):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def service_main(parser: argparse.ArgumentParser, serve: Callable[[argparse.Namespace], Coroutine[Any, Any, None]],
                 argv: list[str] | None, log_name: str) -> int:
    """A service's `main`: parse `argv`, log INFO lines tagged `log_name` to stderr, run `serve(args)` as
    run_service does."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {log_name} %(levelname)s %(message)s")
    return run_service(parser.prog, lambda: serve(args))


def run_service(prog: str, serve: Callable[[], Coroutine[Any, Any, None]]) -> int:
    """Run a server's main coroutine: a failure before it serves (a bad checkpoint, a taken port, a bad value)
    is one line `PROG: error: ...` on stderr and exit status 2, as argparse reports a bad flag; a failure
    after that raises (a bug deserves its traceback)."""
    try:
        asyncio.run(serve())
    except Exception as error:
        if _serving.is_set():
            raise
        print(f"{prog}: error: {describe(error)}", file=sys.stderr)
        return 2
    return 0
