"""End-to-end harness: runs the already-built `pdmesh up` (nothing is built here) and
hands tests an `openai.OpenAI` client pointed at its gateway.

The binary is $PDMESH_BIN, default target/release/pdmesh under the repository root. The
model is whatever `pdmesh up` serves by default ($PDMESH_MODEL or the cached default).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "e2e-secret-key"
# The gateway's --admin-key, for /debug/*.
ADMIN_KEY = "e2e-admin-key"
STARTUP_TIMEOUT_S = float(os.environ.get("PDMESH_E2E_STARTUP_TIMEOUT", "600"))


# Short room and hand-over deadlines for the fault tests, so faults resolve within a test.
# The wait for input bounds the prefill's computing instead: a 1100-token prompt on one
# thread takes over 20 s on a 2-core AVX2-only machine beside the other processes.
ROOM_ARGS = [
    "--lease-ttl-ms=2000",
    "--room-bootstrap-ms=8000",
    "--room-wait-ms=60000",
    "--room-transfer-ms=3000",
    "--room-success-ms=3000",
]
WORKER_ARGS = ["--transfer-timeout-ms=15000", "--threads=1"]

# The function the tool tests offer, as the chat API's tool holds it under "function".
WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "the city"}},
        "required": ["location"],
    },
}


def pdmesh_bin() -> Path:
    p = Path(os.environ.get("PDMESH_BIN", REPO / "target" / "release" / "pdmesh"))
    if not p.is_absolute():
        p = REPO / p
    if not p.is_file():
        pytest.fail(f"{p} does not exist: build it first (cargo build --release -p pdmesh-cli)", pytrace=False)
    return p


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None, timeout: float = 60):
    """(status, body bytes) of one request; HTTP errors are returned, not raised."""
    status, body, _ = http_headers(method, url, body, headers, timeout)
    return status, body


def http_headers(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
                 timeout: float = 60):
    """`http`, with the response's headers too ({lower-cased name: value})."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}


def raw_exchange(host: str, port: int, data: bytes) -> bytes:
    """Sends `data` on a fresh TCP connection and returns what comes back until the peer
    closes (or resets) it."""
    got = b""
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
    return got


def parse_metrics(text: str) -> dict[str, float]:
    """A Prometheus text exposition as {series: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metrics(base: str) -> dict[str, float]:
    """A gateway's /metrics as {series: value}."""
    status, body = http("GET", base + "/metrics")
    assert status == 200, body
    return parse_metrics(body.decode())


def fixture(name: str):
    """The committed fixture `tests/fixtures/<name>`, parsed (JSON)."""
    return json.loads((REPO / "tests" / "fixtures" / name).read_text())


def wait_healthy(procs: dict, health, logs, timeout: float = 120, poll: float = 0.2) -> None:
    """Waits until `health()` (a gateway's /health status; OSError while nothing listens)
    is 200, failing as soon as one of `procs` ({name: Popen}) exits, with `logs()`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited with {p.returncode}:\n{logs()}"
        try:
            if health() == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(poll)
    pytest.fail(f"the mesh did not become healthy:\n{logs()}", pytrace=False)


def stop_procs(procs, sig=signal.SIGTERM, timeout: float = 30) -> None:
    """Sends `sig` to each of `procs` still running (SIGCONT first, for one a test
    paused) and waits for each, killing one that outlives `timeout`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def orphans(pids: list[int], timeout: float = 10) -> list[int]:
    """Those of `pids` still alive once they had `timeout` seconds to go."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@dataclass
class Mesh:
    """A running `pdmesh up`."""

    proc: subprocess.Popen
    ports: dict
    log_path: Path
    # Where its services write incident reports.
    incident_dir: Path | None = None
    base: str = field(init=False)

    def __post_init__(self) -> None:
        self.base = f"http://127.0.0.1:{self.ports['gateway']}"

    @property
    def model(self) -> str:
        return self.ports["model"]

    def child_pids(self) -> list[int]:
        pids = self.ports["pids"]
        out = [pids[k] for k in ("tokenizer", "cache", "worker", "gateway")]
        return out + pids.get("prefill", []) + pids.get("decode", [])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0, timeout=300)

    def metrics(self) -> dict[str, float]:
        return metrics(self.base)


def start_up(tmp: Path, extra_args: list[str] | None = None, env: dict | None = None, port: int = 0) -> Mesh:
    """Starts `pdmesh up` with its gateway on `port` (default 0: `up` binds any free port
    and names it in its ports file, as it does every service's) and waits until its
    gateway is healthy."""
    tmp.mkdir(parents=True, exist_ok=True)
    ports_json = tmp / "ports.json"
    log_path = tmp / "up.log"
    env = dict(os.environ, PDMESH_API_KEY=API_KEY, PDMESH_ADMIN_KEY=ADMIN_KEY, **(env or {}))
    cmd = [str(pdmesh_bin()), "up", "--port", str(port), "--ports-json", str(ports_json),
           "--incident-dir", str(tmp / "incidents"), *(extra_args or [])]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ports_json.exists():
        if proc.poll() is not None:
            pytest.fail(f"pdmesh up exited with {proc.returncode}:\n{log_path.read_text()}", pytrace=False)
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"pdmesh up not ready after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()}", pytrace=False)
        time.sleep(0.2)
    mesh = Mesh(proc=proc, ports=json.loads(ports_json.read_text()), log_path=log_path,
                incident_dir=tmp / "incidents")
    status, body = http("GET", mesh.base + "/health")
    assert status == 200, body
    return mesh


def wait_baseline(metrics, logs, timeout: float = 30, caches: bool = False) -> dict[str, float]:
    """Waits until nothing is held: no request in a worker, no reserved page, every pool
    page free or cached, no room open, no mirror slot held by a room (and, with `caches`,
    every cache service read). `metrics` scrapes the gateway; `logs` says what to show
    when it does not come back."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics()
        held = {
            k: v for k, v in m.items()
            if (k.startswith("mesh_worker_requests") or k.startswith("mesh_room_slots") or k == "mesh_kv_reserved_pages"
                or (k.startswith("mesh_rooms{") and 'state="failed"' not in k))
            and v != 0
        }
        pages = m["mesh_kv_pages_free"] + m["mesh_kv_pages_cached"]
        # Only a scrape that read every worker tells: the worker gauges are stale otherwise.
        read = m["mesh_workers_read"] == 1 and (not caches or m["mesh_caches_read"] == 1)
        if read and not held and pages == m["mesh_kv_pages_capacity"]:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"not back to baseline: workers read {m['mesh_workers_read']}, caches read "
                        f"{m.get('mesh_caches_read')}, held {held}, free+cached {pages} of "
                        f"{m['mesh_kv_pages_capacity']}\n{logs()}", pytrace=False)
        time.sleep(0.25)


def stop_up(mesh: Mesh) -> int:
    """SIGTERM to `up`; returns its exit code. Fails if it or any child outlives it."""
    if mesh.proc.poll() is None:
        mesh.proc.send_signal(signal.SIGTERM)
    try:
        code = mesh.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        mesh.proc.kill()
        pytest.fail(f"pdmesh up did not stop on SIGTERM:\n{mesh.log()}", pytrace=False)
    left = [pid for pid in mesh.child_pids() if alive(pid)]
    assert not left, f"child processes left behind: {left}\n{mesh.log()}"
    return code


@pytest.fixture(scope="session")
def mesh(tmp_path_factory) -> Mesh:
    m = start_up(tmp_path_factory.mktemp("up"))
    yield m
    code = stop_up(m)
    assert code == 0, f"pdmesh up exited with {code} on SIGTERM:\n{m.log()}"


@pytest.fixture(scope="session")
def client(mesh) -> openai.OpenAI:
    return mesh.client()
