"""Transport security (docs/security.md), with certificates that scripts/make_dev_certs.py makes in the test for two
deployments: ours, and theirs (another CA).

In this process: certificate files that cannot be used fail naming the file; a server with mutual TLS serves its
deployment and refuses the rest in the handshake; one with the shared secret answers a caller without it
UNAUTHENTICATED, unary calls, streams and health checks alike; plaintext on a non-loopback address must be asked
for; API keys come from the environment or a key file whose bad rewrite keeps the keys in force; the preflight
names a certificate that does not load. Then the real
stack as processes (an n-gram drafter, the verifier on the tiny model, a gateway serving TLS on gRPC and HTTP),
every internal link mutual TLS: a TLS client generates through it (the drafter drafts), a plaintext client and
one trusting another CA fail with statuses that name the problem (the `ddtree` CLI too), internal ports refuse
callers without the deployment's certificate, a gateway that requires client certificates admits only its CA's,
and a rotated key file takes effect without a restart, on change and on SIGHUP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.client import AsyncClient, Client, GatewayError
from ddtree.local_stack import free_port
from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.key_file import API_KEYS_ENV, KeyFile, load_api_keys
from gateway.server import check_transport
from gateway.server import main as gateway_main
from proto import drafter_pb2, drafter_pb2_grpc, gateway_pb2
from proto.healthcheck import check
from proto.healthcheck import main as healthcheck_main
from proto.security import InternalAuth, Tls, client_channel, is_loopback
from proto.serving import ServiceServer, server_options
from tests.stack_helpers import verifier_metric

REPO = Path(__file__).resolve().parents[1]
DRAFTER_SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
UNAVAILABLE, UNAUTHENTICATED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SimpleNamespace:
    """Two deployments' files, as scripts/make_dev_certs.py writes them."""
    root = tmp_path_factory.mktemp("certs")
    for name in ("ours", "theirs"):
        subprocess.run([sys.executable, "scripts/make_dev_certs.py", str(root / name)], cwd=REPO, check=True,
                       capture_output=True)
    return SimpleNamespace(ours=root / "ours", theirs=root / "theirs")


def internal(directory: Path, secret: str | None = None) -> InternalAuth:
    return InternalAuth(Tls(str(directory / "internal.crt"), str(directory / "internal.key"),
                            str(directory / "ca.crt")), secret)


def trusting(directory: Path, client_cert: bool = False) -> Tls:
    """A client's files: the CA of `directory`, and its client certificate when asked."""
    if client_cert:
        return Tls(str(directory / "client.crt"), str(directory / "client.key"), str(directory / "ca.crt"))
    return Tls(ca=str(directory / "ca.crt"))


# ---- the files and the rules, in this process --------------------------------------------------------------

def test_make_dev_certs_keeps_existing_files(certs) -> None:
    again = subprocess.run([sys.executable, "scripts/make_dev_certs.py", str(certs.ours)], cwd=REPO,
                           capture_output=True, text=True)
    assert again.returncode == 2 and "exist (--force replaces them)" in again.stderr
    assert oct((certs.ours / "ca.key").stat().st_mode & 0o777) == "0o600"


def test_unusable_certificate_files_are_errors_naming_them(certs) -> None:
    ours, theirs = certs.ours, certs.theirs
    with pytest.raises(ValueError, match=f"^TLS certificate {ours}/gateway.crt and key {theirs}/gateway.key: the key "
                                         "does not match the certificate$"):
        Tls(str(ours / "gateway.crt"), str(theirs / "gateway.key")).server_credentials()
    with pytest.raises(ValueError, match=f"^TLS CA {ours}/ca.key: no PEM certificate in it$"):
        Tls(ca=str(ours / "ca.key")).channel_credentials()
    with pytest.raises(ValueError, match="^TLS CA /nonexistent/ca.crt: No such file or directory$"):
        Client("127.0.0.1:9", tls=Tls(ca="/nonexistent/ca.crt"))
    with pytest.raises(ValueError, match="needs its private key"):
        Tls(cert=str(ours / "gateway.crt"))
    with pytest.raises(ValueError, match="needs a certificate, its key and the deployment's CA"):
        InternalAuth(Tls(ca=str(ours / "ca.crt")))
    assert "s3cret" not in repr(InternalAuth(secret="s3cret"))  # configs are logged


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1:50051", "[::1]:50051", "localhost:0", "unix:/tmp/gateway.sock"]))
    assert not any(map(is_loopback, ["0.0.0.0:50051", "[::]:50051", ":50051", "10.1.2.3:50051"]))


def test_plaintext_on_a_non_loopback_address_must_be_asked_for(certs, caplog) -> None:
    keys = ApiKeys(["k-1"])
    config = GatewayConfig(verifiers=("v:1",), tokenizer_dir="t", listen="127.0.0.1:0", http_listen="0.0.0.0:8000")
    with pytest.raises(ValueError, match=r"^0\.0\.0\.0:8000: not a loopback address: serve TLS \(--tls-cert, "
                                         r"--tls-key\) or ask for plaintext \(--plaintext\)$"):
        check_transport(config, keys)
    with caplog.at_level(logging.WARNING):
        check_transport(GatewayConfig(verifiers=("v:1",), tokenizer_dir="t", listen="[::]:0", allow_plaintext=True),
                        keys)
    assert "API keys cross [::]:0 in plaintext" in caplog.text and "k-1" not in caplog.text
    check_transport(GatewayConfig(verifiers=("v:1",), tokenizer_dir="t", listen="[::]:0",
                                  tls=Tls(str(certs.ours / "gateway.crt"), str(certs.ours / "gateway.key"))), keys)


def test_the_gateway_command_refuses_plaintext_beside_tls(certs, capsys) -> None:
    code = gateway_main(["--verifiers", "127.0.0.1:9", "--tokenizer", "t", "--plaintext",
                         "--tls-cert", str(certs.ours / "gateway.crt"), "--tls-key", str(certs.ours / "gateway.key")])
    assert code == 2
    assert capsys.readouterr().err == "ddtree-gateway: error: plaintext was asked for beside TLS: choose one\n"


def test_api_keys_from_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "k-1, k-2\nk-3")
    keys, key_file = load_api_keys(None)
    assert key_file is None and len(keys) == 3
    assert keys.authenticate([("authorization", "Bearer k-3")])
    (tmp_path / "keys").write_text("k-4\n")
    with pytest.raises(ValueError, match="--api-keys-file or \\$DDTREE_API_KEYS, not both"):
        load_api_keys(str(tmp_path / "keys"))
    monkeypatch.delenv(API_KEYS_ENV)
    assert not load_api_keys(None)[0].enabled


def test_a_bad_key_file_keeps_the_keys_in_force(tmp_path, caplog) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\nk-old\n")
    key_file = KeyFile(str(path))
    path.write_text("k-new with spaces\n")
    caplog.set_level(logging.INFO)
    key_file.reload_if_changed()
    assert key_file.keys.authenticate([("authorization", "Bearer k-old")])
    assert f"{path}: API keys not reloaded (API keys must be non-empty and contain no whitespace)" in caplog.text
    assert "k-new" not in caplog.text and "k-old" not in caplog.text
    path.write_text("k-new\n")
    key_file.reload_if_changed()
    assert key_file.keys.authenticate([("authorization", "Bearer k-new")])
    assert "API keys reloaded from" in caplog.text and "k-new" not in caplog.text


def test_the_preflight_names_a_certificate_that_does_not_load(tiny_target, certs) -> None:
    env = {**os.environ, "DDTREE_INTERNAL_CA": str(certs.ours / "ca.crt"), "DDTREE_INTERNAL_CERT":
           str(certs.ours / "internal.crt"), "DDTREE_INTERNAL_KEY": str(certs.theirs / "internal.key")}
    result = subprocess.run([sys.executable, "docker/preflight.py", "--target", str(tiny_target), "--drafter", "ngram"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == (f"preflight: error: DDTREE_INTERNAL_CERT, DDTREE_INTERNAL_KEY, DDTREE_INTERNAL_CA: TLS "
                             f"certificate {certs.ours}/internal.crt and key {certs.theirs}/internal.key: the key does "
                             "not match the certificate\n")


# ---- internal calls to a server of this process -------------------------------------------------------

class Echo(drafter_pb2_grpc.DrafterServicer):
    """A drafter's two kinds of call: Info (unary), Draft (a bidirectional stream: one error reply per request)."""

    async def Info(self, request, context):  # noqa: N802 - the generated name
        return drafter_pb2.DrafterInfoReply(replica_id="echo")

    async def Draft(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            yield drafter_pb2.DrafterReply(error=drafter_pb2.DrafterSessionError(session_id=request.close.session_id))


async def calls(channel: grpc.aio.Channel) -> list[str]:
    """Info, one Draft round trip and a health check: each as its outcome's status name."""
    stub = drafter_pb2_grpc.DrafterStub(channel)

    async def draft() -> None:
        close = drafter_pb2.DrafterRequest(close=drafter_pb2.DrafterClose(session_id="s"))
        async for reply in stub.Draft(iter([close]), timeout=10):
            assert reply.error.session_id == "s"

    outcomes = []
    for call in (lambda: stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=10), draft,
                 lambda: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)):
        try:
            await call()
            outcomes.append("OK")
        except grpc.aio.AioRpcError as error:
            outcomes.append(error.code().name)
    return outcomes


def serving(auth: InternalAuth, scenario: Callable[[str], object]) -> None:
    """Run `scenario(address)` against an Echo server that requires `auth`."""
    async def run() -> None:
        server = ServiceServer(DRAFTER_SERVICE, drafter_pb2_grpc.add_DrafterServicer_to_server, Echo(),
                               "127.0.0.1:0", server_options(), auth)
        await server.start()
        try:
            await scenario(f"127.0.0.1:{server.port}")
        finally:
            await server.server.stop(0)
    asyncio.run(run())


def test_mutual_tls_serves_the_deployment_and_refuses_other_callers(certs) -> None:
    async def scenario(address: str) -> None:
        async with internal(certs.ours).channel(address) as channel:
            assert await calls(channel) == ["OK"] * 3
        # NOTE: refused in the handshake, before any call: gRPC cannot ask for a certificate without requiring it
        for name, channel in (("plaintext", grpc.aio.insecure_channel(address)),
                              ("TLS without a client certificate", client_channel(address, trusting(certs.ours))),
                              ("their CA's certificate", internal(certs.theirs).channel(address))):
            async with channel:
                assert await calls(channel) == ["UNAVAILABLE"] * 3, name
    serving(internal(certs.ours), scenario)


def test_the_shared_secret_admits_only_callers_that_carry_it() -> None:
    async def scenario(address: str) -> None:
        async with InternalAuth(secret="s3cret").channel(address) as channel:
            assert await calls(channel) == ["OK"] * 3
        for channel in (grpc.aio.insecure_channel(address), InternalAuth(secret="guess").channel(address)):
            async with channel:
                assert await calls(channel) == ["UNAUTHENTICATED"] * 3
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(), timeout=10)
            assert refused.value.details() == "internal call without the deployment's secret (docs/security.md)"
    serving(InternalAuth(secret="s3cret"), scenario)


# ---- the stack as processes ---------------------------------------------------------------------------------

def wait_serving(address: str, dial: Callable[[str], grpc.aio.Channel], process: subprocess.Popen, log: Path,
                 timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while check(address, timeout_s=1, dial=dial) != "SERVING":
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


@contextlib.contextmanager
def processes() -> Iterator[Callable[..., subprocess.Popen]]:
    """spawn(log, module, *args) starts a service; all are stopped at the end."""
    started: list[subprocess.Popen] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def spawn(log: Path, module: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT,
                                       env={**env, **(extra_env or {})})
        started.append(process)
        return process
    try:
        yield spawn
    finally:
        for process in started:
            process.terminate()
        for process in started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def stack(tiny_target, certs, tmp_path_factory):
    """A drafter, the verifier and a gateway (TLS on gRPC and HTTP, a key file) whose internal links are mutual TLS,
    configured through DDTREE_INTERNAL_* as the compose files do; and a second gateway that requires client
    certificates."""
    logs = tmp_path_factory.mktemp("tls-stack")
    ours = certs.ours
    deployment = {"DDTREE_INTERNAL_CA": str(ours / "ca.crt"), "DDTREE_INTERNAL_CERT": str(ours / "internal.crt"),
                  "DDTREE_INTERNAL_KEY": str(ours / "internal.key")}
    keys = logs / "keys.txt"
    keys.write_text("k-old\n")
    drafter, verifier, gateway, strict = (f"127.0.0.1:{free_port()}" for _ in range(4))
    http, strict_http, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    serve_tls = ("--tls-cert", str(ours / "gateway.crt"), "--tls-key", str(ours / "gateway.key"))
    with processes() as spawn:
        log = {drafter: logs / "drafter.log", verifier: logs / "verifier.log", gateway: logs / "gateway.log",
               strict: logs / "strict.log"}
        started = {
            drafter: spawn(log[drafter], "drafter_service.server", "--drafter", "ngram", "--listen", drafter,
                           extra_env=deployment),
            verifier: spawn(log[verifier], "verifier_service.server", "--target", str(tiny_target),
                            "--listen", verifier, "--drafters", drafter, "--metrics-port", str(metrics),
                            extra_env=deployment),
            gateway: spawn(log[gateway], "gateway.server", "--listen", gateway, "--http-listen", http,
                           "--verifiers", verifier, "--tokenizer", str(tiny_target), "--api-keys-file", str(keys),
                           *serve_tls, extra_env=deployment),
            strict: spawn(log[strict], "gateway.server", "--listen", strict, "--http-listen", strict_http,
                          "--verifiers", verifier,
                          "--tokenizer", str(tiny_target), *serve_tls, "--tls-client-ca", str(ours / "ca.crt"),
                          extra_env=deployment)}
        for address in (drafter, verifier):
            wait_serving(address, internal(ours).channel, started[address], log[address])
        for address, tls in ((gateway, trusting(ours)), (strict, trusting(ours, client_cert=True))):
            wait_serving(address, lambda a, tls=tls: client_channel(a, tls), started[address], log[address])
        yield SimpleNamespace(drafter=drafter, verifier=verifier, gateway=gateway, strict=strict, http=http,
                              strict_http=strict_http,
                              keys=keys, logs=logs, process=started[gateway], deployment=deployment,
                              metrics=f"http://127.0.0.1:{metrics}/metrics")


def test_a_tls_client_generates_through_mutual_tls_links(stack, certs) -> None:
    trees = verifier_metric(stack.metrics, "ddtree_verifier_trees")
    with Client(stack.gateway, api_key="k-old", timeout=60, tls=trusting(certs.ours)) as client:
        generation = client.generate(PROMPT, max_new_tokens=16, ignore_eos=True)
        list(generation)
    assert generation.summary.generated_tokens == 16
    assert verifier_metric(stack.metrics, "ddtree_verifier_trees") > trees  # the drafter answered the verifier

    async def listed() -> list[gateway_pb2.ModelInfo]:
        async with AsyncClient(stack.gateway, api_key="k-old", timeout=30, tls=trusting(certs.ours)) as client:
            return await client.list_models()
    assert len(asyncio.run(listed())) == 1


def expect_failure(client: Client, code: grpc.StatusCode, *fragments: str) -> None:
    with client, pytest.raises(GatewayError) as caught:
        client.list_models()
    assert caught.value.code() == code, caught.value
    for fragment in fragments:
        assert fragment in caught.value.details(), caught.value


def test_a_plaintext_client_and_one_trusting_another_ca_fail_with_clear_statuses(stack, certs) -> None:
    expect_failure(Client(stack.gateway, api_key="k-old", timeout=10), UNAVAILABLE,
                   "the server closed the connection at once: it may require TLS")
    expect_failure(Client(stack.gateway, api_key="k-old", timeout=10, tls=trusting(certs.theirs)), UNAVAILABLE,
                   "the server's certificate is not signed by a trusted CA", "CERTIFICATE_VERIFY_FAILED")
    expect_failure(Client(stack.gateway, timeout=10, tls=trusting(certs.ours)), UNAUTHENTICATED)  # keys still hold
    expect_failure(Client(stack.metrics.removeprefix("http://").removesuffix("/metrics"), timeout=10,
                          tls=trusting(certs.ours)), UNAVAILABLE, "the server does not speak TLS")  # a plaintext port


def test_the_cli_names_the_certificate_problem(stack, certs) -> None:
    def generate(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ddtree.cli", "generate", "Hi", "--max-new-tokens", "4",
                               "--gateway", stack.gateway, "--api-key", "k-old", *options], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
    good = generate("--tls-ca", str(certs.ours / "ca.crt"))
    assert good.returncode == 0, good.stderr
    foreign = generate("--tls-ca", str(certs.theirs / "ca.crt"))
    assert foreign.returncode == 1
    assert foreign.stderr.splitlines()[-1].startswith(  # NOTE: after gRPC's own log line on the handshake
        "error: UNAVAILABLE: the server's certificate is not signed by a trusted CA")
    missing = generate("--tls-ca", "/nonexistent/ca.crt")
    assert (missing.returncode, missing.stderr.splitlines()[-1]) == \
        (2, "error: TLS CA /nonexistent/ca.crt: No such file or directory")


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_dials_a_tls_gateway(stack, certs, tmp_path, backend: str) -> None:
    address = stack.gateway if backend == "grpc" else f"https://{stack.http}"
    report = tmp_path / "report.json"
    args = ["bench", "--backend", backend, "--address", address, "--api-key", "k-old", "--num-requests", "2",
            "--warmup", "0", "--input-len", "8", "--output-len", "4", "--json", str(report)]
    ran = subprocess.run([sys.executable, "-m", "ddtree.cli", *args, "--tls-ca", str(certs.ours / "ca.crt")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(report.read_text())["completed"] == 2
    foreign = subprocess.run([sys.executable, "-m", "ddtree.cli", *args, "--tls-ca", str(certs.theirs / "ca.crt")],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert foreign.returncode != 0 and "certificate" in foreign.stderr.lower(), foreign.stderr


def https_status(url: str, ca: Path, client: Path | None = None) -> int:
    """GET `url` trusting `ca`, with the client certificate of the deployment in `client`."""
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(client / "client.crt", client / "client.key")
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.status


def test_the_http_api_serves_tls(stack, certs) -> None:
    assert https_status(f"https://{stack.http}/health", certs.ours / "ca.crt") == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        https_status(f"https://{stack.http}/health", certs.theirs / "ca.crt")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{stack.http}/health", timeout=10)


def test_internal_ports_refuse_callers_without_the_deployments_certificate(stack, certs, monkeypatch) -> None:
    for address in (stack.drafter, stack.verifier):
        assert check(address, timeout_s=5) == "UNAVAILABLE"  # plaintext
        assert check(address, timeout_s=5, dial=lambda a: client_channel(a, trusting(certs.ours))) == "UNAVAILABLE"
        assert check(address, timeout_s=5, dial=internal(certs.theirs).channel) == "UNAVAILABLE"
    for name, value in stack.deployment.items():  # the container healthcheck's way: the service's variables
        monkeypatch.setenv(name, value)
    assert healthcheck_main([stack.verifier, "--internal"]) == 0
    assert healthcheck_main([stack.verifier]) == 1


def test_a_gateway_that_requires_client_certificates_admits_only_its_cas(stack, certs) -> None:
    with Client(stack.strict, timeout=10, tls=trusting(certs.ours, client_cert=True)) as client:
        assert len(client.list_models()) == 1
    expect_failure(Client(stack.strict, timeout=10, tls=trusting(certs.ours)), UNAVAILABLE,
                   "a client certificate that its CA signed")
    foreign = Tls(str(certs.theirs / "client.crt"), str(certs.theirs / "client.key"), str(certs.ours / "ca.crt"))
    expect_failure(Client(stack.strict, timeout=10, tls=foreign), UNAVAILABLE)
    url, ca = f"https://{stack.strict_http}/health", certs.ours / "ca.crt"  # the HTTP API alike
    assert https_status(url, ca, client=certs.ours) == 200
    for client in (None, certs.theirs):
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            https_status(url, ca, client)


def test_a_rotated_key_file_takes_effect_without_a_restart(stack, certs) -> None:
    def works(key: str) -> bool:
        with Client(stack.gateway, api_key=key, timeout=10, tls=trusting(certs.ours)) as client:
            try:
                client.list_sessions()
            except GatewayError as error:
                assert error.code() == UNAUTHENTICATED, error
                return False
        return True

    def rotated(key: str, timeout_s: float = 10) -> bool:
        deadline = time.monotonic() + timeout_s
        while not works(key):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    assert works("k-old") and not works("k-new")
    stack.keys.write_text("k-new\n")  # noticed by the gateway's housekeeping (a stat a second)
    assert rotated("k-new")
    assert not works("k-old")
    stack.keys.write_text("k-newer\n")
    stack.process.send_signal(signal.SIGHUP)
    assert rotated("k-newer") and not works("k-new")
    assert stack.process.poll() is None
    log = (stack.logs / "gateway.log").read_text()
    assert "API keys reloaded from" in log and "k-new" not in log and "k-old" not in log
