"""Transport security of every ddtree.v1 server and client (docs/security.md has the threat model).

`Tls` is one side's PEM files: the gateway's public port serves with them (and may require client certificates),
a client dials with them. `InternalAuth` is what the services of one deployment prove to each other (gateway ->
verifier, verifier -> drafter): mutual TLS under the deployment's CA, a shared secret in every call's metadata,
both, or neither (development on loopback). Internal calls check the server's certificate against the name
INTERNAL_SERVER_NAME, not the address dialled: drafters are dialled by the IP addresses DNS gives.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

INTERNAL_SERVER_NAME = "ddtree-internal"  # the DNS name every internal certificate carries (scripts/make_dev_certs.py)
SECRET_METADATA_KEY = "x-ddtree-internal-secret"
Options = Sequence[tuple[str, Any]]


def _pem(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


@dataclass(frozen=True)
class Tls:
    """One side's PEM files. A server: its certificate chain and key, and `ca` to require client certificates
    that chain to it. A client: `ca` to check the server against (None: the system's roots), and a certificate
    and key of its own for a server that requires one. The files are checked when credentials are made: a
    problem is a ValueError naming the file."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a TLS certificate needs its private key, and a key its certificate")

    def _check(self) -> None:
        """What gRPC would report only as a failed handshake, found with Python's own TLS library."""
        for what, path in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            try:
                if path is not None:
                    Path(path).read_bytes()
            except OSError as error:
                raise ValueError(f"TLS {what} {path}: {error.strerror}") from None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.cert is not None:
            try:
                context.load_cert_chain(self.cert, self.key)
            except ssl.SSLError as error:
                problem = "the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(error) else \
                    "not a PEM certificate chain and its unencrypted PEM private key"
                raise ValueError(f"TLS certificate {self.cert} and key {self.key}: {problem}") from None
        if self.ca is not None:
            try:
                context.load_verify_locations(self.ca)
            except ssl.SSLError:
                raise ValueError(f"TLS CA {self.ca}: no PEM certificate in it") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None:
            raise ValueError("a TLS server needs a certificate and its key")
        self._check()
        return grpc.ssl_server_credentials([(_pem(self.key), _pem(self.cert))], root_certificates=_pem(self.ca),
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        self._check()
        return grpc.ssl_channel_credentials(_pem(self.ca), _pem(self.key), _pem(self.cert))

    def server_ssl_context(self) -> ssl.SSLContext:
        """The same files for an HTTP server (aiohttp)."""
        if self.cert is None:
            raise ValueError("a TLS server needs a certificate and its key")
        self._check()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # NOTE: not the default context: it trusts the system's CAs
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """The same files for an HTTPS client (aiohttp): the server checked against `ca` (None: the system's
        roots), our certificate shown when we have one."""
        self._check()
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class InternalAuth:
    """The credentials of internal calls, the same on both ends: `tls` (certificate, key and the deployment's CA)
    for mutual TLS, `secret` for metadata every call carries and every server checks."""

    tls: Tls | None = None
    secret: str | None = field(default=None, repr=False)  # NOTE: configs are logged; a secret never

    def __post_init__(self) -> None:
        if self.tls is not None and (self.tls.cert is None or self.tls.ca is None):
            raise ValueError("internal mutual TLS needs a certificate, its key and the deployment's CA")
        if self.secret is not None and not self.secret:
            raise ValueError("the internal secret is empty")

    @property
    def kind(self) -> str:
        """For logs: what internal callers must show."""
        kinds = ["mutual TLS"] * (self.tls is not None) + ["the shared secret"] * (self.secret is not None)
        return " and ".join(kinds) or "nothing"

    def server_credentials(self) -> grpc.ServerCredentials | None:
        return self.tls.server_credentials() if self.tls is not None else None

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [RequireSecret(self.secret)] if self.secret is not None else []

    def channel(self, address: str, options: Options = ()) -> grpc.aio.Channel:
        """A channel to another service of the deployment."""
        interceptors = _secret_interceptors(self.secret) if self.secret is not None else None
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        options = [*options, ("grpc.ssl_target_name_override", INTERNAL_SERVER_NAME)]
        return grpc.aio.secure_channel(address, self.tls.channel_credentials(), options=options,
                                       interceptors=interceptors)


NO_AUTH = InternalAuth()  # internal callers show nothing: development on loopback


class RequireSecret(grpc.aio.ServerInterceptor):
    """Every call must carry the shared secret; one without it ends UNAUTHENTICATED before its handler runs.
    NOTE: with mutual TLS, a caller without a certificate of the deployment's CA is refused earlier, in the
    handshake (gRPC cannot ask for a certificate without requiring it): it sees UNAVAILABLE."""

    def __init__(self, secret: str):
        self._secret = secret.encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        given = next((value for key, value in details.invocation_metadata or () if key == SECRET_METADATA_KEY), "")
        given = given.encode() if isinstance(given, str) else given
        if handler is None or hmac.compare_digest(given, self._secret):
            return handler
        kind = f"{'stream' if handler.request_streaming else 'unary'}_" \
               f"{'stream' if handler.response_streaming else 'unary'}"
        return handler._replace(**{kind: _refuse})


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    """A handler of any kind: a coroutine may serve a stream (through context.write), so this one fits all four."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "internal call without the deployment's secret (docs/security.md)")


class _SendSecret:
    def __init__(self, secret: str):
        self._metadata = ((SECRET_METADATA_KEY, secret),)

    async def _intercept(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                         request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return await continuation(details._replace(metadata=metadata), request)


# NOTE: a channel files each interceptor under the first kind it is an instance of: one class per kind.
class _SecretUnaryUnary(_SendSecret, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _SendSecret._intercept


class _SecretUnaryStream(_SendSecret, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _SendSecret._intercept


class _SecretStreamUnary(_SendSecret, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _SendSecret._intercept


class _SecretStreamStream(_SendSecret, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _SendSecret._intercept


def _secret_interceptors(secret: str) -> list[grpc.aio.ClientInterceptor]:
    return [kind(secret) for kind in (_SecretUnaryUnary, _SecretUnaryStream, _SecretStreamUnary, _SecretStreamStream)]


def client_channel(address: str, tls: Tls | None, options: Options = ()) -> grpc.aio.Channel:
    """A public client's channel to the gateway: TLS with `tls`'s files, or plaintext (None)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=list(options))


def is_loopback(address: str) -> bool:
    """Whether a listen address (host:port, [v6]:port, unix:PATH) is reachable from this machine only."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except socket.gaierror:
        return False


def tls_failure_hint(details: str) -> str | None:
    """What a failed connection's details say about certificates, in words; None when they say nothing."""
    hints = (("certificate has expired", "the server's certificate has expired"),
             ("CERTIFICATE_VERIFY_FAILED", "the server's certificate is not signed by a trusted CA (the root "
                                           "certificate given, else the system's)"),
             ("Hostname Verification", "the server's certificate is not for the name dialled"),
             ("WRONG_VERSION_NUMBER", "the server does not speak TLS: dial it in plaintext"))
    for marker, hint in hints:
        if marker in details:
            return hint
    if "failed to connect" in details and "Socket closed" in details:
        return ("the server closed the connection at once: it may require TLS, or a client certificate that "
                "its CA signed")
    return None


# ---- command-line options --------------------------------------------------------------------------------

# What the services' options default to, so that a deployment sets its files once for every container (and the
# preflight and health checks read the same).
INTERNAL_ENV = {"ca": "DDTREE_INTERNAL_CA", "cert": "DDTREE_INTERNAL_CERT", "key": "DDTREE_INTERNAL_KEY",
                "secret_file": "DDTREE_INTERNAL_SECRET_FILE"}
GATEWAY_TLS_ENV = {"cert": "DDTREE_TLS_CERT", "key": "DDTREE_TLS_KEY", "ca": "DDTREE_TLS_CLIENT_CA"}


def add_internal_auth_args(parser: argparse.ArgumentParser) -> None:
    """The internal credentials, each defaulting to its DDTREE_INTERNAL_* variable so that every service of a
    deployment (and its health check) reads the same."""
    group = parser.add_argument_group("internal calls (docs/security.md)")
    for name, help_text in (("ca", "the deployment's CA (PEM): with --internal-cert and --internal-key, internal "
                                   "calls use mutual TLS"),
                            ("cert", "this service's certificate for internal calls (PEM)"),
                            ("key", "its private key (PEM)"),
                            ("secret-file", "a file holding the shared secret every internal call carries")):
        env = INTERNAL_ENV[name.replace("-", "_")]
        group.add_argument(f"--internal-{name}", default=os.environ.get(env) or None,
                           help=f"{help_text} (default: ${env})")


def internal_auth(args: argparse.Namespace) -> InternalAuth:
    files = (args.internal_ca, args.internal_cert, args.internal_key)
    if any(files) and not all(files):
        raise ValueError("internal mutual TLS needs --internal-ca, --internal-cert and --internal-key together")
    secret = None
    if args.internal_secret_file:
        secret = Path(args.internal_secret_file).read_text().strip()
        if not secret:
            raise ValueError(f"{args.internal_secret_file}: the internal secret file is empty")
    tls = Tls(args.internal_cert, args.internal_key, args.internal_ca) if all(files) else None
    return InternalAuth(tls, secret)


def add_client_tls_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls", action="store_true",
                        help="dial with TLS, trusting the system's roots (implied by the --tls-* files)")
    parser.add_argument("--tls-ca", help="the root certificate (PEM) the server's certificate must chain to")
    parser.add_argument("--tls-cert", help="a client certificate (PEM), for a server that requires one")
    parser.add_argument("--tls-key", help="the client certificate's private key (PEM)")


def client_tls(args: argparse.Namespace) -> Tls | None:
    """None: plaintext."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    return Tls(args.tls_cert, args.tls_key, args.tls_ca)
