"""`pdmesh bench` against the real mesh: agentic sessions (shared system prompt, tools,
tool results, growing history) on the disaggregated mesh with its host cache, every answer
compared with the same request run alone on a unified worker without any cache. The
mesh's answers must match them all (0% corruption), every forced tool call must be valid,
and the report files must be written and well-formed."""

from __future__ import annotations

import json
import os
import struct
import subprocess

from conftest import API_KEY, pdmesh_bin, start_up, stop_up

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDMESH_API_KEY=API_KEY)
    return subprocess.run([str(pdmesh_bin()), "bench", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_sessions_on_the_pd_mesh_match_a_unified_no_cache_reference(mesh, tmp_path):
    (tmp_path / "ref").mkdir()
    ref = start_up(tmp_path / "ref", ["--unified", "--no-host-cache", "--worker-arg=--disable-prefix-cache", "--no-smoke-test"])
    try:
        out = tmp_path / "report"
        r = bench(
            "--url", mesh.base + "/v1", "--reference", ref.base + "/v1", "--label", "pdmesh-pd",
            "--workload", "sessions", "--requests", "4", "--turns", "3", "--concurrency", "4",
            # Room for most whole tool calls (about 33 tokens with SmolLM2).
            "--input-len", "120", "--output-len", "48", "--out", str(out),
        )
    finally:
        assert stop_up(ref) == 0
    assert r.returncode == 0, r.stdout + r.stderr
    reports = json.loads((out / "report.json").read_text())
    assert [x["label"] for x in reports] == ["pdmesh-pd"]
    levels = reports[0]["levels"]
    assert [lv["concurrency"] for lv in levels] == [4]
    for lv in levels:
        assert lv["requests"] == 12 and lv["errors"] == 0, lv
        d = lv["differential"]
        # Every answer was replayed alone on the reference and matched it token for token.
        assert d["compared"] == 12 and d["corrupted"] == 0, d
        # Turns 1 and 3 of each session name a tool: the grammar makes every call that
        # was not cut short by max_tokens valid.
        assert d["tool_calls_expected"] + d["tool_calls_truncated"] == 8, d
        assert d["tool_calls_expected"] >= 6 and d["tool_calls_valid"] == d["tool_calls_expected"], (d, r.stderr)
        assert 0 < lv["ttft"]["p50"] <= lv["ttft"]["p99"] <= lv["e2e"]["max"]
        assert lv["output_tokens_per_s"] > 0
        # Sessions share their system prompt and grow their history: the caches serve some.
        assert lv["cached_share"] > 0.2, lv["cached_share"]
    # One line per level on stdout, naming the differential result.
    assert r.stdout.count("corrupted 0/12") == 1, r.stdout

    for name in ("ttft.png", "throughput.png", "itl.png", "e2e.png", "corruption.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 200 and height >= 150, (name, width, height)
    html = (out / "index.html").read_text()
    assert "pdmesh-pd" in html and "<svg" in html and "sessions" in html


def test_a_random_open_loop_run_and_compare_write_reports(mesh, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, label in ((a, "first"), (b, "second")):
        r = bench("--url", mesh.base + "/v1", "--label", label, "--workload", "random", "--rate", "4,8",
                  "--requests", "8", "--input-len", "64", "--output-len", "8", "--out", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        lv = json.loads((out / "report.json").read_text())[0]["levels"]
        assert [x["rate"] for x in lv] == [4.0, 8.0] and all(x["concurrency"] is None for x in lv)
        # ignore_eos: every answer has exactly the set length.
        assert all(x["errors"] == 0 and x["requests"] == 8 for x in lv), lv
        assert all(x["differential"] is None for x in lv)
    both = tmp_path / "both"
    r = bench("compare", str(a / "report.json"), str(b / "report.json"), "--out", str(both))
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x["label"] for x in json.loads((both / "report.json").read_text())] == ["first", "second"]
    html = (both / "index.html").read_text()
    assert "first" in html and "second" in html
    assert (both / "ttft_rate.png").read_bytes().startswith(PNG_SIGNATURE)


def test_bad_arguments_and_an_unreachable_endpoint_are_clear_errors(tmp_path):
    r = bench("--url", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "x"), timeout=60)
    assert r.returncode != 0 and "127.0.0.1:9" in r.stderr, r.stderr
    r = bench("--concurrency", "0", "--model", "m", "--out", str(tmp_path / "y"), timeout=60)
    assert r.returncode != 0 and "nothing to run" in r.stderr, r.stderr
    r = bench("--workload", "nonsense", timeout=60)
    assert r.returncode == 2 and "nonsense" in r.stderr
