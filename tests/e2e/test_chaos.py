"""`pdmesh chaos` against a real `pdmesh up --restart`: a worker (prefill or decode) killed
mid-load comes back on its own, and the command's verdict says every request ended in time,
no page leaked and every answer is unchanged; so after a stopped cache service and after
clients that leave mid-request; bytes flipped in the host mirror are caught by the workers'
checksums and recomputed; a small decode pool, run out, refuses with 429s. Short loads
throughout. Also `/flush_cache`, and the command's refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOM_ARGS, WORKER_ARGS, API_KEY, alive, http, pdmesh_bin, start_up, stop_up

# conftest's short room deadlines, but a hand-over gets 10 s: on two busy cores a prefill's
# pages can wait seconds for its engine loop to copy them, and a request failed by that is
# not the fault under test.
CHAOS_ROOM_ARGS = [
    *(a for a in ROOM_ARGS if not a.startswith(("--room-transfer-ms=", "--room-success-ms="))),
    "--room-transfer-ms=10000",
    "--room-success-ms=10000",
]

# Small loads: each scenario stays well under a minute on two cores.
LOAD = ["--requests", "6", "--input-len", "200", "--max-tokens", "16", "--deadline-s", "40", "--settle-s", "60"]


@pytest.fixture(scope="module")
def restarting(tmp_path_factory):
    """A disaggregated mesh whose services `up` restarts when they die."""
    tmp = tmp_path_factory.mktemp("restarting")
    args = [
        "--restart",
        "--no-smoke-test",
        "--cache-arg=--host-mirror-size=256MiB",
        *(f"--cache-arg={a}" for a in CHAOS_ROOM_ARGS),
        *(f"--worker-arg={a}" for a in WORKER_ARGS),
    ]
    m = start_up(tmp, args)
    m.ports_path = tmp / "ports.json"
    yield m
    # Restarted services have new pids: stop_up checks those are gone too.
    m.ports = json.loads(m.ports_path.read_text())
    assert stop_up(m) == 0, m.log()


def chaos(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDMESH_API_KEY=API_KEY)
    return subprocess.run([str(pdmesh_bin()), "chaos", *args], env=env, capture_output=True, text=True, timeout=timeout)


def verdict(out: Path) -> dict:
    v = json.loads((out / "verdict.json").read_text())
    assert set(v) >= {"scenario", "url", "passed", "checks", "fault", "requests", "settled", "answers", "duration_s"}, v
    return v


def ask(mesh, prompt: str = "Which box is blue? Answer briefly.") -> str:
    r = mesh.client().chat.completions.create(
        model=mesh.model, messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )
    return r.choices[0].message.content


def wait_for(cond, timeout: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}\n{log()}"
        time.sleep(0.2)


def test_up_restart_brings_a_killed_worker_back_on_its_port(restarting):
    m = restarting
    ports = json.loads(m.ports_path.read_text())
    assert ports["restart"] is True
    before = ask(m)
    old = ports["pids"]["decode"][0]
    os.kill(old, signal.SIGKILL)

    def new_pid() -> int:
        return json.loads(m.ports_path.read_text())["pids"]["decode"][0]

    wait_for(lambda: new_pid() != old, 60, "the ports file never named a new decode pid", m.log)
    new = new_pid()
    assert alive(new) and not alive(old)
    wait_for(lambda: http("GET", m.base + "/health", timeout=5)[0] == 200, 60, "the mesh never became healthy", m.log)
    assert m.proc.poll() is None, "up keeps running"
    log = m.log()
    assert f"the decode (pid {old}) exited with signal: 9" in log and "restarting it in 1 s" in log, log
    assert f"restarted the decode (pid {new})" in log, log
    # Same port: the gateway reaches the new worker, which answers as the old one did.
    assert json.loads(m.ports_path.read_text())["decode"] == ports["decode"]
    assert ask(m) == before


def test_chaos_kill_prefill_passes_on_a_restarting_mesh(restarting, tmp_path):
    m = restarting
    old = json.loads(m.ports_path.read_text())["pids"]["prefill"][0]
    out = tmp_path / "kill"
    t0 = time.monotonic()
    # Long enough answers that the load is still running when the kill strikes: the
    # healthy pass left the prompts in the host mirror, so prefill alone is quick.
    load = list(LOAD)
    load[load.index("--max-tokens") + 1] = "64"
    r = chaos("kill-prefill", "--mesh", str(m.ports_path), *load, "--fault-after-s", "0.5", "--out", str(out))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr + m.log()[-3000:]
    v = verdict(out)
    assert v["scenario"] == "kill-prefill" and v["passed"] is True, v
    names = [c["name"] for c in v["checks"]]
    assert names == [
        "requests ended in time", "no leaked pages", "answers identical", "fault under load", "restarted", "answers after recovery"
    ], names
    assert all(c["passed"] for c in v["checks"]), v["checks"]
    # The loaded pass and the pass after recovery; every answer was compared.
    assert v["requests"]["sent"] == 12 and v["requests"]["timed_out"] == 0 and not v["requests"]["broken"], v["requests"]
    assert v["answers"]["compared"] == v["requests"]["ok"] >= 6 and v["answers"]["differing"] == 0, v["answers"]
    assert v["settled"]["baseline"] is True and v["settled"]["pages_held"] == 0
    assert f"(pid {old})" in v["fault"], v["fault"]
    new = json.loads(m.ports_path.read_text())["pids"]["prefill"][0]
    assert new != old and alive(new)
    for word in ("PASS  requests ended in time", "PASS  no leaked pages", "PASS  answers identical", "verdict: PASS"):
        assert word in r.stdout, r.stdout
    print(f"kill-prefill took {took:.1f} s")
    assert ask(m), "the mesh still answers"


def test_chaos_flip_host_bytes_is_caught_by_the_checksums(restarting, tmp_path):
    m = restarting
    out = tmp_path / "flip"
    t0 = time.monotonic()
    r = chaos("flip-host-bytes", "--mesh", str(m.ports_path), *LOAD, "--out", str(out))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr + m.log()[-3000:]
    v = verdict(out)
    assert v["passed"] is True and all(c["passed"] for c in v["checks"]), v["checks"]
    assert [c["name"] for c in v["checks"]][-2:] == ["pages flipped", "corruption caught"]
    # The fault was really exercised: loads of flipped pages failed their checksums...
    assert v["checksum_failures"] > 0, v
    # ...and the answers, recomputed, are the healthy mesh's.
    assert v["answers"]["compared"] == 6 and v["answers"]["differing"] == 0, v["answers"]
    assert v["requests"]["ok"] == 6, v["requests"]
    assert "checksum failures seen" in r.stdout, r.stdout
    # ...and each worker that loaded a flipped page filed a checksum report saying which
    # page, with the checksum it was stored with and the one of the bytes found.
    loads = [r for r in (json.loads(p.read_text()) for p in m.incident_dir.glob("*.json"))
             if r["kind"] == "checksum" and r["place"].get("stage") == "host load-back"]
    assert loads, sorted(p.name for p in m.incident_dir.iterdir())
    pages = [p for r in loads for p in r["pages"]]
    assert pages and all(p["page"].startswith("hash 0x") and p["expected"] != p["found"] for p in pages), pages
    failing = [next(x for x in r["metrics"] if x["name"] == "host pages failing their checksum on load") for r in loads]
    assert all(x["after"] >= 1 for x in failing), failing
    print(f"flip-host-bytes took {took:.1f} s")
    assert ask(m), "the mesh still answers"


def test_flush_cache_empties_every_workers_device_cache(restarting):
    m = restarting
    ask(m, "Name three rivers of Europe.")
    status, body = http("POST", m.base + "/flush_cache")
    assert status == 401, body
    status, body = http("POST", m.base + "/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, body
    v = json.loads(body)
    assert sorted(w["role"] for w in v["workers"]) == ["decode", "prefill"], v
    assert v["pages_flushed"] == sum(w["pages_flushed"] for w in v["workers"]) > 0, v
    got = m.metrics()
    assert got["mesh_kv_pages_cached"] == 0 and got["mesh_kv_pages_free"] == got["mesh_kv_pages_capacity"], got
    # Nothing cached is left to flush.
    status, body = http("POST", m.base + "/flush_cache", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and json.loads(body)["pages_flushed"] == 0, body


def proc_state(pid: int) -> str:
    """The one-letter state of `pid` (R, S, T for stopped...), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def run_scenario(m, scenario: str, out: Path, *args: str) -> tuple[dict, str]:
    """Runs `pdmesh chaos SCENARIO` against `m`; (verdict, stdout) once every check passed."""
    t0 = time.monotonic()
    r = chaos(scenario, "--mesh", str(m.ports_path), *args, "--out", str(out))
    print(f"{scenario} took {time.monotonic() - t0:.1f} s")
    assert r.returncode == 0, r.stdout + r.stderr + m.log()[-3000:]
    v = verdict(out)
    assert v["scenario"] == scenario and v["passed"] is True, v
    assert all(c["passed"] for c in v["checks"]), v["checks"]
    assert v["requests"]["timed_out"] == 0 and not v["requests"]["broken"], v["requests"]
    assert v["settled"]["baseline"] is True and v["settled"]["pages_held"] == 0, v["settled"]
    assert v["answers"]["compared"] > 0 and v["answers"]["differing"] == 0, v["answers"]
    assert "verdict: PASS" in r.stdout, r.stdout
    return v, r.stdout


def test_chaos_kill_decode_passes_on_a_restarting_mesh(restarting, tmp_path):
    m = restarting
    old = json.loads(m.ports_path.read_text())["pids"]["decode"][0]
    load = list(LOAD)
    load[load.index("--max-tokens") + 1] = "32"
    v, _ = run_scenario(m, "kill-decode", tmp_path / "kill", *load, "--fault-after-s", "0.3")
    names = [c["name"] for c in v["checks"]]
    assert names[3:] == ["fault under load", "restarted", "answers after recovery"], names
    # The decode the ports file named was killed under load and `up` started another.
    assert f"SIGKILL to the decode (pid {old})" in v["fault"], v["fault"]
    assert v["requests"]["sent"] == 12 and v["requests"]["ok"] >= 6, v["requests"]
    new = json.loads(m.ports_path.read_text())["pids"]["decode"][0]
    assert new != old and alive(new) and not alive(old)
    assert ask(m), "the mesh still answers"


def test_chaos_stall_cache_passes_and_leaves_the_cache_service_running(restarting, tmp_path):
    m = restarting
    cache = json.loads(m.ports_path.read_text())["pids"]["cache"]
    # Early: while the requests' rooms are open (each hand-over takes a fraction of a
    # second; decoding the rest of the answer does not need the room).
    v, _ = run_scenario(m, "stall-cache", tmp_path / "stall", *LOAD, "--fault-after-s", "0.1", "--stall-s", "4")
    names = [c["name"] for c in v["checks"]]
    assert names[3:] == ["fault under load", "answers after recovery"], names
    assert f"SIGSTOP to the cache service (pid {cache})" in v["fault"] and "SIGCONT" in v["fault"], v["fault"]
    # The loaded pass and the pass after recovery.
    assert v["requests"]["sent"] == 12 and v["requests"]["ok"] >= 6, v["requests"]
    # The same process, running again: not left stopped, not restarted; the workers hold
    # leases with it.
    assert json.loads(m.ports_path.read_text())["pids"]["cache"] == cache
    assert proc_state(cache) not in ("", "T", "t"), proc_state(cache)
    assert m.metrics()["mesh_host_mirror_leases"] > 0
    # The cache service reported its own stall: a wedge report listing the rooms under
    # way when it resumed, with their requests' trace ids and the oldest one's timeline.
    stalls = [r for r in (json.loads(p.read_text()) for p in m.incident_dir.glob("*.json"))
              if r["kind"] == "wedge" and r["place"].get("stage") == "service stall"]
    assert len(stalls) == 1, sorted(p.name for p in m.incident_dir.iterdir())
    w = stalls[0]
    assert float(w["details"]["stalled seconds"]) >= 3, w["details"]
    assert w["stuck_rooms"] and all(r["trace_id"] and r["request_id"] for r in w["stuck_rooms"]), w["stuck_rooms"]
    assert w["place"]["trace_id"] == w["stuck_rooms"][0]["trace_id"]
    assert w["timeline"][0]["what"] == "opened (bootstrapping)", w["timeline"]
    assert ask(m), "the mesh still answers"


def test_chaos_disconnect_clients_passes_and_the_workers_see_them_leave(restarting, tmp_path):
    m = restarting
    key = 'mesh_kv_transfer_failures_total{reason="caller_left"}'
    before = m.metrics().get(key, 0.0)
    load = ["--requests", "4", "--input-len", "120", "--max-tokens", "16", "--deadline-s", "40", "--settle-s", "60"]
    v, _ = run_scenario(m, "disconnect-clients", tmp_path / "leave", *load)
    assert [c["name"] for c in v["checks"]][3:] == ["clients left"], v["checks"]
    # 4 compared requests and 4 clients that leave (2 while prefill runs, 2 while decoding).
    assert v["requests"]["sent"] == 8 and v["requests"]["left"] >= 2, v["requests"]
    assert "left during prefill" in v["checks"][3]["detail"], v["checks"][3]
    # The workers dropped the work of the clients that left.
    assert m.metrics().get(key, 0.0) > before
    assert ask(m), "the mesh still answers"


@pytest.fixture
def small_decode(tmp_path):
    """A disaggregated mesh whose decode pool holds about three short requests, and which
    refuses a request that waited half a second for pages."""
    args = [
        "--no-smoke-test",
        "--cache-arg=--host-mirror-size=64MiB",
        *(f"--cache-arg={a}" for a in CHAOS_ROOM_ARGS),
        *(f"--worker-arg={a}" for a in WORKER_ARGS),
        "--decode-arg=--kv-pages=32",
        "--decode-arg=--admission-timeout-ms=500",
    ]
    m = start_up(tmp_path, args)
    m.ports_path = tmp_path / "ports.json"
    yield m
    assert stop_up(m) == 0, m.log()


def test_chaos_exhaust_decode_refuses_with_429_when_the_decode_pool_runs_out(small_decode, tmp_path):
    m = small_decode
    key = 'mesh_admission_timeouts_total{side="all"}'
    before = m.metrics()[key]
    load = ["--requests", "6", "--input-len", "120", "--max-tokens", "24", "--deadline-s", "40", "--settle-s", "60"]
    v, out = run_scenario(m, "exhaust-decode", tmp_path / "exhaust", *load)
    assert [c["name"] for c in v["checks"]][3:] == ["refused with 429", "pool exhausted"], v["checks"]
    req = v["requests"]
    refused = sum(req["refused"].values())
    # Some were served, the rest refused as overloaded, and nothing else.
    assert req["sent"] == 6 and req["ok"] > 0 and refused > 0 and req["ok"] + refused == 6, req
    assert set(req["refused"]) <= {"429", "in_stream:overloaded"}, req
    # Each refusal was decode's admission deadline, as the mesh counts it.
    assert m.metrics()[key] - before == refused
    assert "found no decode pages in time" in out, out
    assert ask(m), "the mesh answers once the load is gone"


def test_a_kill_scenario_needs_a_restarting_mesh_and_says_so(mesh, tmp_path):
    """The session mesh runs without --restart: nothing is killed, nothing is sent."""
    ports = mesh.log_path.parent / "ports.json"
    assert json.loads(ports.read_text())["restart"] is False
    t0 = time.monotonic()
    r = chaos("kill-decode", "--mesh", str(ports), "--out", str(tmp_path / "v"), timeout=60)
    assert r.returncode != 0 and time.monotonic() - t0 < 10
    assert "kill-decode needs" in r.stderr and "pdmesh up --restart" in r.stderr, r.stderr
    assert not (tmp_path / "v").exists()
    assert all(alive(p) for p in mesh.child_pids() if p)


def test_a_bad_scenario_or_ports_file_is_a_clear_error(tmp_path):
    r = chaos("melt-down", "--mesh", str(tmp_path / "p.json"), timeout=60)
    assert r.returncode == 2 and "melt-down" in r.stderr, r.stderr
    r = chaos("stall-cache", "--mesh", str(tmp_path / "missing.json"), timeout=60)
    assert r.returncode == 1 and "missing.json" in r.stderr, r.stderr
    (tmp_path / "junk.json").write_text("{}")
    r = chaos("stall-cache", "--mesh", str(tmp_path / "junk.json"), timeout=60)
    assert r.returncode == 1 and "not a ports file written by `pdmesh up --ports-json`" in r.stderr, r.stderr
