"""`pdmesh up` as a supervisor: when one child dies, it stops the others, says which
child and how, exits non-zero, and leaves no process behind."""

from __future__ import annotations

import os
import signal

from conftest import orphans, start_up


def test_up_stops_everything_and_fails_when_the_worker_dies(tmp_path):
    mesh = start_up(tmp_path)
    worker = mesh.ports["pids"]["worker"]
    try:
        os.kill(worker, signal.SIGKILL)
        code = mesh.proc.wait(timeout=120)
    finally:
        if mesh.proc.poll() is None:
            mesh.proc.kill()
    log = mesh.log()
    assert code != 0, log
    # In the default (disaggregated) mesh the first worker is the decode worker.
    name = "decode" if mesh.ports["mode"] == "pd" else "worker"
    assert f"the {name} (pid {worker}) exited with signal: 9" in log, log
    left = orphans(mesh.child_pids())
    assert not left, f"orphans: {left}\n{log}"


def test_up_stops_its_children_when_it_is_killed_outright(tmp_path):
    # The cache service dies by SIGKILL too, so its mirror file stays: in the test's own
    # directory, not the host's /dev/shm (the next cache service there would sweep it).
    shm = tmp_path / "shm"
    shm.mkdir()
    mesh = start_up(tmp_path, [f"--cache-arg=--shm-dir={shm}", "--cache-arg=--host-mirror-size=64MiB"])
    mesh.proc.kill()  # SIGKILL: no chance to clean up; the parent-death signal must act
    mesh.proc.wait(timeout=30)
    left = orphans(mesh.child_pids())
    assert not left, f"orphans after SIGKILL of up: {left}\n{mesh.log()}"


def test_up_prints_the_url_a_first_answer_and_a_curl_example(mesh):
    log = mesh.log()
    assert f"pdmesh is up: http://127.0.0.1:{mesh.ports['gateway']}/v1" in log, log
    answers = [line for line in log.splitlines() if line.startswith("model: ")]
    assert answers and answers[0].removeprefix("model: ").strip(), log
    assert "curl http://127.0.0.1:" in log, log
