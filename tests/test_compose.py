"""The docker compose deployment, for real (marker `docker`; deselect with -m "not docker").

scripts/docker_setup.sh prepares the host (dockerd, the debootstrap base image, host wheels); the CPU variant
is built and brought up with `--scale drafter=2`; generations go through the published gateway with the
Python client and must equal `ddtree offline` on the checkpoint the containers made; the verifier's metrics
must show both drafter replicas; a drafter container is stopped mid-generation. The GPU file is checked
through `docker-compose config` (it cannot run here). Docker is driven through the compose CLI to bring the
stack up and down, and through the `docker` SDK to inspect, stop and read containers. Afterwards the host is as
it was, but for the packages and docker/wheels: the images the run built are removed, and so are the base image
and the daemon when docker_setup.sh made them for this run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ddtree.client import Client, Generation
from ddtree.local_stack import free_port, wait_healthy

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[1]
GPU_FILE, CPU_FILE = "docker-compose.yml", "docker-compose.cpu.yml"
EXTRA_DRAFTER_FILE = "docker/compose.extra-drafter.yml"
SERVICES = {"gateway", "verifier", "drafter"}
PROMPT = "The cat sat on the mat. The cat"
MAX_NEW = 32


def compose_env(**values: str) -> dict[str, str]:
    """This process's environment without DDTREE_* settings (they would change the files' defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    return {**env, **values}


def compose_config(*files: str) -> dict:
    args = [arg for file in files for arg in ("-f", file)]
    out = subprocess.run(["docker-compose", *args, "config"], cwd=REPO, env=compose_env(), check=True,
                         capture_output=True, text=True).stdout
    return yaml.safe_load(out)


def gpus(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    return [gpu for d in devices for gpu in d["device_ids"]]


def flag(service: dict, name: str) -> str | None:
    command = service["command"]
    return command[command.index(name) + 1] if name in command else None


def proc_stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat past the command name (state, parent pid, ...); None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def running(pid: int) -> bool:
    """A zombie (exited, not reaped yet by the init that adopted it) does not count."""
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if (stat := proc_stat(p.name)) and int(stat[1]) == pid]


def stop_dockerd(pid: int, timeout_s: float = 60) -> None:
    """SIGTERM: dockerd stops the containerd it started (a child of its own) and exits; both are waited for, and
    killed when late. A pid that is no dockerd any more is left alone."""
    if not running(pid) or Path(f"/proc/{pid}/comm").read_text().strip() != "dockerd":
        return
    processes = [pid, *children(pid)]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    for late in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(late, signal.SIGKILL)
    assert not alive, f"dockerd {pid} and its children did not stop within {timeout_s:.0f} s: {alive}"


def undo_docker_setup(record: Path) -> None:
    """What scripts/docker_setup.sh listed as started or built by it: the base image goes, then the daemon stops."""
    done = [line.split(" ", 1) for line in record.read_text().splitlines()] if record.exists() else []
    try:
        for what, name in done:
            if what == "image":
                subprocess.run(["docker", "image", "rm", name], check=True, stdout=subprocess.DEVNULL)
    finally:
        for what, pid in done:
            if what == "dockerd":
                stop_dockerd(int(pid))


@pytest.fixture(scope="module")
def docker_client(tmp_path_factory):
    record = tmp_path_factory.mktemp("docker-setup") / "record"
    env = {**os.environ, "PYTHON": sys.executable, "DDTREE_DOCKER_RECORD": str(record)}
    try:
        subprocess.run(["bash", "scripts/docker_setup.sh"], cwd=REPO, env=env, check=True, timeout=900)
        import docker  # the test extra; imported here so that -m "not docker" runs need no docker package

        with contextlib.closing(docker.from_env()) as client:
            yield client
    finally:
        undo_docker_setup(record)


# ---- the GPU file: validated and inspected, not run ---------------------------------------------------

def test_gpu_file_layout(docker_client) -> None:
    services = compose_config(GPU_FILE)["services"]
    assert set(services) == SERVICES
    assert gpus(services["drafter"]) == ["0"]
    assert gpus(services["verifier"]) == [str(gpu) for gpu in range(1, 8)]
    assert gpus(services["gateway"]) == []
    assert flag(services["verifier"], "--tensor-parallel") == "7"
    assert flag(services["drafter"], "--device") == flag(services["verifier"], "--device") == "cuda"
    assert {name for name, service in services.items() if service.get("ports")} == {"gateway"}
    assert [(str(p["published"]), p["target"]) for p in services["gateway"]["ports"]] == [("50051", 50051)]
    assert services["verifier"]["depends_on"] == {"drafter": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {"verifier": {"condition": "service_healthy"}}
    for name, service in services.items():
        assert service["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "proto.healthcheck"], name
        assert service["restart"] == "unless-stopped"
        assert "container_name" not in service  # a fixed name would forbid --scale
        assert service["build"]["args"]["BASE_IMAGE"].startswith("pytorch/pytorch:")


def test_extra_drafter_file_pins_a_second_gpu(docker_client) -> None:
    services = compose_config(GPU_FILE, EXTRA_DRAFTER_FILE)["services"]
    assert gpus(services["drafter"]) == ["0"] and gpus(services["drafter-gpu1"]) == ["1"]
    assert services["drafter-gpu1"]["networks"]["default"]["aliases"] == ["drafter"]  # behind the same DNS name


def test_cpu_file_runs_the_same_services_without_gpus(docker_client) -> None:
    cpu, gpu = compose_config(CPU_FILE)["services"], compose_config(GPU_FILE)["services"]
    assert set(cpu) == SERVICES | {"init"}
    for name in SERVICES:
        assert cpu[name]["command"][0] == gpu[name]["command"][0] == name
        assert cpu[name]["healthcheck"]["test"] == gpu[name]["healthcheck"]["test"]
        assert gpus(cpu[name]) == []
    assert {name for name, service in cpu.items() if service.get("ports")} == {"gateway"}


# ---- the CPU variant, for real ------------------------------------------------------------------------

@dataclass
class Stack:
    project: str
    compose: list[str]
    env: dict[str, str]
    gateway: str
    docker: object  # docker.DockerClient
    model_dir: Path

    def run(self, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*self.compose, *args], cwd=REPO, env=self.env, timeout=timeout, **kwargs)

    def containers(self, service: str) -> list:
        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        return self.docker.containers.list(filters={"label": labels})

    def health(self) -> dict[str, str]:
        """Docker's view (the images' grpc.health.v1 healthchecks), by container name."""
        return {c.name: c.attrs["State"].get("Health", {}).get("Status", "none")
                for service in SERVICES for c in self.containers(service)}

    def wait_for_docker_health(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while set(self.health().values()) != {"healthy"}:
            assert time.monotonic() < deadline, self.health()
            time.sleep(1)

    def client(self) -> Client:
        return Client(self.gateway, timeout=120)

    def trees_per_replica(self) -> dict[str, float]:
        """ddtree_verifier_trees_total by drafter host name (a replica id is `hostname:pid`), read inside the
        verifier's container: the metrics port is not published."""
        (verifier,) = self.containers("verifier")
        script = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode())"
        code, out = verifier.exec_run(["python", "-c", script])
        assert code == 0, out
        found = re.findall(r'^ddtree_verifier_trees_total\{replica="([^":]+):[^"]*"\} ([0-9.e+]+)$', out.decode(), re.M)
        return {host: float(count) for host, count in found}

    def offline(self, prompt: str, max_new: int) -> list[int]:
        """`ddtree offline` on this host (plain greedy: no drafter) on the checkpoint the containers use."""
        out = subprocess.run([sys.executable, "-m", "ddtree.cli", "offline", "--target", str(self.model_dir / "target"),
                              "--drafter", "none", "--prompt", prompt, "--max-new-tokens", str(max_new),
                              "--ignore-eos", "--json"], cwd=REPO, check=True, capture_output=True, text=True).stdout
        return json.loads(out)["token_ids"]


def copy_models_out(container, destination: Path) -> Path:
    """The checkpoint `init` wrote into the models volume, copied to this host."""
    stream, _ = container.get_archive("/models/target")
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as archive:
        archive.extractall(destination, filter="data")
    return destination


def image_parents(client) -> dict[str, str]:
    """Every image id, the build steps' included, with its parent's id ('' for none)."""
    return {image["Id"]: image["ParentId"] for image in client.api.images(all=True)}


def new_leaves(client, before: set[str]) -> set[str]:
    """Images added since `before` that no image builds on."""
    parents = image_parents(client)
    return parents.keys() - before - set(parents.values())


def remove_new_images(client, before: set[str], tag: str) -> None:
    """The tag, then every image that was not there before: the build keeps each step of every stage as an image
    (a run left about 3 GB). Leaves go first (an image with children cannot); each takes its untagged parents."""
    if client.api.images(name=tag, quiet=True):
        client.api.remove_image(tag)
    while leaves := new_leaves(client, before):
        for image in leaves:
            client.api.remove_image(image, force=True)


def save_logs(stack: Stack, log: Path) -> None:
    with open(log, "w") as file:
        stack.run("logs", "--no-color", "--timestamps", stdout=file, stderr=subprocess.STDOUT, timeout=60)
    print(f"compose logs: {log}")


@pytest.fixture(scope="module")
def stack(docker_client, tmp_path_factory):
    project = f"ddtree-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    image = f"ddtree-serve:{project}"  # a tag of its own: an image a user built under the default tag stays as it is
    compose = ["docker-compose", "-p", project, "-f", CPU_FILE]
    stack = Stack(project, compose, compose_env(DDTREE_GATEWAY_PORT=str(port), DDTREE_IMAGE=image),
                  f"127.0.0.1:{port}", docker_client, tmp_path_factory.mktemp("models"))
    with contextlib.ExitStack() as cleanup:  # runs the callbacks last first, each even when another fails
        cleanup.callback(remove_new_images, docker_client, set(image_parents(docker_client)), image)
        cleanup.callback(stack.run, "down", "--volumes", "--remove-orphans", "--timeout", "5", timeout=120)
        cleanup.callback(save_logs, stack, tmp_path_factory.getbasetemp() / f"{project}.log")
        stack.run("build", "--force-rm", "init", check=True)  # the one image all services run, from docker/wheels
        stack.run("up", "-d", "--scale", "drafter=2", check=True)
        wait_healthy(stack.gateway, timeout_s=300)  # through the published port
        stack.wait_for_docker_health(timeout_s=60)
        copy_models_out(stack.containers("verifier")[0], stack.model_dir)
        yield stack


def test_generation_through_the_gateway_equals_offline(stack) -> None:
    health = stack.health()
    assert len(health) == 4 and set(health.values()) == {"healthy"}, health  # gateway, verifier, 2 drafters
    generation = stack.client().generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    list(generation)
    assert generation.token_ids == stack.offline(PROMPT, MAX_NEW)
    assert generation.summary.generated_tokens == MAX_NEW


def test_both_drafter_replicas_serve_sessions(stack) -> None:
    hosts = {container.attrs["Config"]["Hostname"] for container in stack.containers("drafter")}
    assert len(hosts) == 2
    expected = stack.offline(PROMPT, MAX_NEW)
    for _ in range(10):  # sessions go round robin over the replicas the verifier has found by DNS
        generation = stack.client().generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
        list(generation)
        assert generation.token_ids == expected
        if set(stack.trees_per_replica()) == hosts:
            break
        time.sleep(0.5)
    trees = stack.trees_per_replica()
    assert set(trees) == hosts and min(trees.values()) > 0, trees


class Streaming(threading.Thread):
    """One generation read in the background; `started` is set at its first chunk."""

    def __init__(self, generation: Generation):
        super().__init__(daemon=True)
        self.generation, self.started, self.error = generation, threading.Event(), None

    def run(self) -> None:
        try:
            for _ in self.generation:
                self.started.set()
        except Exception as error:  # noqa: BLE001 - reported by the test
            self.error = error
        self.started.set()


def test_drafter_stopped_mid_generation_stays_exact(stack) -> None:
    prompt, max_new = "A drafter goes away, the tokens stay", 400
    expected = stack.offline(prompt, max_new)
    # Two sessions at once: round robin puts them on different replicas, so one runs on the stopped drafter.
    runs = [Streaming(stack.client().generate(prompt, max_new_tokens=max_new, ignore_eos=True)) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        assert run.started.wait(60)
    stopped, survivor = stack.containers("drafter")
    stopped.stop(timeout=0)
    at_stop = [len(run.generation.token_ids) for run in runs]
    for run in runs:
        run.join(120)
        assert run.error is None, run.error
        assert run.generation.token_ids == expected
    assert max(at_stop) < max_new, "the generations ended before the drafter stopped"
    assert [c.name for c in stack.containers("drafter")] == [survivor.name]  # stays stopped: restart unless-stopped

    # New sessions go to the survivor. NOTE: the drafter ages its connections out (about every 40 s); the
    # verifier reconnects within its refresh period, and a session started in that gap runs without a drafter.
    host = survivor.attrs["Config"]["Hostname"]
    before, expected = stack.trees_per_replica().get(host, 0.0), stack.offline(PROMPT, MAX_NEW)
    for _ in range(5):
        generation = stack.client().generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
        list(generation)
        assert generation.token_ids == expected
        if stack.trees_per_replica().get(host, 0.0) > before:
            break
        time.sleep(1)
    assert stack.trees_per_replica().get(host, 0.0) > before
