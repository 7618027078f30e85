"""What an operator sees: `ddtree serve` on the tiny model (progress while it starts, in its logs; one status block
once it serves, and a reason for what is not ready), and `ddtree chat` driven through a pseudo-terminal as a user
drives it: turns on one session, /fork, /stats, Ctrl-C during an answer and at the prompt, Ctrl-D."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from ddtree.client import Client
from ddtree.local_stack import free_port
from ddtree.readiness import Readiness, check, gateway_row, verifier_row
from proto import gateway_pb2, verifier_pb2

# The child makes the pseudo-terminal its controlling terminal, as a login shell does: Ctrl-C typed there is a
# SIGINT to it. It starts the command with SIGINT ignored, as a script's background job does, which a chat must
# undo to hear Ctrl-C. (No fork in this process: grpc threads run here.)
ON_A_TERMINAL = ("import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                 "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                 "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
HANDLE = r"[\w-]+"
# The verifier's default 256 MiB of KV over the tiny model's 1 KiB per token (4 layers, K and V, 2 heads of 16 fp32)
KV_TOKENS = 256 << 10


class Terminal:
    """A command on a pseudo-terminal of its own: `type` what a user types, `expect` what it shows."""

    def __init__(self, *argv: str):
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen([sys.executable, "-c", ON_A_TERMINAL, *argv], stdin=slave, stdout=slave,
                                        stderr=slave, start_new_session=True,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.close(slave)
        self.shown, self.read_to = "", 0

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def expect(self, pattern: str, timeout_s: float = 60.0) -> re.Match:
        """The first match of `pattern` in what the terminal shows after the previous match."""
        deadline, regex = time.monotonic() + timeout_s, re.compile(pattern)
        while not (match := regex.search(self.shown, self.read_to)):
            ready, _, _ = select.select([self.master], [], [], max(0.0, deadline - time.monotonic()))
            try:
                data = os.read(self.master, 4096) if ready else b""
            except OSError:  # EIO: the command exited and closed the terminal
                data = b""
            assert data, f"no {pattern!r} within {timeout_s} s; the terminal shows {self.shown[self.read_to:]!r}"
            self.shown += data.decode(errors="replace")
        self.read_to = match.end()
        return match

    def wait(self) -> int:
        return self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.master)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`ddtree serve` on the built-in tiny model (made in a fresh cache): its stdout up to the end of the status
    block, its stderr in a file, and the services' logs."""
    logs, cache = tmp_path_factory.mktemp("serve-logs"), tmp_path_factory.mktemp("cache")
    gateway = f"127.0.0.1:{free_port()}"
    with open(logs / "serve.stderr", "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "serve", "--listen", gateway, "--log-dir",
                                    str(logs)], stdout=subprocess.PIPE, stderr=stderr,
                                   env={**os.environ, "DDTREE_CACHE": str(cache), "OMP_NUM_THREADS": "1"})
    try:
        shown, deadline = "", time.monotonic() + 180
        while not re.search(r"^(ready|not ready: .*)\n", shown, re.M):
            ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            data = os.read(process.stdout.fileno(), 4096) if ready else b""
            assert data, f"ddtree serve ended or hung after {shown!r}: {(logs / 'serve.stderr').read_text()}"
            shown += data.decode()
        yield SimpleNamespace(gateway=gateway, logs=logs, stdout=shown.splitlines())
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        process.stdout.close()


@contextmanager
def chat(served: SimpleNamespace, *options: str) -> Iterator[Terminal]:
    terminal = Terminal("-m", "ddtree.cli", "chat", "--gateway", served.gateway, *options)
    try:
        terminal.expect(rf"\[chat with target at {re.escape(served.gateway)}; /help lists the commands\]")
        yield terminal
    finally:
        terminal.close()


def stats(terminal: Terminal) -> tuple[str, int]:
    """/stats: the session's handle and its tokens; returns once the prompt is back (the terminal is then in
    readline's mode: Ctrl-D typed earlier would have been lost in the switch)."""
    terminal.type("/stats\n")
    session = terminal.expect(rf"\[session ({HANDLE}): (\d+) tokens\]")
    terminal.expect(r"\[last: \d+ answers, \d+ tokens in \d+ steps, acceptance [0-9.]+ tokens/step.*\r\n.*> ")
    return session[1], int(session[2])


def test_serve_prints_one_status_block_when_ready(served) -> None:
    header = next(i for i, line in enumerate(served.stdout) if line.startswith("service"))
    assert served.stdout[header].split() == ["service", "address", "model", "dtype", "device", "KV", "tokens",
                                             "graphs", "connected"]
    rows = {line.split()[0]: line.split()[1:] for line in served.stdout[header + 1:-1]}
    assert served.stdout[-1] == "ready" and set(rows) == {"gateway", "verifier", "drafter-0"}
    assert rows["gateway"] == [served.gateway, "target", "-", "-", "-", "-", "1/1", "verifiers"]
    assert rows["verifier"][1:] == ["target", "float32", "cpu", str(KV_TOKENS), "0", "1/1", "drafters"]
    assert rows["drafter-0"][1:] == ["dflash", "float32", "cpu", "-", "0", "-"]


def test_serve_shows_the_progress_of_its_start_in_its_logs(served) -> None:
    verifier, drafter = ((served.logs / f"{name}.log").read_text() for name in ("verifier", "drafter-0"))
    assert re.search(r" verifier INFO loading weights from target: 0\.0/[0-9.]+ kB \(0%\), shard 1/\d, 0 s\n",
                     verifier)
    assert re.search(r" verifier INFO loading weights from target: done, [0-9.]+ kB in [0-9.]+ s\n", verifier)
    for checkpoint in ("dflash", "target"):  # the drafter reads its own weights, then the target's embedding
        assert re.search(rf" drafter INFO loading weights from {checkpoint}: done, [0-9.]+ kB in", drafter)
    serve = (served.logs / "serve.stderr").read_text()
    assert re.search(r"^starting the stack: 0/3 services \(0%\), 0 s$", serve, re.M)
    assert re.search(r"^starting the stack: done, 3 services in [0-9.]+ s$", serve, re.M)


def test_the_status_block_gives_a_reason_for_what_is_not_ready() -> None:
    verifier, waiting = verifier_row("10.0.0.2:50053", verifier_pb2.VerifierInfoReply(
        model_name="Qwen3-8B", page_size=16, kv_capacity_pages=1000, dtype="bfloat16", device="cuda:0",
        cuda_graphs=31, drafters_connected=1), drafters=2)
    gateway, unseen = gateway_row("10.0.0.1:50051", gateway_pb2.InfoReply(verifiers=1, verifiers_up=0))
    assert Readiness([gateway, verifier], unseen + waiting).block().splitlines() == [
        "service   address         model     dtype     device  KV tokens  graphs  connected",
        "gateway   10.0.0.1:50051  -         -         -       -          -       0/1 verifiers",
        "verifier  10.0.0.2:50053  Qwen3-8B  bfloat16  cuda:0  16000      31      1/2 drafters"]
    assert unseen + waiting == [
        "the gateway has 0 of 1 verifiers serving",
        "the verifier has 1 of 2 drafters connected (it decodes without speculation until they are)"]
    assert check({"verifier": "127.0.0.1:9"}, timeout_s=2).problems == ["verifier does not answer Info: UNAVAILABLE"]


def test_chat_turns_go_to_one_session_and_fork_keeps_the_parent(served) -> None:
    with chat(served, "--max-new-tokens", "8") as terminal, Client(served.gateway, timeout=30) as client:
        terminal.type("hello\n")
        first, tokens = stats(terminal)
        terminal.type("and again\n")
        session, more = stats(terminal)
        assert session == first and more > tokens
        assert [info.session for info in client.list_sessions()] == [first]  # no new session per turn
        terminal.type("/fork\n")
        fork = terminal.expect(rf"\[on fork ({HANDLE}); ({HANDLE}) stays as it was")
        assert fork[2] == first != fork[1]
        terminal.type("on the fork\n")
        assert stats(terminal)[0] == fork[1]
        assert client.get_session(first).num_tokens == more  # the parent as it was
        terminal.type("/quit\n")
        terminal.expect(rf"\[session {fork[1]} stays until it idles out")
        assert terminal.wait() == 0
        for info in client.list_sessions():
            client.release_session(info.session)


def test_ctrl_c_stops_the_answer_not_the_conversation(served) -> None:
    with Client(served.gateway, timeout=30) as client:
        handle = client.chat([{"role": "user", "content": "hi"}], keep_session=True, max_new_tokens=4)
        handle.result()
        start = client.get_session(handle.summary.session).num_tokens
        with chat(served, "--session", handle.summary.session, "--max-new-tokens", "4000", "--ignore-eos") as terminal:
            terminal.type("tell me everything\n")
            terminal.expect(r"everything\r\n")
            time.sleep(1.0)  # while the answer streams
            terminal.type("\x03")
            terminal.expect(r"\[stopped\]")
            session, tokens = stats(terminal)
            assert session == handle.summary.session and start < tokens < start + 4000
            assert not client.get_session(session).generating
            terminal.type("\x03")  # at the prompt: a reminder, nothing more
            terminal.expect(r"\[/quit or Ctrl-D leaves\]")
            assert stats(terminal) == (session, tokens)
            terminal.type("\x04")  # Ctrl-D on an empty line
            terminal.expect(rf"\[session {session} stays until it idles out")
            assert terminal.wait() == 0
        client.release_session(session)
