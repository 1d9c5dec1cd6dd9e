"""deploy/docker-compose.yml run for real on the Docker engine: the images built without a
registry (deploy/base-image.sh, deploy/build-image.sh around $PDMESH_BIN), the core
services and Prometheus brought up with `docker-compose`, then broken: a decode worker
that crashes under load, a prefill worker cut off the network, and `down` with streams
open. Everything the module makes (containers, network, volumes, images, the token file)
is removed at its end, even on failure.

Needs root (debootstrap, the token file's owner, killing a container's process) and a
Docker engine with Compose (`docker-compose`, or the `docker compose` plugin).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from conftest import REPO, parse_metrics, pdmesh_bin, wait_baseline
from test_dashboards import all_exprs, rule_names, selectors

COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
MESH = ("cache", "tokenizer", "prefill", "decode", "gateway")
# The model's files, as the `model` service installs them (the models volume).
UID = 10001
# The question `pdmesh up` asks at start.
SMOKE = "What is the capital of France? Answer in one sentence."
UP_TIMEOUT_S = 300
# Every request under a fault must end, answered or refused, within this.
REQUEST_DEADLINE_S = 60
MADE_IMAGES = ("pdmesh:local", "pdmesh-prometheus:local")


def compose_cmd() -> list[str]:
    """The Compose command this engine has: the v1 `docker-compose`, or `docker compose`."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    pytest.fail("no Docker Compose: install docker-compose (Debian's package) or the compose plugin")


def run(*args: str, check: bool = True, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert r.returncode == 0, f"{' '.join(args)} exited with {r.returncode}:\n{r.stdout}{r.stderr}"
    return r


def image_exists(name: str) -> bool:
    return run("docker", "image", "inspect", name, check=False).returncode == 0


@dataclass
class Stack:
    """One compose project of deploy/docker-compose.yml."""

    project: str
    env: dict
    base: str = ""
    prometheus: str = ""

    def published(self, service: str, port: int) -> str:
        """http://HOST:PORT where Docker published `service`'s `port` (it picked the port)."""
        return "http://" + self.compose("port", service, str(port)).stdout.strip()

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return run(*compose_cmd(), "-p", self.project, "-f", str(COMPOSE_FILE), *args,
                   check=check, timeout=timeout, env=self.env)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(run("docker", "inspect", self.container(service)).stdout)[0]

    def exec(self, service: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("docker", "exec", self.container(service), *cmd, check=check)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", check=False).stdout

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def client(self) -> openai.OpenAI:
        # The compose gateway has no --api-key: it serves loopback only.
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0,
                             timeout=REQUEST_DEADLINE_S)

    def wait_healthy(self, service: str, timeout: float = UP_TIMEOUT_S) -> dict:
        """Waits until `service`'s container is running and its healthcheck passes."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.inspect(service)["State"]
            if state["Status"] == "running" and state.get("Health", {}).get("Status") == "healthy":
                return state
            if time.monotonic() > deadline:
                pytest.fail(f"{service} not healthy after {timeout}s: {state}\n{self.logs()}", pytrace=False)
            time.sleep(0.5)

    def wait_ready(self, timeout: float = UP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                pytest.fail(f"the gateway is not ready after {timeout}s:\n{self.logs()}", pytrace=False)
            time.sleep(0.5)


@pytest.fixture(scope="module")
def images():
    """The base image, pdmesh:local and pdmesh-prometheus:local, made here; those this
    module made are removed at its end."""
    made_before = {name for name in ("debian:bookworm-slim", *MADE_IMAGES) if image_exists(name)}
    made = []
    try:
        base = run(str(REPO / "deploy" / "base-image.sh")).stdout.split()[-1]
        made.append(base)
        run(str(REPO / "deploy" / "build-image.sh"), str(pdmesh_bin()))
        made += MADE_IMAGES
        yield
    finally:
        for name in made:
            if name not in made_before:
                run("docker", "rmi", "-f", name, check=False)


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("compose")
    token = tmp / "mesh-token"
    token.write_text(os.urandom(32).hex() + "\n")
    os.chown(token, UID, UID)
    token.chmod(0o600)
    project = f"pdmeshe2e{uuid.uuid4().hex[:8]}"
    env = dict(
        os.environ,
        PDMESH_MESH_TOKEN_PATH=str(token),
        # Empty: Docker picks free host ports.
        PDMESH_GATEWAY_PORT="",
        PDMESH_PROMETHEUS_PORT="",
        # The images exist: nothing is built, nothing is pulled.
        COMPOSE_DOCKER_CLI_BUILD="0",
    )
    s = Stack(project, env)
    try:
        s.compose("up", "-d", "--no-build", timeout=UP_TIMEOUT_S)
        s.base, s.prometheus = s.published("gateway", 8080), s.published("prometheus", 9090)
        s.wait_healthy("gateway")
        s.wait_ready()
        yield s
    finally:
        s.compose("down", "-v", "--remove-orphans", "-t", "30", check=False)
        token.unlink(missing_ok=True)
        left = run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
        if left:
            run("docker", "rm", "-f", *left, check=False)
        assert not left, f"containers left after down: {left}"


def ask(client: openai.OpenAI, question: str, max_tokens: int = 32) -> str:
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0,
    )
    return r.choices[0].message.content


QUESTIONS = [f"Name {n} animals that live in the sea." for n in range(2, 8)]


@pytest.fixture(scope="module")
def reference(stack) -> dict[str, str]:
    """Each of QUESTIONS answered by the healthy stack (temperature 0)."""
    c = stack.client()
    return {q: ask(c, q) for q in QUESTIONS}


def under_load(stack: Stack, reference: dict[str, str], fault, rounds: int = 3) -> list:
    """Sends QUESTIONS `rounds` times from one thread per question while `fault()` runs
    once the first answers arrive; returns (question, answer or exception, seconds)."""
    out, lock = [], threading.Lock()
    first = threading.Event()
    client = stack.client()

    def worker(q: str) -> None:
        for _ in range(rounds):
            t = time.monotonic()
            try:
                got: object = ask(client, q)
            except Exception as e:  # noqa: BLE001 - every way a request ends is judged below
                got = e
            with lock:
                out.append((q, got, time.monotonic() - t))
            first.set()

    threads = [threading.Thread(target=worker, args=(q,)) for q in reference]
    for t in threads:
        t.start()
    assert first.wait(REQUEST_DEADLINE_S), "no request ended before the fault"
    fault()
    for t in threads:
        t.join(REQUEST_DEADLINE_S * (rounds + 1))
        assert not t.is_alive(), "a request never ended"
    return out


def judge(results: list, reference: dict[str, str]) -> int:
    """Every request ended within its deadline with the reference answer or a clean error
    (a 503, the mesh's fault, try again, or a 504, the mesh's deadline); returns how many
    failed."""
    failed = 0
    for q, got, seconds in results:
        assert seconds < REQUEST_DEADLINE_S, f"{q!r} took {seconds:.1f}s"
        if isinstance(got, Exception):
            assert isinstance(got, openai.APIStatusError) and got.status_code in (503, 504), f"{q!r}: {got!r}"
            failed += 1
        else:
            assert got == reference[q], f"{q!r}: {got!r} != {reference[q]!r}"
    return failed


def test_compose_config_is_valid_with_and_without_the_observability_profile(stack):
    stack.compose("config", "-q")
    stack.compose("--profile", "observability", "config", "-q")
    services = set(stack.compose("config", "--services").stdout.split())
    assert {"model", *MESH, "prometheus"} <= services


def test_the_gateway_answers_the_smoke_question_as_pdmesh_up_does_over_shared_memory(stack, mesh):
    want = ask(mesh.client(), SMOKE, max_tokens=48)
    before = stack.metrics()
    assert ask(stack.client(), SMOKE, max_tokens=48) == want
    m = stack.metrics()
    # The hand-over went through the cache container's mirror, mapped by both workers.
    assert m['mesh_kv_transfers_total{outcome="ok"}'] > before['mesh_kv_transfers_total{outcome="ok"}']
    assert m['mesh_kv_transfers_total{outcome="failed"}'] == 0
    assert m['mesh_kv_transfer_bytes_total{side="all"}'] > before['mesh_kv_transfer_bytes_total{side="all"}']
    listing = stack.exec("cache", "find", "/dev/shm", "-name", "pdmesh-mirror-*", "-printf", "%p %m %U %G\n").stdout
    [(path, mode, uid, gid)] = [line.split() for line in listing.splitlines()]
    assert (mode, uid, gid) == ("600", str(UID), str(UID)), listing
    folder = stack.exec("cache", "stat", "-c", "%a %u", str(Path(path).parent)).stdout.split()
    assert folder == ["700", str(UID)], folder
    for worker in ("prefill", "decode"):
        maps = stack.exec(worker, "cat", "/proc/1/maps").stdout
        assert path in maps, f"{worker} has not mapped the cache's mirror {path}"


def test_the_services_run_as_a_user_on_a_read_only_root_filesystem(stack):
    for name in MESH:
        info = stack.inspect(name)
        assert info["HostConfig"]["ReadonlyRootfs"], f"{name}: root filesystem writable"
        assert stack.exec(name, "id", "-u").stdout.strip() == str(UID)
        # Its own home is on the root filesystem and writable but for read_only.
        r = stack.exec(name, "sh", "-c", "echo x > /home/pdmesh/written", check=False)
        assert r.returncode != 0 and "Read-only file system" in r.stderr, (
            f"{name} could write to its root filesystem: {r.stderr}"
        )
        # The secret is readable by the service and nobody else.
        assert stack.exec(name, "stat", "-c", "%a", "/run/secrets/mesh_token").stdout.strip() == "600"
    prom = stack.inspect("prometheus")
    assert prom["HostConfig"]["ReadonlyRootfs"] and prom["Config"]["User"] not in ("", "root", "0")


def test_prometheus_in_its_container_has_a_series_for_every_dashboard_and_rule_metric(stack):
    recorded = rule_names()
    wanted = set()
    for _, _, expr in all_exprs():
        for name, matchers in selectors(expr):
            if name in recorded:
                continue
            own = ",".join(f'{l}{op}"{v}"' for l, op, v in matchers if l not in ("instance", "job"))
            wanted.add(f"{name}{{{own}}}" if own else name)
    assert wanted
    api = f"{stack.prometheus}/api/v1/query?query="
    deadline = time.monotonic() + 90
    while True:
        missing = []
        for sel in sorted(wanted):
            try:
                with urllib.request.urlopen(api + urllib.parse.quote(sel), timeout=10) as r:
                    body = json.load(r)
            except OSError:
                missing.append(f"{sel} (Prometheus not answering)")
                continue
            assert body["status"] == "success", body
            if not body["data"]["result"]:
                missing.append(sel)
        if not missing:
            break
        if time.monotonic() > deadline:
            pytest.fail("no series in Prometheus for:\n" + "\n".join(missing), pytrace=False)
        time.sleep(2)
    with urllib.request.urlopen(api + urllib.parse.quote('up{job="pdmesh-gateway"}'), timeout=10) as r:
        [up] = json.load(r)["data"]["result"]
    assert up["value"][1] == "1"


def leases(stack: Stack) -> int:
    return int(stack.metrics()["mesh_host_mirror_leases"])


def back_to_baseline(stack: Stack, leases_before: int) -> None:
    """Nothing held at the workers or the cache service, and the dead side's leases have
    expired (its successor holds the same number)."""
    wait_baseline(stack.metrics, stack.logs, timeout=60, caches=True)
    deadline = time.monotonic() + 60
    while leases(stack) != leases_before:
        if time.monotonic() > deadline:
            pytest.fail(f"{leases(stack)} leases at the cache service, {leases_before} before", pytrace=False)
        time.sleep(0.5)


def test_a_decode_crash_under_load_ends_every_request_and_the_restart_policy_brings_it_back(stack, reference):
    leases_before = leases(stack)
    before = stack.inspect("decode")["RestartCount"]

    def crash() -> None:
        # SIGKILL to the worker process, as the kernel's OOM killer would. (`docker kill`
        # marks a container as stopped by hand, and no restart policy restarts those.)
        os.kill(stack.inspect("decode")["State"]["Pid"], signal.SIGKILL)

    results = under_load(stack, reference, crash)
    assert judge(results, reference) > 0, "no request noticed decode was gone"
    state = stack.wait_healthy("decode")
    assert stack.inspect("decode")["RestartCount"] == before + 1, state
    stack.wait_ready()
    client = stack.client()
    assert {q: ask(client, q) for q in reference} == reference
    back_to_baseline(stack, leases_before)


def test_prefill_cut_off_the_network_then_reconnected(stack, reference):
    leases_before = leases(stack)
    network = f"{stack.project}_default"
    prefill = stack.container("prefill")
    cut = threading.Event()

    def disconnect() -> None:
        run("docker", "network", "disconnect", network, prefill)
        cut.set()

    try:
        results = under_load(stack, reference, disconnect, rounds=2)
    finally:
        if cut.is_set():
            run("docker", "network", "connect", "--alias", "prefill", network, prefill)
    failed = judge(results, reference)
    assert failed > 0, "no request noticed the prefill worker was gone"
    stack.wait_ready()
    client = stack.client()
    assert {q: ask(client, q) for q in reference} == reference
    back_to_baseline(stack, leases_before)


def test_compose_down_drains_open_streams(stack):
    """Last: `down` with streams open lets them finish (the gateway's SIGTERM drain)."""
    client = stack.client()
    questions = ["Write a long poem about the sea.", "Describe a forest in the morning, in detail."]
    want = {q: ask(client, q, max_tokens=256) for q in questions}
    gateway = stack.container("gateway")
    iters = {
        q: iter(client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": q}],
            max_tokens=256, temperature=0, stream=True,
        ))
        for q in questions
    }
    text = {q: "" for q in questions}
    finish = {}

    def read(q: str, chunk) -> None:
        for choice in chunk.choices:
            text[q] += choice.delta.content or ""
            if choice.finish_reason:
                finish[q] = choice.finish_reason

    for q, it in iters.items():
        read(q, next(it))
    down = subprocess.Popen([*compose_cmd(), "-p", stack.project, "-f", str(COMPOSE_FILE), "down", "-t", "30"],
                            env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The gateway got SIGTERM while both streams were open.
        deadline = time.monotonic() + 30
        while not (m := re.search(r"draining: open streams run on.*open=(\d+)",
                                  run("docker", "logs", gateway, check=False).stderr)):
            assert time.monotonic() < deadline and down.poll() is None, "the gateway never began to drain"
            time.sleep(0.2)
        assert int(m.group(1)) >= len(questions), m.group(0)
        for q, it in iters.items():
            for chunk in it:
                read(q, chunk)
        out, _ = down.communicate(timeout=120)
    finally:
        if down.poll() is None:
            down.kill()
    assert down.returncode == 0, out
    assert text == want, "a stream was cut or changed by the drain"
    assert set(finish) == set(questions) and set(finish.values()) <= {"stop", "length"}, finish
    left = run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={stack.project}").stdout.split()
    assert not left, f"containers left after down: {left}"
