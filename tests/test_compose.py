"""The docker compose deployment, for real (marker `docker`; deselect with -m "not docker"), and the files it reads.

Offline (no marker): the build context is what docker/Dockerfile copies; Prometheus scrapes every service on its
metrics port; the Grafana dashboard asks only for metrics the services export. With Docker: every compose file
and layout is checked through `docker-compose config` (the GPU ones cannot run here), TLS on in each. Then
scripts/docker_setup.sh prepares the host (dockerd, the debootstrap base image, host wheels) and the CPU variant
is built once (by `init`) and brought up, with certificates from scripts/make_dev_certs.py (the gateway's port
serves TLS, internal calls are mutual TLS), a tensor-parallel verifier of 2 gloo ranks and the file's 2
drafter replicas. Generations go through the published gateway (a plaintext client is refused) and must equal
`ddtree offline` on the
checkpoint the containers made; then, without an operator: a drafter stopped mid-generation (still exact), a
plain `up -d` (the drafter count kept), the verifier's process killed (restarted; `ddtree generate` exits 1 with
the status), a tensor-parallel rank killed (the verifier exits and is restarted). A misspelled drafter path
stops `up` at the preflight with the cause in init's log, and `down -v` leaves nothing of either project.
Docker is driven through the compose CLI to bring stacks up and down, and through the `docker` SDK to inspect,
stop and read containers. Afterwards the host is as it was, but for the packages and docker/wheels: the images
the run built are removed, and so are the base image and the daemon when docker_setup.sh made them for this
run."""

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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from ddtree.client import Client, GatewayError, Generation
from ddtree.local_stack import free_port
from proto.healthcheck import check
from proto.security import Tls, client_channel

docker_test = pytest.mark.docker

REPO = Path(__file__).resolve().parents[1]
GPU_FILE, CPU_FILE = "docker-compose.yml", "docker-compose.cpu.yml"
EXTRA_DRAFTER_FILE = "docker/compose.extra-drafter.yml"
PER_GPU_FILE = "docker/compose.verifier-per-gpu.yml"
SERVICES = {"gateway", "verifier", "drafter"}
MONITORING = {"prometheus", "grafana"}
METRICS_PORT = "9100"
PROMPT = "The cat sat on the mat. The cat"
MAX_NEW = 32
CPU_DRAFTERS = 2  # docker-compose.cpu.yml's default DDTREE_DRAFTER_REPLICAS
TENSOR_PARALLEL = 2  # the test's verifier: 2 gloo ranks, so that a rank can be lost


def compose_env(**values: str) -> dict[str, str]:
    """This process's environment without DDTREE_* settings (they would change the files' defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    return {**env, **values}


def compose_config(*files: str, **env: str) -> dict:
    args = [arg for file in files for arg in ("-f", file)]
    out = subprocess.run(["docker-compose", *args, "config"], cwd=REPO, env=compose_env(**env), check=True,
                         capture_output=True, text=True).stdout
    return yaml.safe_load(out)


def gpus(service: dict) -> list[str]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    return [gpu for d in devices for gpu in d["device_ids"]]


def flag(service: dict, name: str) -> str | None:
    command = service["command"]
    return command[command.index(name) + 1] if name in command else None


# ---- offline: the files the images and the monitoring profile read -------------------------------------

def dockerfile_sources() -> set[str]:
    """What docker/Dockerfile copies from the build context (not from its stages)."""
    lines = (REPO / "docker/Dockerfile").read_text().splitlines()
    return {source.rstrip("/") for line in lines if line.startswith("COPY ") and "--from=" not in line
            for source in line.split()[1:-1]}


def test_the_build_context_is_what_the_dockerfile_copies() -> None:
    allowed = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] not in "#"]
    assert allowed[0] == "*"  # an allowlist: checkpoints under ./models, .git and virtualenvs stay out
    assert {line[1:] for line in allowed if line.startswith("!")} == dockerfile_sources()
    pyproject = (REPO / "pyproject.toml").read_text()  # NOTE: no tomllib before Python 3.11
    (include,) = re.findall(r"^include = \[(.*)\]$", pyproject, re.M)  # [tool.setuptools.packages.find]
    packages = {name.strip('" *') for name in include.split(",")}
    assert packages <= dockerfile_sources(), "a package of pyproject.toml is not copied into the image"
    assert re.search(r'^readme = "(.*)"$', pyproject, re.M)[1] in dockerfile_sources()


def exported_metrics() -> set[str]:
    """Every metric family the gateway, a verifier and a drafter export, and Prometheus' own `up`."""
    from drafter_service.server import drafter_metrics
    from gateway.metrics import GatewayMetrics
    from verifier_service.metrics import VerifierMetrics

    drafter = drafter_metrics(SimpleNamespace(open_ids=set(), streams=set(), queued={}))
    registries = [GatewayMetrics().registry, VerifierMetrics().registry, drafter]
    return {family.name for registry in registries for family in registry.collect()} | {"up"}


def test_the_dashboard_shows_only_metrics_the_services_export() -> None:
    dashboard = json.loads((REPO / "monitoring/grafana/dashboards/ddtree.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {re.sub(r"_(total|bucket|sum|count)$", "", name)
            for expr in exprs for name in re.findall(r"\b(ddtree_\w+|up)\b(?=[{\[)\s]|$)", expr)}
    assert used <= exported_metrics(), used - exported_metrics()
    wanted = {"ddtree_gateway_ttft_seconds", "ddtree_gateway_inter_token_latency_seconds",
              "ddtree_gateway_acceptance_length", "ddtree_gateway_generated_tokens", "ddtree_verifier_kv_pages_used",
              "ddtree_verifier_trees", "ddtree_drafter_streams"}  # TTFT, ITL, acceptance, tokens/s, KV, drafters
    assert wanted <= used
    assert any('up{job="drafter"}' in expr for expr in exprs)
    datasource = yaml.safe_load((REPO / "monitoring/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} == {datasource["datasources"][0]["uid"]}


def test_prometheus_scrapes_every_service_on_its_metrics_port() -> None:
    config = yaml.safe_load((REPO / "monitoring/prometheus.yml").read_text())
    jobs = {job["job_name"]: sd for job in config["scrape_configs"] for sd in job["dns_sd_configs"]}
    assert set(jobs) == SERVICES and {str(sd["port"]) for sd in jobs.values()} == {METRICS_PORT}
    per_gpu = yaml.safe_load((REPO / PER_GPU_FILE).read_text())["services"]
    assert set(jobs["verifier"]["names"]) == {"verifier"} | {name for name in per_gpu if name.startswith("verifier-")}
    for file in (GPU_FILE, CPU_FILE):  # PyYAML resolves the files' anchors and merge keys
        services = yaml.safe_load((REPO / file).read_text())["services"]
        for name in SERVICES:
            assert flag(services[name], "--metrics-port") == METRICS_PORT, (file, name)
            assert flag(services[name], "--metrics-addr") == "0.0.0.0", (file, name)
    provider = yaml.safe_load((REPO / "monitoring/grafana/provisioning/dashboards/ddtree.yml").read_text())
    grafana = yaml.safe_load((REPO / GPU_FILE).read_text())["services"]["grafana"]
    assert f"./monitoring/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in grafana["volumes"]


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


# ---- the compose files: validated and inspected through `docker-compose config` ---------------------------

def tensor_parallel(service: dict) -> str:
    """The degree the preflight checks (the image's `init` reads it from the environment)."""
    return service["environment"]["DDTREE_TENSOR_PARALLEL"]


def check_common(services: dict, image: str) -> None:
    """What every file shares: one image, built by `init` only; restart policies; rotated logs; healthchecks."""
    assert set(services) >= SERVICES | {"init"}
    assert {name for name, service in services.items() if "build" in service} == {"init"}
    assert services["init"]["restart"] == "no"  # a failed preflight stops `up`, no loop
    for name in SERVICES:
        service = services[name]
        assert service["image"] == image, name
        assert service["restart"] == "unless-stopped", name  # a process that exits comes back
        assert service["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "proto.healthcheck"], name
        assert "container_name" not in service  # a fixed name would forbid replicas
        assert service["depends_on"].get("init", {"condition": "service_completed_successfully"}) == \
            {"condition": "service_completed_successfully"}
    check_tls(services, SERVICES)
    for name, service in services.items():
        logging = service["logging"]
        assert logging["driver"] == "json-file" and {"max-size", "max-file"} <= set(logging["options"]), name
    for name in MONITORING:
        assert services[name]["profiles"] == ["monitoring"], name
    assert {name for name, service in services.items() if "profiles" in service} == MONITORING
    assert {name for name, service in services.items() if service.get("ports") and name not in MONITORING} == \
        {"gateway"}


def check_tls(services: dict, names: set[str]) -> None:
    """The gateway serves TLS; every service calls and answers the others with mutual TLS, and the healthchecks
    dial as they do."""
    for name in names:
        environment, test = services[name]["environment"], services[name]["healthcheck"]["test"]
        assert {"DDTREE_INTERNAL_CA", "DDTREE_INTERNAL_CERT", "DDTREE_INTERNAL_KEY"} <= set(environment), name
        if name == "gateway":
            assert {"DDTREE_TLS_CERT", "DDTREE_TLS_KEY"} <= set(environment)
            assert test[-2:] == ["--tls-ca", "/certs/ca.crt"]
        else:
            assert test[-1] == "--internal", name


@docker_test
def test_gpu_file_layout(docker_client) -> None:
    services = compose_config(GPU_FILE)["services"]
    assert set(services) == SERVICES | MONITORING | {"init"}
    check_common(services, "ddtree-serve:gpu")
    build = services["init"]["build"]["args"]
    assert build["BASE_IMAGE"].startswith("pytorch/pytorch:") and build["PIP_SOURCE"] == "index"  # no CPU wheels
    assert services["drafter"]["scale"] == 1
    assert gpus(services["drafter"]) == ["0"]
    assert gpus(services["verifier"]) == [str(gpu) for gpu in range(1, 8)]
    assert gpus(services["gateway"]) == []
    assert flag(services["verifier"], "--tensor-parallel") == "7" == tensor_parallel(services["init"])
    assert flag(services["drafter"], "--device") == flag(services["verifier"], "--device") == "cuda"
    assert [(str(p["published"]), p["target"]) for p in services["gateway"]["ports"]] == [("50051", 50051)]
    assert services["verifier"]["depends_on"] == {"init": {"condition": "service_completed_successfully"},
                                                  "drafter": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {"verifier": {"condition": "service_healthy"}}


@docker_test
def test_settings_come_from_the_environment(docker_client) -> None:
    services = compose_config(GPU_FILE, DDTREE_DRAFTER_REPLICAS="3", DDTREE_TENSOR_PARALLEL="4")["services"]
    assert services["drafter"]["scale"] == 3  # kept by every `up` that sees the variable (a .env file)
    assert flag(services["verifier"], "--tensor-parallel") == "4" == tensor_parallel(services["init"])


@docker_test
def test_verifier_per_gpu_layout_has_seven_single_gpu_verifiers_behind_the_gateway(docker_client) -> None:
    services = compose_config(GPU_FILE, PER_GPU_FILE)["services"]
    replicas = {f"verifier-{gpu}": str(gpu) for gpu in range(1, 8)}
    assert set(services) == SERVICES | MONITORING | {"init"} | set(replicas)
    check_common(services, "ddtree-serve:gpu")
    assert services["verifier"]["scale"] == 0  # the tensor-parallel verifier is left out
    for name, gpu in replicas.items():
        assert gpus(services[name]) == [gpu], name
        assert flag(services[name], "--tensor-parallel") in (None, "1"), name
        assert services[name]["depends_on"]["drafter"] == {"condition": "service_healthy"}
        assert services[name]["healthcheck"]["test"] == services["verifier"]["healthcheck"]["test"]
        assert services[name]["logging"] == services["verifier"]["logging"]
    check_tls(services, set(replicas))
    assert tensor_parallel(services["init"]) == "1"  # what the preflight checks
    verifiers = services["gateway"]["environment"]["DDTREE_VERIFIERS"].split(",")
    assert verifiers == [f"{name}:50053" for name in replicas]  # the gateway spreads sessions over them
    assert {f"{name}" for name in replicas} <= set(services["gateway"]["depends_on"])
    assert gpus(services["drafter"]) == ["0"]


@docker_test
def test_extra_drafter_file_pins_a_second_gpu(docker_client) -> None:
    services = compose_config(GPU_FILE, EXTRA_DRAFTER_FILE)["services"]
    assert gpus(services["drafter"]) == ["0"] and gpus(services["drafter-gpu1"]) == ["1"]
    assert services["drafter-gpu1"]["networks"]["default"]["aliases"] == ["drafter"]  # behind the same DNS name
    check_tls(services, {"drafter-gpu1"})
    assert "build" not in services["drafter-gpu1"] and services["drafter-gpu1"]["image"] == services["drafter"]["image"]


@docker_test
def test_cpu_file_runs_the_same_services_without_gpus(docker_client) -> None:
    cpu, gpu = compose_config(CPU_FILE)["services"], compose_config(GPU_FILE)["services"]
    assert set(cpu) == set(gpu)
    check_common(cpu, "ddtree-serve:cpu")
    assert cpu["init"]["build"]["args"]["PIP_SOURCE"] == "wheels"  # the host's wheels, no registry
    assert cpu["drafter"]["scale"] == CPU_DRAFTERS
    for name in SERVICES:
        assert cpu[name]["command"][0] == gpu[name]["command"][0] == name
        assert cpu[name]["healthcheck"]["test"] == gpu[name]["healthcheck"]["test"]
        assert gpus(cpu[name]) == []
    for name in MONITORING:  # extended, not copied (the volumes come in another order)
        same_order = [{**service[name], "volumes": sorted(service[name]["volumes"])} for service in (cpu, gpu)]
        assert same_order[0] == same_order[1], name


# ---- the CPU variant, for real ------------------------------------------------------------------------

@dataclass
class Stack:
    project: str
    compose: list[str]
    env: dict[str, str]
    gateway: str
    docker: object  # docker.DockerClient
    model_dir: Path
    log: Path
    certs: Path  # scripts/make_dev_certs.py's files, mounted at /certs
    down_done: bool = False
    expected: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # offline outputs

    def run(self, *args: str, timeout: float = 600, env: dict[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*self.compose, *args], cwd=REPO, env={**self.env, **(env or {})}, timeout=timeout,
                              **kwargs)

    def containers(self, service: str, stopped: bool = False) -> list:
        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        return self.docker.containers.list(all=stopped, filters={"label": labels})

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
        return Client(self.gateway, timeout=120, tls=self.tls)

    @property
    def tls(self) -> Tls:
        return Tls(ca=str(self.certs / "ca.crt"))

    def wait_for_gateway(self, timeout_s: float) -> None:
        """Until the published gateway port answers SERVING, over TLS."""
        deadline = time.monotonic() + timeout_s
        while check(self.gateway, timeout_s=1, dial=lambda address: client_channel(address, self.tls)) != "SERVING":
            assert time.monotonic() < deadline, f"{self.gateway} not healthy after {timeout_s:.0f} s"
            time.sleep(0.2)

    def verifier(self):
        (verifier,) = self.containers("verifier")
        return verifier

    def trees_per_replica(self) -> dict[str, float]:
        """ddtree_verifier_trees_total by drafter host name (a replica id is `hostname:pid`), read inside the
        verifier's container: the metrics port is not published."""
        script = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode())"
        code, out = self.verifier().exec_run(["python", "-c", script])
        assert code == 0, out
        found = re.findall(r'^ddtree_verifier_trees_total\{replica="([^":]+):[^"]*"\} ([0-9.e+]+)$', out.decode(), re.M)
        return {host: float(count) for host, count in found}

    def offline(self, prompt: str, max_new: int) -> list[int]:
        """`ddtree offline` on this host (plain greedy: no drafter) on the checkpoint the containers use; run once
        per prompt (a run is mostly starting torch: about 5 s here)."""
        if (prompt, max_new) not in self.expected:
            out = subprocess.run([sys.executable, "-m", "ddtree.cli", "offline", "--target",
                                  str(self.model_dir / "target"), "--drafter", "none", "--prompt", prompt,
                                  "--max-new-tokens", str(max_new), "--ignore-eos", "--json"], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout
            self.expected[prompt, max_new] = json.loads(out)["token_ids"]
        return self.expected[prompt, max_new]

    def leftovers(self) -> dict[str, list]:
        """What Docker still holds of this project (compose labels every container, network and volume)."""
        label = {"label": f"com.docker.compose.project={self.project}"}
        return {"containers": self.docker.containers.list(all=True, filters=label),
                "networks": self.docker.networks.list(filters=label),
                "volumes": self.docker.volumes.list(filters=label)}

    def down(self) -> None:
        """The logs are saved first (once); `down` removes containers, network and volumes."""
        if self.down_done:
            return
        with open(self.log, "w") as file:
            self.run("logs", "--no-color", "--timestamps", stdout=file, stderr=subprocess.STDOUT, timeout=60)
        print(f"compose logs: {self.log}")
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "5", timeout=120, check=True)
        self.down_done = True


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


def new_stack(docker_client, project: str, log_dir: Path, certs: Path, **env: str) -> Stack:
    port = free_port()
    # a tag of its own: an image a user built under the default tag stays as it is
    env = {"DDTREE_IMAGE": f"ddtree-serve:{project}", "DDTREE_GATEWAY_PORT": str(port), "DDTREE_CERTS": str(certs),
           **env}
    return Stack(project, ["docker-compose", "-p", project, "-f", CPU_FILE], compose_env(**env), f"127.0.0.1:{port}",
                 docker_client, log_dir / "models", log_dir / f"{project}.log", certs)


@pytest.fixture(scope="module")
def stack(docker_client, tmp_path_factory):
    project = f"ddtree-test-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path_factory.mktemp(project)
    subprocess.run([sys.executable, "scripts/make_dev_certs.py", str(log_dir / "certs")], cwd=REPO, check=True)
    stack = new_stack(docker_client, project, log_dir, log_dir / "certs", DDTREE_TENSOR_PARALLEL=str(TENSOR_PARALLEL))
    with contextlib.ExitStack() as cleanup:  # runs the callbacks last first, each even when another fails
        cleanup.callback(remove_new_images, docker_client, set(image_parents(docker_client)), stack.env["DDTREE_IMAGE"])
        cleanup.callback(stack.down)
        stack.run("build", "--force-rm", "init", check=True)  # the one image all services run, from docker/wheels
        stack.run("up", "-d", check=True)  # the drafter count is the file's
        stack.wait_for_gateway(timeout_s=300)  # through the published port
        stack.wait_for_docker_health(timeout_s=60)
        copy_models_out(stack.verifier(), stack.model_dir)
        yield stack


def generate_exactly(stack: Stack) -> None:
    generation = stack.client().generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    list(generation)
    assert generation.token_ids == stack.offline(PROMPT, MAX_NEW)


@docker_test
def test_generation_through_the_gateway_equals_offline(stack) -> None:
    health = stack.health()
    assert len(health) == 2 + CPU_DRAFTERS and set(health.values()) == {"healthy"}, health
    generation = stack.client().generate(PROMPT, max_new_tokens=MAX_NEW, ignore_eos=True)
    list(generation)
    assert generation.token_ids == stack.offline(PROMPT, MAX_NEW)
    assert generation.summary.generated_tokens == MAX_NEW
    with Client(stack.gateway, timeout=30) as plaintext, pytest.raises(GatewayError, match="may require TLS"):
        plaintext.list_models()


@docker_test
def test_both_drafter_replicas_serve_sessions(stack) -> None:
    hosts = {container.attrs["Config"]["Hostname"] for container in stack.containers("drafter")}
    assert len(hosts) == CPU_DRAFTERS
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


@docker_test
def test_drafter_stopped_mid_generation_stays_exact(stack) -> None:
    prompt, max_new = "A drafter goes away, the tokens stay", 240
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
    assert [c.name for c in stack.containers("drafter")] == [survivor.name]  # an operator's stop is respected

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


@docker_test
def test_up_again_keeps_the_shape_of_the_file(stack) -> None:
    """A plain `up -d` (the usual recovery command) restores the file's drafter count: the replica stopped above
    comes back, nothing running is recreated."""
    running = {c.name: c.id for service in SERVICES for c in stack.containers(service)}
    assert len(running) == 1 + CPU_DRAFTERS  # one drafter stopped by the test before
    stack.run("up", "-d", check=True, capture_output=True)
    stack.wait_for_docker_health(timeout_s=120)
    after = {c.name: c.id for service in SERVICES for c in stack.containers(service)}
    assert len(stack.containers("drafter")) == CPU_DRAFTERS
    assert running.items() <= after.items()  # same containers, not recreated
    generate_exactly(stack)


def restarted(container, restarts: int, timeout_s: float) -> None:
    """Wait until Docker has restarted the container `restarts` times and it is healthy again."""
    deadline = time.monotonic() + timeout_s
    while True:
        container.reload()
        state = container.attrs["State"]
        if container.attrs["RestartCount"] >= restarts and state.get("Health", {}).get("Status") == "healthy":
            return
        assert time.monotonic() < deadline, (container.attrs["RestartCount"], state)
        time.sleep(1)


@docker_test
def test_a_killed_verifier_comes_back_and_generate_exits_with_the_status(stack) -> None:
    """The verifier's process killed (as the OOM killer would): the running `ddtree generate` exits 1 with the
    status and message, Docker restarts the container, the gateway serves again, nobody intervenes."""
    verifier, gateway = stack.verifier(), stack.containers("gateway")[0]
    restarts = verifier.attrs["RestartCount"]
    cli = subprocess.Popen([sys.executable, "-m", "ddtree.cli", "generate", PROMPT, "--gateway", stack.gateway,
                            "--tls-ca", str(stack.certs / "ca.crt"),
                            "--max-new-tokens", "4000", "--ignore-eos"], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stdout.read(1), "no output before the kill"
        os.kill(verifier.attrs["State"]["Pid"], signal.SIGKILL)
        killed = time.monotonic()
        _, err = cli.communicate(timeout=60)
    finally:
        cli.kill()
    assert cli.returncode == 1, err
    assert err.startswith("error: UNAVAILABLE: "), err
    assert time.monotonic() - killed < 30
    restarted(verifier, restarts + 1, timeout_s=120)
    stack.wait_for_gateway(timeout_s=30)
    generate_exactly(stack)
    gateway.reload()
    assert gateway.attrs["RestartCount"] == 0  # the verifier was back long before the gateway's timeout


def follower_pids(verifier) -> list[int]:
    """The tensor-parallel followers: the children of the verifier's multiprocessing fork server."""
    (server,) = [pid for pid in children(verifier.attrs["State"]["Pid"])
                 if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return children(server)


@docker_test
def test_a_verifier_that_lost_a_rank_exits_and_comes_back(stack) -> None:
    """A follower killed: the verifier turns NOT_SERVING (Docker would never restart an unhealthy container),
    exits with status 3 after its grace, and the restart policy brings it back whole."""
    verifier = stack.verifier()
    restarts, since = verifier.attrs["RestartCount"], int(time.time())
    (follower,) = follower_pids(verifier)
    os.kill(follower, signal.SIGKILL)
    code, out = verifier.exec_run(["python", "-m", "proto.healthcheck", "127.0.0.1:50053", "--internal"])
    assert (code, out.decode().split()[-1]) == (1, "NOT_SERVING")
    restarted(verifier, restarts + 1, timeout_s=120)
    logs = verifier.logs(since=since).decode()
    assert "tensor-parallel rank 1 exited with code -9: the verifier stops serving" in logs
    assert "exiting with status 3 for a restart" in logs
    stack.wait_for_gateway(timeout_s=30)
    generate_exactly(stack)


@docker_test
def test_a_misspelled_checkpoint_stops_up_at_the_preflight(stack, tmp_path) -> None:
    """No service starts (so none loops); `up` fails in seconds naming init's container, whose log has the
    cause; `down -v` removes all of the project."""
    bad = new_stack(stack.docker, f"{stack.project}-bad", tmp_path, stack.certs, DDTREE_IMAGE=stack.env["DDTREE_IMAGE"],
                    DDTREE_DRAFTER="/models/typo")
    try:
        started = time.monotonic()
        up = bad.run("up", "-d", capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
        (init,) = bad.containers("init", stopped=True)
        assert up.returncode != 0 and took < 60, (up.returncode, took)
        assert init.id[:12] in up.stderr or 'service "init"' in up.stderr, up.stderr  # v1 names the id, v2 the service
        assert "preflight: error: DDTREE_DRAFTER=/models/typo: /models/typo/config.json not found" in \
            bad.run("logs", "--no-color", "init", capture_output=True, text=True).stdout
        assert init.attrs["State"]["ExitCode"] == 1 and init.attrs["RestartCount"] == 0
        assert [c.name for c in bad.leftovers()["containers"]] == [init.name]  # drafter, verifier, gateway: never made
    finally:
        bad.down()
    assert bad.leftovers() == {"containers": [], "networks": [], "volumes": []}


@docker_test
def test_down_leaves_nothing_behind(stack) -> None:
    """Last: the stack's containers (the stopped ones too), its network and its models volume all go."""
    assert all(stack.leftovers().values())
    stack.down()
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
