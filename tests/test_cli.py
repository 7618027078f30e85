"""What `ddtree` and the three services tell a user when something is wrong (one line, a status, no traceback),
how they hold their ports, and the keepalive that makes a frozen peer fail calls instead of hanging them.
Real processes where the behaviour is a process's (exit status, stderr, ports)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree import cli, client_cli
from ddtree.client_cli import for_terminal
from ddtree.local_stack import (
    FORWARDED,
    LocalStack,
    StartFailed,
    forwarded_args,
    free_port,
    last_line,
    wait_healthy,
)
from proto import common_pb2
from proto.serving import BindError, bind, channel_options, describe, server_options

SERVING = health_pb2.HealthCheckResponse.SERVING
# A server that serves only grpc.health.v1, with the options and binding every ddtree server uses
HEALTH_SERVER = """
import asyncio
import grpc
from proto.serving import add_health_and_reflection, bind, mark_serving, server_options, wait_for_termination_signal

async def main():
    server = grpc.aio.server(options=server_options())
    health = add_health_and_reflection(server, [])
    port = bind(server, "127.0.0.1:0")
    await server.start()
    await mark_serving(health, [])
    print(port, flush=True)
    await wait_for_termination_signal()
    await server.stop(0)

asyncio.run(main())
"""


def run(*argv: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """Run a command in a session of its own; on timeout its whole process group is killed (children too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


@contextlib.contextmanager
def started(*argv: str) -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)  # a test may have stopped it
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


@pytest.fixture
def health_server() -> Iterator[tuple[subprocess.Popen, str]]:
    with started(sys.executable, "-c", HEALTH_SERVER) as process:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        port = process.stdout.readline().strip() if ready else ""
        assert port.isdigit(), f"the health server did not start: {port!r}"
        yield process, f"127.0.0.1:{port}"


def watch(channel: grpc.Channel) -> grpc.Future:
    """A server-streaming call that stays open (grpc.health.v1 Watch), its first reply read."""
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    assert next(call).status == SERVING
    return call


def test_keepalive_fails_a_stream_to_a_frozen_server(health_server):
    process, address = health_server
    with grpc.insecure_channel(address, options=channel_options(keepalive_s=1, keepalive_timeout_s=1)) as channel:
        call = watch(channel)
        process.send_signal(signal.SIGSTOP)
        started_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            next(call)
        waited_s = time.monotonic() - started_at
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE, failure.value.details()
    assert waited_s < 8, f"the frozen server was noticed after {waited_s:.1f} s"


def test_keepalive_pings_do_not_get_a_healthy_server_to_disconnect(health_server):
    """The server's defaults answer pings every second with GOAWAY too_many_pings, which cuts the stream."""
    _, address = health_server
    with grpc.insecure_channel(address, options=channel_options(keepalive_s=1, keepalive_timeout_s=1)) as channel:
        call = watch(channel)
        time.sleep(5)
        assert not call.done(), f"the stream ended: {call.code()} {call.details()}"
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        call.cancel()
    assert reply.status == SERVING


def test_server_options_refuse_a_port_another_server_holds():
    """SO_REUSEPORT (gRPC's default) would let the second server bind too and take part of the traffic."""
    async def bind_twice() -> None:
        first, second = grpc.aio.server(options=server_options()), grpc.aio.server(options=server_options())
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            with pytest.raises(RuntimeError):  # gRPC's own refusal, without bind()'s check before it
                second.add_insecure_port(f"127.0.0.1:{port}")
            with pytest.raises(BindError, match=rf"^127\.0\.0\.1:{port} is already in use \(another server\?\)$"):
                bind(second, f"127.0.0.1:{port}")
        finally:
            await first.stop(0)
    asyncio.run(bind_twice())


def test_a_second_server_on_a_taken_port_exits_2_and_says_so():
    address = f"127.0.0.1:{free_port()}"
    drafter = (sys.executable, "-m", "drafter_service.server", "--drafter", "ngram", "--listen", address)
    with started(*drafter) as first:
        wait_healthy(address, 60, first)
        second = run(*drafter, timeout_s=60)
        assert first.poll() is None
    assert second.returncode == 2
    assert second.stderr == f"ddtree-drafter: error: {address} is already in use (another server?)\n"


def test_a_taken_metrics_port_is_a_start_failure_naming_it(tiny_target):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run(sys.executable, "-m", "gateway.server", "--listen", f"127.0.0.1:{free_port()}", "--verifiers",
                     "127.0.0.1:9", "--tokenizer", str(tiny_target), "--metrics-port", str(port), timeout_s=60)
    assert result.returncode == 2
    expected = f"ddtree-gateway: error: 127.0.0.1:{port} is already in use (another server?)"
    assert result.stderr.splitlines()[-1] == expected


def test_a_service_with_a_missing_checkpoint_exits_2_with_one_line():
    result = run(sys.executable, "-m", "verifier_service.server", "--target", "/nonexistent", timeout_s=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("ddtree-verifier: error: /nonexistent/config.json not found")


def test_serve_reports_the_child_that_failed_and_its_log(tmp_path):
    log_dir = tmp_path / "new" / "logs"
    result = run(sys.executable, "-m", "ddtree.cli", "serve", "--target", "/nonexistent", "--drafter", "none",
                 "--log-dir", str(log_dir), "--listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 1
    starting, *progress, error = result.stderr.splitlines()
    assert starting.startswith("starting ") and str(log_dir) in starting
    assert all(line.startswith("starting the stack: ") for line in progress)
    assert error.startswith("error: verifier failed to start: /nonexistent/config.json not found")
    assert error.endswith(f"(log: {log_dir / 'verifier.log'})")
    assert (log_dir / "verifier.log").is_file()


def test_serve_refuses_a_taken_gateway_port_before_starting_anything(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        stack = LocalStack("/nonexistent", gateway_listen=address, log_dir=tmp_path)
        with pytest.raises(StartFailed, match=rf"^gateway failed to start: {address} is already in use"):
            stack.start()
    assert stack.processes == {}


SERVE_OPTIONS = ("--kv-budget-mb", "12.5", "--page-size", "16", "--max-context", "4096", "--tree-budget", "8",
                 "--draft-timeout-s", "0.5", "--attention", "triton", "--no-cuda-graphs", "--dtype", "float32",
                 "--verifier-metrics-port", "9101", "--context-window", "256", "--session-ttl-s", "30",
                 "--api-keys-file", "keys.txt", "--metrics-port", "9100", "--max-sessions-per-key", "3",
                 "--max-new-tokens-limit", "100", "--default-max-new-tokens", "10", "--http-listen", "127.0.0.1:8123")


def test_forwarded_options_reach_the_child_command_lines(monkeypatch, tmp_path):
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(LocalStack, "_spawn", lambda stack, name, module, *args: spawned.update({name: list(args)}))
    monkeypatch.setattr(LocalStack, "_wait_healthy", lambda *_: None)
    args = cli.build_parser().parse_args(["serve", "--target", "T", "--drafters", "2", *SERVE_OPTIONS])
    forwarded = forwarded_args(args)
    LocalStack("T", "D", 2, verifier_args=forwarded["verifier"], drafter_args=forwarded["drafter"],
               gateway_args=forwarded["gateway"], gateway_listen=f"127.0.0.1:{free_port()}", log_dir=tmp_path).start()

    verifier = build_service_parser("verifier").parse_args(spawned["verifier"])
    assert (verifier.kv_budget_mb, verifier.page_size, verifier.max_context) == (12.5, 16, 4096)
    assert (verifier.tree_budget, verifier.draft_timeout_s, verifier.attention) == (8, 0.5, "triton")
    assert (verifier.no_cuda_graphs, verifier.dtype, verifier.metrics_port) == (True, "float32", 9101)
    for name in ("drafter-0", "drafter-1"):
        drafter = build_service_parser("drafter").parse_args(spawned[name])
        assert (drafter.context_window, drafter.dtype) == (256, "float32")
    gateway = build_service_parser("gateway").parse_args(spawned["gateway"])
    assert (gateway.session_ttl_s, gateway.api_keys_file, gateway.metrics_port) == (30.0, "keys.txt", 9100)
    assert (gateway.max_sessions_per_key, gateway.max_new_tokens_limit, gateway.default_max_new_tokens) == (3, 100, 10)
    assert gateway.http_listen == "127.0.0.1:8123"


def test_options_not_given_are_not_forwarded():
    args = cli.build_parser().parse_args(["serve"])
    assert forwarded_args(args) == {"verifier": (), "drafter": (), "gateway": ()}


def test_every_forwarded_option_is_one_its_service_takes():
    for option in FORWARDED:
        for service in option.services:
            flags = build_service_parser(service)._option_string_actions
            assert (option.to or option.flag) in flags, f"{service} has no {option.to or option.flag}"


def build_service_parser(service: str):
    from drafter_service.server import build_parser as drafter_parser
    from gateway.server import build_parser as gateway_parser
    from verifier_service.server import build_parser as verifier_parser

    return {"verifier": verifier_parser, "drafter": drafter_parser, "gateway": gateway_parser}[service]()


@pytest.mark.parametrize(("options", "message"), [
    (("--temperature", "-1"), "temperature must be in [0, 100], got -1.0"),
    (("--max-new-tokens", "0"), "max_new_tokens must be in [1, "),
    (("--prompt-ids", "1,2,99999"), "prompt token 99999 is outside the vocabulary [0, "),
    (("--prompt-ids", "1,x"), "--prompt-ids takes comma-separated token ids, got '1,x'"),
])
def test_offline_reports_bad_parameters_in_one_line(tiny_target, capsys, options, message):
    argv = ["offline", "--target", str(tiny_target), "--drafter", "none", "--prompt-ids", "1,2", *options]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_offline_reports_a_missing_checkpoint_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["offline", "--target", "/nonexistent", "--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: /nonexistent/config.json not found") and err.count("\n") == 1


def test_describe_gives_one_line_for_a_user():
    assert describe(FileNotFoundError(2, "No such file or directory", "/x/config.json")) == "/x/config.json not found"
    assert describe(ValueError("page_size must be one of (16, 32)\nmore")) == "page_size must be one of (16, 32)"
    assert describe(AssertionError("Torch not compiled with CUDA enabled")) == (
        "AssertionError: Torch not compiled with CUDA enabled")
    assert describe(KeyError("hidden_size")) == "KeyError: 'hidden_size'"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_for_a_terminal_has_its_control_characters_escaped():
    text = "red \x1b[31mtext\x1b[0m\x07 back\b\r over\x9b, tab\tand\nnewline stay, \x7f, é 中"
    assert for_terminal(text, Terminal()) == (
        "red \\x1b[31mtext\\x1b[0m\\x07 back\\x08\\x0d over\\x9b, tab\tand\nnewline stay, \\x7f, é 中")
    assert for_terminal(text, io.StringIO()) == text  # a pipe or a file: unchanged


def test_generate_escapes_what_it_streams_to_a_terminal(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    summary = SimpleNamespace(stop_reason=0, session="", generated_tokens=1, ttft_ms=1.0, tokens_per_second=1.0,
                              mean_acceptance_length=1.0)
    client = SimpleNamespace(generate=lambda text, **_: Generation([SimpleNamespace(text="a\x1b[2Jb")], summary))
    client_cli._generate(cli.build_parser().parse_args(["generate", "hi"]), client)
    assert terminal.getvalue() == "a\\x1b[2Jb\n"


class Generation(list):
    def __init__(self, chunks: list, summary: SimpleNamespace | None) -> None:
        super().__init__(chunks)
        self.summary = summary
        self.text = "".join(chunk.text for chunk in chunks)
        self.token_ids = [0] * len(chunks)

    def events(self) -> list:
        return self


@pytest.mark.parametrize("summary", [None, SimpleNamespace(stop_reason=common_pb2.STOP_REASON_ERROR)])
def test_generate_exits_1_when_the_generation_ends_without_a_result(monkeypatch, capsys, summary):
    """A stream that ends with no summary, or with an error stop, is a failure: status 1 and one line."""
    client = SimpleNamespace(generate=lambda text, **_: Generation([SimpleNamespace(text="part")], summary))
    with pytest.raises(SystemExit) as exit_:
        client_cli._generate(cli.build_parser().parse_args(["generate", "hi"]), client)
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    assert out == "part\n" and err.strip() == "error: the generation failed after 1 tokens (no status from the gateway)"


def test_a_local_stack_without_a_log_dir_logs_to_a_new_temporary_one():
    stack = LocalStack("T")
    assert stack.log_dir.is_dir() and stack.log_dir.name.startswith("ddtree-serve-")
    stack.log_dir.rmdir()


def test_the_cause_of_a_failed_start_is_the_last_line_of_the_log(tmp_path):
    log = tmp_path / "verifier.log"
    log.write_text("INFO loading\nddtree-verifier: error: /typo/config.json not found\n")
    assert last_line(log) == "/typo/config.json not found"
    log.write_text("Traceback (most recent call last):\n  File ...\nKeyError: 'hidden_size'\n\n")
    assert last_line(log) == "KeyError: 'hidden_size'"
