"""The disk tier below the host mirror, through real meshes serving SmolLM2: 80 sessions
through a host mirror and device pools too small to hold them answer bit-identically to a
unified worker with no host or disk tier, with pages spilled to disk and promoted back
(each counted). The reference keeps its device prefix cache, which the engine's tests and
the DeepSeek tests below hold to a no-cache reference: without it, 80 sessions' prompts
take over three minutes to compute on two cores. A cache service killed outright mid-load comes back and serves from the same
folder, no half-written page ever found; a restarted mesh serves a prompt's prefix from
disk, discarding (counted by reason, reported) a truncated file, a flipped byte, a garbled
header and a page renamed under another hash; one with another KV layout discards every
file. A full disk or an unwritable folder degrades the tier (metric, incident, WARN) and
never fails a request."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from conftest import ROOM_ARGS, alive, pdmesh_bin, start_up, stop_up

SESSIONS = 80
MAX_TOKENS = 6
SYSTEM = "You are the harbour master. " + " ".join(
    f"Berth {i} holds the {['ferry', 'tug', 'trawler', 'barge'][i % 4]} that came in at {6 + i % 12} o'clock."
    for i in range(11)
)
# Small tiers: 80 sessions' pages cannot stay in them, so the second turns find their first
# turns' pages only on disk. The host mirror holds 1024 tokens (64 pages), the prefill
# worker's device pool 96 pages.
SMALL = [
    "--cache-arg=--host-mirror-size=1024tokens",
    "--prefill-arg=--kv-pages=96",
    "--decode-arg=--kv-pages=256",
    *(f"--cache-arg={a}" for a in ROOM_ARGS),
]


def question(s: int, turn: int) -> str:
    return f"Session {s}, turn {turn}: which berth holds the {['tug', 'barge'][(s + turn) % 2]}?"


def ask(client, model: str, history: list[dict]) -> tuple[str, str]:
    r = client.chat.completions.create(model=model, messages=history, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason


def turn_messages(s: int, first: tuple[str, str] | None) -> list[dict]:
    """Session `s`'s request: turn 0, or (given turn 0's answer) turn 1."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(s, 0)}]
    if first is not None:
        msgs += [{"role": "assistant", "content": first[0]}, {"role": "user", "content": question(s, 1)}]
    return msgs


def sessions(client, model: str, which, threads: int = 8) -> dict[int, list[tuple[str, str]]]:
    """Every first turn, then every second turn (by then the first turns' pages have left
    the small tiers for the disk): each session's two answers."""
    which = list(which)
    with cf.ThreadPoolExecutor(threads) as pool:
        first = dict(zip(which, pool.map(lambda s: ask(client, model, turn_messages(s, None)), which)))
        second = dict(zip(which, pool.map(lambda s: ask(client, model, turn_messages(s, first[s])), which)))
    return {s: [first[s], second[s]] for s in which}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, list[tuple[str, str]]]:
    """Every session's answers from a unified worker with no host or disk tier."""
    mesh = start_up(tmp_path_factory.mktemp("reference"), ["--unified", "--no-host-cache", "--no-smoke-test"])
    try:
        return sessions(mesh.client(), mesh.model, range(SESSIONS))
    finally:
        stop_up(mesh)


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    path.chmod(0o700)
    return path


def wait_for(cond, what: str, log, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        assert time.monotonic() < deadline, f"{what}\n{log()[-6000:]}"
        time.sleep(0.2)
    return v


def disk_serving(mesh, pages: int | None = None):
    """The gateway's metrics once it has read the cache service and its disk tier serves
    (with `pages` pages, when given)."""
    def ready():
        m = mesh.metrics()
        ok = m["mesh_caches_read"] == 1 and m['mesh_kv_disk_tier{state="serving"}'] == 1
        return m if ok and (pages is None or m["mesh_kv_disk_pages"] == pages) else None
    return wait_for(ready, "the disk tier never served", mesh.log)


def page_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("*.page"))


def test_80_sessions_through_small_tiers_kill_restart_and_spoiled_files(tmp_path, reference):
    disk = private_dir(tmp_path / "disk")
    mesh = start_up(tmp_path / "a", ["--restart", "--no-smoke-test", "--disk-dir", str(disk), *SMALL])
    ports = lambda: json.loads((tmp_path / "a" / "ports.json").read_text())
    try:
        # 1. All 80 sessions: identical, pages spilled and promoted back.
        assert sessions(mesh.client(), mesh.model, range(SESSIONS)) == reference
        m = mesh.metrics()
        spilled, promoted = m['mesh_kv_disk_pages_total{event="spilled"}'], m['mesh_kv_disk_pages_total{event="promoted"}']
        assert spilled > 0 and promoted > 0, {k: v for k, v in m.items() if "disk" in k}
        assert m['mesh_kv_cache_hit_tokens_total{tier="disk"}'] > 0
        assert m['mesh_kv_disk_io_bytes_total{direction="read"}'] > 0
        assert sum(v for k, v in m.items() if k.startswith("mesh_kv_disk_discards_total")) == 0
        # A second cache service on the folder is refused while this one holds it.
        second = subprocess.run([str(pdmesh_bin()), "cache", "--listen", "127.0.0.1:0", "--insecure-plaintext",
                                 "--disk-dir", str(disk)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "used by another cache service" in second.stderr, second

        # 2. The cache service killed outright while spilling and promoting: requests cut
        # short may fail, those that answer answer right, and the restarted service serves
        # from the same folder, which holds no half-written page.
        old = ports()["pids"]["cache"]
        client = mesh.client()

        def ask_or_none(s: int):
            try:
                return s, ask(client, mesh.model, turn_messages(s, reference[s][0]))
            except openai.APIError:
                return s, None

        with cf.ThreadPoolExecutor(8) as pool:
            load = [pool.submit(ask_or_none, s) for s in range(40, 64)]
            wait_for(lambda: any(f.done() for f in load), "no request of the load ended", mesh.log)
            os.kill(old, signal.SIGKILL)
            wait_for(lambda: not alive(old), "the killed cache service stayed", mesh.log)
            # What the kill cut short: temporary files, never pages.
            cut_short = set(disk.glob("*.tmp"))
            done = [f.result() for f in load]
        assert all(a == reference[s][1] for s, a in done if a is not None), done
        wait_for(lambda: ports()["pids"]["cache"] != old, "the cache service never came back", mesh.log)
        m = disk_serving(mesh)
        # The new service's rebuild removed each (a later write's temporary file has a new name).
        assert not cut_short & set(disk.glob("*.tmp")), "a write the kill cut short was left behind"
        assert m['mesh_kv_disk_discards_total{reason="unfinished"}'] == len(cut_short), m
        assert sum(v for k, v in m.items() if k.startswith("mesh_kv_disk_discards_total")
                   and 'reason="unfinished"' not in k) == 0, m
        assert sessions(mesh.client(), mesh.model, range(40, 56)) == {s: reference[s] for s in range(40, 56)}
    finally:
        assert stop_up(mesh) == 0, mesh.log()[-6000:]

    # 3. A graceful stop wrote the mirror's pages out; spoil four files, then restart the
    # whole mesh (empty device pools, an empty mirror) on the folder.
    files = page_files(disk)
    assert len(files) >= 8, files
    truncated, flipped, garbled, renamed = files[:4]
    truncated.write_bytes(truncated.read_bytes()[:100])
    b = bytearray(flipped.read_bytes())
    b[-1] ^= 0x20
    flipped.write_bytes(bytes(b))
    b = bytearray(garbled.read_bytes())
    b[0] ^= 0xFF
    garbled.write_bytes(bytes(b))
    renamed.rename(disk / f"{int(renamed.stem, 16) ^ 1:016x}.page")
    sound = len(files) - 4
    mesh = start_up(tmp_path / "b", ["--no-smoke-test", "--disk-dir", str(disk), *SMALL])
    try:
        m = disk_serving(mesh, pages=sound)
        assert {r: m[f'mesh_kv_disk_discards_total{{reason="{r}"}}'] for r in
                ("partial", "bad_checksum", "bad_header", "wrong_name", "foreign_layout")} == {
            "partial": 1, "bad_checksum": 1, "bad_header": 1, "wrong_name": 1, "foreign_layout": 0}, m
        reports = [json.loads(p.read_text()) for p in mesh.incident_dir.glob("*.json")]
        assert [(r["kind"], r["place"]["stage"]) for r in reports] == [("checksum", "disk open")], reports
        # The shared prefix comes from disk now: nothing else holds it.
        want = {s: reference[s] for s in range(8)}
        assert sessions(mesh.client(), mesh.model, range(8)) == want
        assert mesh.metrics()['mesh_kv_cache_hit_tokens_total{tier="disk"}'] > 0
    finally:
        assert stop_up(mesh) == 0, mesh.log()[-6000:]

    # 4. Another KV layout (32-token pages) on the same folder: every file is foreign.
    pages = len(page_files(disk))
    mesh = start_up(tmp_path / "c", ["--no-smoke-test", "--disk-dir", str(disk), "--worker-arg=--page-size=32", *SMALL])
    try:
        m = disk_serving(mesh, pages=0)
        assert m['mesh_kv_disk_discards_total{reason="foreign_layout"}'] == pages > 0, m
        assert sessions(mesh.client(), mesh.model, range(8)) == {s: reference[s] for s in range(8)}
    finally:
        assert stop_up(mesh) == 0, mesh.log()[-6000:]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (a disk that fills after five of SmolLM2's 360 KiB pages), unmounted
    at the end."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_unwritable_disk_degrades_the_tier_and_no_request_fails(tmp_path, reference, small_tmpfs, fault):
    """A full disk (a 2 MiB tmpfs below a 64 MiB --disk-size) degrades the tier at the
    first write that fails; a read-only one at start. Either way: the degraded gauge, one
    `disk_degraded` report, and every answer right."""
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    mesh = start_up(tmp_path / "up", ["--no-smoke-test", "--disk-dir", str(small_tmpfs / "disk" if fault == "read-only" else small_tmpfs),
                                      "--cache-arg=--disk-size=64MiB", *SMALL])
    try:
        assert sessions(mesh.client(), mesh.model, range(16)) == {s: reference[s] for s in range(16)}
        m = wait_for(lambda: (m := mesh.metrics())['mesh_kv_disk_tier{state="degraded"}'] == 1 and m,
                     "the tier never said it was degraded", mesh.log)
        assert m['mesh_incidents_total{kind="disk_degraded"}'] == 1, m
        # Full: the pages that fitted were written first; read-only: none ever was.
        assert (m['mesh_kv_disk_pages_total{event="spilled"}'] > 0) == (fault == "full"), m
        reports = [json.loads(p.read_text()) for p in mesh.incident_dir.glob("*.json")]
        assert [r["kind"] for r in reports] == ["disk_degraded"], reports
        assert "disk tier degraded" in mesh.log()
    finally:
        assert stop_up(mesh) == 0, mesh.log()[-6000:]
