"""Starting the gateway: gRPC server (Gateway, health, reflection), the OpenAI-compatible HTTP API, metrics over
HTTP, housekeeping."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2

from gateway.auth import ApiKeys
from gateway.chat_template import ChatTemplate
from gateway.config import GatewayConfig
from gateway.http_api import HttpApi, serve_http
from gateway.key_file import API_KEYS_ENV, KeyFile, load_api_keys
from gateway.metrics import GatewayMetrics
from gateway.service import GatewayService
from gateway.servicer import GatewayServicer
from gateway.verifiers import VerifierPool
from gateway.watchdog import EXIT_WITHOUT_VERIFIER_ENV, wait_for_termination_signal_watching
from modeling.tokenizer import Tokenizer
from proto import gateway_pb2, gateway_pb2_grpc
from proto.security import GATEWAY_TLS_ENV, Tls, add_internal_auth_args, internal_auth, is_loopback
from proto.serving import (
    add_health_and_reflection,
    bind,
    channel_options,
    new_server,
    run_service,
    server_options,
)

log = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
STOP_GRACE_S = 5.0  # running calls may finish within this when the gateway stops (gRPC and HTTP)


@dataclass
class RunningGateway:
    server: grpc.aio.Server
    port: int  # the bound gRPC port (useful with "host:0")
    service: GatewayService
    metrics_http: object | None  # the /metrics HTTP server, when on
    housekeeping: asyncio.Task
    http: web.AppRunner | None = None  # the OpenAI-compatible API, when on
    http_port: int | None = None

    async def stop(self, grace_s: float | None = STOP_GRACE_S) -> None:
        self.housekeeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.housekeeping
        if self.http is not None:
            await self.http.cleanup()
        await self.server.stop(grace_s)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
        await self.service.pool.close()
        self.service.close()


def check_transport(config: GatewayConfig, keys: ApiKeys) -> None:
    """Plaintext is the default on loopback only: elsewhere it must be asked for, and API keys crossing it are a
    warning in the log."""
    if config.tls is not None:
        return
    exposed = " and ".join(a for a in (config.listen, config.http_listen) if a and not is_loopback(a))
    if exposed and not config.allow_plaintext:
        raise ValueError(f"{exposed}: not a loopback address: serve TLS (--tls-cert, --tls-key) or ask for "
                         "plaintext (--plaintext)")
    if exposed and keys.enabled:
        log.warning("API keys cross %s in plaintext: anyone on the path reads them (serve TLS: --tls-cert, "
                    "--tls-key; docs/security.md)", exposed)


async def start(config: GatewayConfig, keys: ApiKeys, key_file: KeyFile | None = None) -> RunningGateway:
    """Start serving; the first verifier poll runs before the port opens so routing starts informed. `key_file`,
    the file `keys` came from, is read again when it changes."""
    check_transport(config, keys)
    credentials = config.tls.server_credentials() if config.tls is not None else None  # NOTE: checks the files
    metrics = GatewayMetrics()
    pool = VerifierPool(config.verifiers, channel_options(config.max_message_bytes, config.verifier_keepalive_s,
                                                          config.verifier_keepalive_timeout_s), config.internal)
    service = GatewayService(config, pool, Tokenizer.from_dir(config.tokenizer_dir), metrics,
                             chat_template=ChatTemplate.from_dir(config.tokenizer_dir))
    server = new_server(server_options(config.max_message_bytes, config.max_connection_age_s,
                                       config.max_connection_age_grace_s))
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(service, keys), server)
    health_servicer = add_health_and_reflection(server, [GATEWAY_SERVICE])
    await _refresh(service, health_servicer)
    port = bind(server, config.listen, credentials)
    http, http_port = None, None
    if config.http_listen:
        ssl_context = config.tls.server_ssl_context() if config.tls is not None else None
        http, http_port = await serve_http(HttpApi(service, keys), config.http_listen, STOP_GRACE_S, ssl_context)
    metrics_http = metrics.serve_http(config.metrics_port, config.metrics_addr) if config.metrics_port else None
    await server.start()
    housekeeping = asyncio.create_task(_housekeep(service, health_servicer, config.housekeeping_interval_s,
                                                  key_file))
    log.info("gateway listening on %s (port %d, %s), HTTP %s, verifiers %s (shown %s)", config.listen, port,
             "TLS" if config.tls else "plaintext", config.http_listen or "off", ", ".join(config.verifiers),
             config.internal.kind)
    return RunningGateway(server, port, service, metrics_http, housekeeping, http, http_port)


async def _refresh(service: GatewayService, health_servicer: health.aio.HealthServicer) -> None:
    """Serving while at least one verifier answers: a gateway without one can only fail calls."""
    await service.refresh()
    status = health_pb2.HealthCheckResponse.SERVING if service.pool.up else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", GATEWAY_SERVICE):
        await health_servicer.set(name, status)


async def _housekeep(service: GatewayService, health_servicer: health.aio.HealthServicer, interval_s: float,
                     key_file: KeyFile | None) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            if key_file is not None:
                key_file.reload_if_changed()
            await _refresh(service, health_servicer)
        except Exception:  # noqa: BLE001 - housekeeping must outlive one bad round
            log.exception("gateway housekeeping failed")


async def serve(config: GatewayConfig, keys: ApiKeys, key_file: KeyFile | None = None) -> None:
    """Run until SIGINT or SIGTERM, then stop with a grace period for running calls; SIGHUP reloads the key file."""
    gateway = await start(config, keys, key_file)
    if key_file is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, key_file.reload)
    http = f", HTTP on port {gateway.http_port}" if gateway.http is not None else ""
    print(f"gateway listening on port {gateway.port}{http}", flush=True)
    await wait_for_termination_signal_watching(gateway.service.pool, config.exit_without_verifier_s)
    await gateway.stop()


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig
    p = argparse.ArgumentParser(prog="ddtree-gateway", description="the public gRPC gateway of ddtree-serve")
    p.add_argument("--listen", default=d.listen, help="gRPC address to bind")
    p.add_argument("--http-listen", default=d.http_listen,
                   help="address of the OpenAI-compatible HTTP API, host:port (e.g. 127.0.0.1:8000); empty = off")
    p.add_argument("--verifiers", required=True, help="verifier addresses, comma separated")
    p.add_argument("--tokenizer", required=True,
                   help="checkpoint directory holding tokenizer.json (and the chat template, if it has one)")
    p.add_argument("--api-keys-file", help="file with one API key per line, read again when it changes or on "
                   f"SIGHUP; absent: the keys in ${API_KEYS_ENV}, else no auth")
    for flag, name, help_text in (
            ("--tls-cert", "cert", "certificate chain (PEM) of the public ports (gRPC and HTTP): they serve TLS"),
            ("--tls-key", "key", "the certificate's private key (PEM)"),
            ("--tls-client-ca", "ca", "require client certificates that this CA (PEM) signed")):
        env = GATEWAY_TLS_ENV[name]
        p.add_argument(flag, default=os.environ.get(env) or None, help=f"{help_text} (default: ${env})")
    p.add_argument("--plaintext", action="store_true",
                   help="serve plaintext on a non-loopback address (behind a proxy that terminates TLS)")
    p.add_argument("--session-ttl-s", type=float, default=d.session_idle_ttl_s, help="idle time before release")
    p.add_argument("--max-sessions-per-key", type=int, default=d.max_sessions_per_key)
    p.add_argument("--quota-by", choices=["key", "peer"], default=d.quota_by,
                   help="count quotas per API key (without keys: one account for all) or per client address")
    p.add_argument("--kv-share-per-key", type=float, default=d.kv_share_per_key,
                   help="share of the verifiers' KV tokens one account may hold")
    p.add_argument("--max-prompt-bytes", type=int, default=d.max_prompt_bytes,
                   help="longer text is refused before tokenizing; 0 = what the model's context can hold")
    p.add_argument("--verifier-call-timeout-s", type=float, default=d.verifier_call_timeout_s)
    p.add_argument("--prefill-timeout-s", type=float, default=d.prefill_timeout_s)
    p.add_argument("--verifier-keepalive-s", type=float, default=d.verifier_keepalive_s)
    p.add_argument("--verifier-keepalive-timeout-s", type=float, default=d.verifier_keepalive_timeout_s)
    p.add_argument("--max-new-tokens-limit", type=int, default=d.max_new_tokens_limit)
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes)
    p.add_argument("--max-connection-age-s", type=float, default=d.max_connection_age_s)
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus HTTP port; 0 = off")
    p.add_argument("--metrics-addr", default=d.metrics_addr, help="address of the metrics port (0.0.0.0: all)")
    p.add_argument("--exit-without-verifier-s", type=float,
                   default=float(os.environ.get(EXIT_WITHOUT_VERIFIER_ENV) or d.exit_without_verifier_s),
                   help="exit (status 3) after no verifier has served this long, for a restart policy; 0 = stay "
                        f"up (default: ${EXIT_WITHOUT_VERIFIER_ENV}, else 0)")
    p.add_argument("--log-level", default="INFO")
    add_internal_auth_args(p)
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    tls_files = (args.tls_cert, args.tls_key, args.tls_client_ca)
    return GatewayConfig(
        tls=Tls(*tls_files) if any(tls_files) else None, allow_plaintext=args.plaintext, internal=internal_auth(args),
        verifiers=tuple(a.strip() for a in args.verifiers.split(",") if a.strip()),
        tokenizer_dir=args.tokenizer, listen=args.listen, http_listen=args.http_listen, metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr, session_idle_ttl_s=args.session_ttl_s,
        max_sessions_per_key=args.max_sessions_per_key, max_new_tokens_limit=args.max_new_tokens_limit,
        default_max_new_tokens=args.default_max_new_tokens, max_message_bytes=args.max_message_bytes,
        max_connection_age_s=args.max_connection_age_s, quota_by=args.quota_by, kv_share_per_key=args.kv_share_per_key,
        max_prompt_bytes=args.max_prompt_bytes, verifier_call_timeout_s=args.verifier_call_timeout_s,
        prefill_timeout_s=args.prefill_timeout_s, verifier_keepalive_s=args.verifier_keepalive_s,
        verifier_keepalive_timeout_s=args.verifier_keepalive_timeout_s,
        exit_without_verifier_s=args.exit_without_verifier_s)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # NOTE: the config and the keys file are read inside: their errors are start failures too (one line)
    return run_service(parser.prog, lambda: serve(config_from_args(args), *load_api_keys(args.api_keys_file)))


if __name__ == "__main__":
    sys.exit(main())
