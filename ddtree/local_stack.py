"""`ddtree serve`: gateway, verifier and N drafter replicas as separate processes on this machine."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.progress import Progress
from ddtree.readiness import wait_ready
from proto.serving import BindError, check_bindable

# NOTE: the suffix changes with the tiny model's files (2: a chat template), so an older cache is not reused.
TINY_MODEL_DIR = Path(os.environ.get("DDTREE_CACHE", Path.home() / ".cache" / "ddtree")) / "tiny-model-2"
SERVICES = ("verifier", "drafter", "gateway")
# What precedes the message on a service's log line: the time, the service's tag or none, the level
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ (?:\S+ )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


class Forwarded(NamedTuple):
    """An option of `ddtree serve` passed on to services (under the name `to` where theirs differs)."""
    flag: str
    services: tuple[str, ...]
    type: type  # bool: a switch
    help: str
    to: str | None = None


# What `ddtree serve` passes on when given (else each service keeps its default): one line per option.
FORWARDED = (
    Forwarded("--kv-budget-mb", ("verifier",), float, "KV cache of the whole model, MB"),
    Forwarded("--page-size", ("verifier",), int, "tokens per KV page"),
    Forwarded("--max-context", ("verifier",), int, "longest session, tokens"),
    Forwarded("--tree-budget", ("verifier",), int, "draft tree nodes per step (the adaptive policy's maximum)"),
    Forwarded("--budget-policy", ("verifier",), str, "fixed | adaptive: the tree budget of each step"),
    Forwarded("--draft-timeout-s", ("verifier",), float, "how long a step waits for its draft"),
    Forwarded("--session-lease-s", ("verifier",), float, "a session no gateway renews is released after this"),
    Forwarded("--attention", ("verifier",), str, "auto | torch | triton"),
    Forwarded("--no-cuda-graphs", ("verifier",), bool, "run every forward eagerly"),
    Forwarded("--dtype", ("verifier", "drafter"), str, "float32 | float16 | bfloat16 (default: the checkpoint's)"),
    Forwarded("--verifier-metrics-port", ("verifier",), int, "the verifier's Prometheus port", to="--metrics-port"),
    Forwarded("--context-window", ("drafter",), int, "the drafter's context window W; 0 = unlimited"),
    Forwarded("--http-listen", ("gateway",), str, "the OpenAI-compatible HTTP API's host:port (default: 127.0.0.1 "
              "on a free port; '' = off)"),
    Forwarded("--session-ttl-s", ("gateway",), float, "idle time before a session is released"),
    Forwarded("--api-keys-file", ("gateway",), str, "one API key per line; absent: no auth"),
    Forwarded("--metrics-port", ("gateway",), int, "the gateway's Prometheus port"),
    Forwarded("--max-sessions-per-key", ("gateway",), int, "sessions one API key may hold"),
    Forwarded("--kv-share-per-key", ("gateway",), float, "share of the KV tokens one API key may hold"),
    Forwarded("--quota-by", ("gateway",), str, "key | peer: what quotas count against"),
    Forwarded("--max-new-tokens-limit", ("gateway",), int, "largest max_new_tokens a request may ask"),
    Forwarded("--default-max-new-tokens", ("gateway",), int, "max_new_tokens of a request that sets none"),
)


def add_forwarded_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("passed on to the services (default: theirs)")
    for option in FORWARDED:
        kind = {"action": "store_true"} if option.type is bool else {"type": option.type}
        group.add_argument(option.flag, help=f"{'/'.join(option.services)}: {option.help}", **kind)


def forwarded_args(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The command-line words each service gets from the forwarded options that `args` sets."""
    words: dict[str, list[str]] = {service: [] for service in SERVICES}
    for option in FORWARDED:
        value = getattr(args, option.flag.removeprefix("--").replace("-", "_"))
        if value is None or value is False:
            continue
        for service in option.services:
            words[service] += [option.to or option.flag, *(() if value is True else (str(value),))]
    return {service: tuple(service_words) for service, service_words in words.items()}


class StartFailed(RuntimeError):
    """A process of the stack did not come up; the message names it, the cause and its log."""


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now that this process has not handed out before: two calls in a row could otherwise name the
    same port, since neither is bound until its server starts."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_healthy(address: str, timeout_s: float, process: subprocess.Popen | None = None,
                 on_poll: Callable[[], None] = lambda: None) -> None:
    """Poll grpc.health.v1 until SERVING, calling `on_poll` before each poll; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            on_poll()
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{' '.join(process.args[2:4])} exited with code {process.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout_s:.0f} s")


def last_line(log: Path, tail_bytes: int = 4096) -> str:
    """A dead service's cause: the last line of its log, which is its one-line start error ('PROG: error: CAUSE',
    given as CAUSE) or a traceback's last line."""
    with open(log, "rb") as file:
        file.seek(max(0, file.seek(0, os.SEEK_END) - tail_bytes))
        lines = file.read().decode(errors="replace").splitlines()
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return last.split(": error: ", 1)[-1]


def _log_message(line: str) -> str:
    """A service's log line without its time, tag and level: what it says it does."""
    return _LOG_PREFIX.sub("", line, count=1)


def _http_listen(gateway_args: tuple[str, ...]) -> str:
    """The gateway's HTTP address: the `--http-listen` among its arguments (as `ddtree serve` forwards it), else
    loopback on a free port."""
    words = list(gateway_args)
    return words[words.index("--http-listen") + 1] if "--http-listen" in words else f"127.0.0.1:{free_port()}"


def ensure_tiny_model() -> tuple[Path, Path]:
    """The built-in model: made once (seeded, deterministic), then reused."""
    target, drafter = TINY_MODEL_DIR / "target", TINY_MODEL_DIR / "dflash"
    if not (drafter / "config.json").is_file():
        from modeling.tiny import make_tiny_drafter, make_tiny_target

        make_tiny_target(target, seed=0)
        make_tiny_drafter(drafter, target, seed=1)
    return target, drafter


@dataclass
class LocalStack:
    target: str
    drafter: str = "ngram"  # DFlash directory, 'ngram' or 'none'
    drafters: int = 1
    device: str = "cpu"
    gateway_listen: str = "127.0.0.1:50051"
    verifier_args: tuple[str, ...] = ()
    drafter_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: Path | str | None = None  # created if missing; None: a new temporary directory
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    http_url: str | None = None  # the gateway's OpenAI-compatible API (base URL, .../v1) once started; None: off
    commands: dict[str, list[str]] = field(default_factory=dict)  # what each process was started with

    def __post_init__(self) -> None:
        # NOTE: a child that fails at start says why only in its log, so there always is one
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="ddtree-serve-"))

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawn(self, name: str, module: str, *args: str) -> subprocess.Popen:
        self.commands[name] = [sys.executable, "-m", module, *args]
        return self._run(name, "wb")

    def _run(self, name: str, log_mode: str) -> subprocess.Popen:
        env = dict(os.environ)
        if self.device == "cpu":
            # NOTE: on a small CPU machine intra-op threads fight the event loops and each other: one each.
            env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log_path(name), log_mode) as log:
            process = subprocess.Popen(self.commands[name], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.processes[name] = process
        return process

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every process and wait until each serves; StartFailed (the others stopped) when one does not."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            # NOTE: before any child: the gateway's health check would find the other server and pass
            check_bindable(self.gateway_listen)
        except BindError as error:
            raise StartFailed(f"gateway failed to start: {error}") from None
        try:
            drafter_addresses = [self._start_drafter(i) for i in range(self.drafters if self.drafter != "none" else 0)]
            verifier = f"127.0.0.1:{free_port()}"
            self.addresses["verifier"] = verifier
            self._spawn("verifier", "verifier_service.server", "--target", self.target, "--listen", verifier,
                        "--drafters", ",".join(drafter_addresses), "--device", self.device, *self.verifier_args)
            http = _http_listen(self.gateway_args)
            self._spawn("gateway", "gateway.server", "--listen", self.gateway_listen, "--http-listen", http,
                        "--verifiers", verifier, "--tokenizer", self.target, *self.gateway_args)
            self.http_url = f"http://{http}/v1" if http else None
            self.addresses["gateway"] = self.gateway_listen
            with Progress("starting the stack", len(self.addresses), unit="services") as progress:
                for name, address in self.addresses.items():
                    self._wait_healthy(name, address, timeout_s, progress)
                    progress.advance()
            # NOTE: the verifier connects its drafters, and the gateway its verifier, a moment after they serve (the
            # verifier decodes plainly meanwhile); what is still missing after that, `readiness.check` tells
            wait_ready(self.addresses, within_s=min(timeout_s, 10.0))
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, name: str, address: str, timeout_s: float, progress: Progress | None = None) -> None:
        """Until the process serves; meanwhile `progress` shows what its log says it does."""
        process = self.processes[name]
        on_poll = (lambda: progress.note(self._doing(name))) if progress else lambda: None
        try:
            wait_healthy(address, timeout_s, process, on_poll)
        except TimeoutError as error:
            raise self._failed(name, str(error)) from None
        except RuntimeError:  # it exited
            raise self._failed(name, last_line(self.log_path(name)) or f"exit status {process.returncode}") from None

    def _doing(self, name: str) -> str:
        """A starting process and what its log says it does."""
        message = _log_message(last_line(self.log_path(name)))
        return f"{name}: {message}" if message else name

    def _failed(self, name: str, cause: str) -> StartFailed:
        return StartFailed(f"{name} failed to start: {cause} (log: {self.log_path(name)})")

    def _start_drafter(self, index: int) -> str:
        name, address = f"drafter-{index}", f"127.0.0.1:{free_port()}"
        self.addresses[name] = address
        self._spawn(name, "drafter_service.server", "--drafter", self.drafter, "--target", self.target,
                    "--listen", address, "--device", self.device, "--replica-id", name, *self.drafter_args)
        return address

    def kill(self, name: str) -> None:
        """Kill one process hard (failure tests)."""
        self.processes[name].kill()
        self.processes[name].wait()

    def pause(self, name: str) -> None:
        """Freeze one process (SIGSTOP): alive, holding its sockets, answering nothing (failure tests)."""
        self.processes[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGCONT)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a process again as it was first started (same address; its log goes on) and wait until it
        serves; a running one is killed first."""
        if self.processes[name].poll() is None:
            self.kill(name)
        self._run(name, "ab")
        self._wait_healthy(name, self.addresses[name], timeout_s)

    def stop(self, grace_s: float = 10.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
