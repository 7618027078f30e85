"""`ddtree serve`: gateway, verifier and N drafter replicas as separate processes on this machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TINY_MODEL_DIR = Path(os.environ.get("DDTREE_CACHE", Path.home() / ".cache" / "ddtree")) / "tiny-model"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(address: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll grpc.health.v1 until SERVING; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
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
    gateway_args: tuple[str, ...] = ()
    log_dir: Path | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)

    def _spawn(self, name: str, module: str, *args: str) -> subprocess.Popen:
        log = subprocess.DEVNULL if self.log_dir is None else open(Path(self.log_dir) / f"{name}.log", "wb")  # noqa: SIM115
        env = dict(os.environ)
        if self.device == "cpu":
            # NOTE: on a small CPU machine intra-op threads fight the event loops and each other: one each.
            env.setdefault("OMP_NUM_THREADS", "1")
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT,
                                   env=env)
        self.processes[name] = process
        return process

    def start(self, timeout_s: float = 120.0) -> None:
        try:
            drafter_addresses = [self._start_drafter(i) for i in range(self.drafters if self.drafter != "none" else 0)]
            verifier = f"127.0.0.1:{free_port()}"
            self.addresses["verifier"] = verifier
            self._spawn("verifier", "verifier_service.server", "--target", self.target, "--listen", verifier,
                        "--drafters", ",".join(drafter_addresses), "--device", self.device, *self.verifier_args)
            self._spawn("gateway", "gateway.server", "--listen", self.gateway_listen, "--verifiers", verifier,
                        "--tokenizer", self.target, *self.gateway_args)
            self.addresses["gateway"] = self.gateway_listen
            for name, address in self.addresses.items():
                wait_healthy(address, timeout_s, self.processes[name])
        except BaseException:
            self.stop()
            raise

    def _start_drafter(self, index: int) -> str:
        name, address = f"drafter-{index}", f"127.0.0.1:{free_port()}"
        self.addresses[name] = address
        self._spawn(name, "drafter_service.server", "--drafter", self.drafter, "--target", self.target,
                    "--listen", address, "--device", self.device, "--replica-id", name)
        return address

    def kill(self, name: str) -> None:
        """Kill one process hard (failure tests)."""
        self.processes[name].kill()
        self.processes[name].wait()

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
