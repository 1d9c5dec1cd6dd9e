"""A cache service killed outright leaks nothing: under `pdmesh up --restart`, each new
cache service removes the host mirror file its killed predecessor left in the shared-memory
directory, the workers let go of the old mapping once they register with the new service
(so its memory is freed), greedy answers stay the same throughout, and a clean stop leaves
no mirror file at all. The mesh gets its own `--shm-dir`, so the counts are exact whatever
else runs on the host."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from conftest import ROOM_ARGS, WORKER_ARGS, http, start_up, stop_up

PROMPTS = [
    "Which box is blue? Answer briefly.",
    "Name three colours of the rainbow.",
    "What is two plus three? Answer with a number.",
]
KILLS = 3


def mirror_files(shm: Path) -> list[str]:
    """The published mirror files under `shm` (in the user's private directory there), and
    any file a creator has not yet published."""
    own = shm / f"pdmesh-mirrors-{os.geteuid()}"
    if not own.exists():
        return []
    return sorted(p.name for p in own.iterdir() if p.name.startswith(("pdmesh-mirror-", "pdmesh-new-mirror-")))


def mapped_mirrors(pid: int) -> set[str]:
    """The mirror files `pid` maps, by path (a removed file's ends with " (deleted)")."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return set()
    out = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/pdmesh-mirror-" in fields[5]:
            out.add(fields[5])
    return out


def wait_for(cond, what, log, timeout: float = 90):
    """Polls `cond` until it returns something truthy, which is returned; `what` (text, or
    a function giving it at the timeout) says what did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"{what() if callable(what) else what}\n{log()[-6000:]}"
        time.sleep(0.2)


def test_killed_cache_services_leave_one_mirror_file_and_a_clean_stop_none(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    ports_path = tmp_path / "up" / "ports.json"
    mesh = start_up(tmp_path / "up", [
        "--restart",
        "--no-smoke-test",
        f"--cache-arg=--shm-dir={shm}",
        "--cache-arg=--host-mirror-size=64MiB",
        *(f"--cache-arg={a}" for a in ROOM_ARGS),
        *(f"--worker-arg={a}" for a in WORKER_ARGS),
    ])
    client = mesh.client()

    def ports() -> dict:
        return json.loads(ports_path.read_text())

    def workers() -> list[int]:
        pids = ports()["pids"]
        return sorted({pids["worker"], *pids.get("prefill", []), *pids.get("decode", [])})

    def ask(prompt: str) -> str:
        r = client.chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0
        )
        return r.choices[0].message.content

    def ask_or_error(prompt: str) -> tuple[str, str | None]:
        try:
            return prompt, ask(prompt)
        except openai.APIError:  # a request the kill cut short may fail; it must not lie
            return prompt, None

    def settled(cache: int):
        """The one mirror file `cache` maps, once it is the only one in the directory and
        every worker maps it and nothing else (an old, removed file no longer)."""
        mine = mapped_mirrors(cache)
        if len(mine) != 1:
            return None
        path = next(iter(mine))
        if path.endswith(" (deleted)") or mirror_files(shm) != [Path(path).name]:
            return None
        if any(mapped_mirrors(w) != mine for w in workers()):
            return None
        return path

    try:
        first = wait_for(lambda: settled(ports()["pids"]["cache"]), "the first mirror never settled", mesh.log)
        reference = {p: ask(p) for p in PROMPTS}
        assert all(reference.values()), reference
        killed = [first]
        cut = 0
        for _ in range(KILLS):
            old = ports()["pids"]["cache"]
            with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
                load = [pool.submit(ask_or_error, p) for p in [*PROMPTS, PROMPTS[0]]]
                os.kill(old, signal.SIGKILL)
                new = wait_for(lambda: (p := ports()["pids"]["cache"]) != old and p, "the cache service never came back",
                               mesh.log)
                path = wait_for(lambda: settled(new), lambda: "the killed cache service's mirror file stayed, or "
                                f"a worker kept mapping it: files {mirror_files(shm)}, mapped by the cache "
                                f"{mapped_mirrors(new)}, by the workers {[mapped_mirrors(w) for w in workers()]}",
                                mesh.log)
                done = [f.result() for f in load]
            # A request the kill cut short may fail; one that answers answers as before.
            for prompt, answer in done:
                if answer is None:
                    cut += 1
                else:
                    assert answer == reference[prompt], (prompt, answer, reference[prompt])
            assert path not in killed
            killed.append(path)

        wait_for(lambda: http("GET", mesh.base + "/health", timeout=5)[0] == 200, "the mesh never became healthy",
                 mesh.log)
        assert mirror_files(shm) == [Path(killed[-1]).name], mirror_files(shm)
        assert {p: ask(p) for p in PROMPTS} == reference
        # Each new cache service said which file of a dead one it removed.
        log = mesh.log()
        for path in killed[:-1]:
            name = Path(path).name
            assert any("removed a host mirror file" in line and name in line for line in log.splitlines()), (name, log[-6000:])
        print(f"{KILLS} kills, {cut} requests cut short")
    finally:
        # Restarted services have new pids: stop_up checks those are gone too.
        mesh.ports = ports()
        code = stop_up(mesh)
    assert code == 0, mesh.log()[-6000:]
    assert mirror_files(shm) == []
