"""`pdmesh bench matrix`, short: the matrix's configurations (the DeepSeek V3.2 tiny model
with the seed's bf16 index-K over host mirror on/off x PD/unified, SmolLM2 over mirror
on/off x PD/unified; the fp8 index-K forms run in test_deepseek.py) started with
`pdmesh up`, driven with concurrent agentic sessions and compared answer by answer with a
unified worker that has no cache. Every configuration must answer bit-identically (0%
corruption), keep every forced tool call valid, give back every page, and leave
well-formed reports. The seed's bug forced on purpose must show up in the same table as
corruption, and fail the command."""

from __future__ import annotations

import html as htmllib
import json
import os
import re
import struct
import subprocess

from conftest import API_KEY, pdmesh_bin

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Short: a few sessions, few tokens. The shared system prompt still passes the indexer's
# top-k (64 tokens), so DeepSeek attention is sparse.
SHORT = ["--sessions", "6", "--turns", "2", "--input-len", "80", "--output-len", "40",
         "--startup-timeout-s", "240", "--settle-s", "60"]


def matrix(out, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDMESH_API_KEY=API_KEY)
    return subprocess.run([str(pdmesh_bin()), "bench", "matrix", *SHORT, "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def png_ok(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 200 and height >= 150, (path, width, height)


CHARTS = ("corruption", "ttft_p50", "ttft_p99", "throughput")


def bar_label(cell: dict) -> str:
    """How a configuration is named next to its bar: model, index-K form, mirror, mode."""
    parts = [{"dsa": "DeepSeek", "smol": "SmolLM2"}[cell["model"]]]
    if cell["index_k"]:
        parts.append(f"index-K {cell['index_k']}")
    parts.append(f"mirror {cell['mirror']}")
    parts.append({"pd": "PD", "unified": "unified"}[cell["mode"]])
    return " · ".join(parts)


def charts_name_every_configuration(out, rows: list[dict]) -> None:
    """Each metric's PNG exists, and its SVG in index.html writes every measured
    configuration next to its bar, once, with value-axis ticks at round numbers only."""
    page = (out / "index.html").read_text()
    for stem in CHARTS:
        png_ok(out / f"{stem}.png")
        figure = page.split(f'<figure id="chart-{stem}">', 1)[1].split("</figure>", 1)[0]
        texts = [htmllib.unescape(t.strip()) for t in re.findall(r"<text[^>]*>(.*?)</text>", figure, re.S)]
        for row in rows:
            assert texts.count(bar_label(row["cell"])) == 1, (stem, bar_label(row["cell"]), texts)
        ticks = [float(t) for t in texts if re.fullmatch(r"\d+(\.\d+)?", t)]
        assert len(ticks) >= 3 and ticks[0] == 0, (stem, ticks)
        for t in ticks:
            digits = f"{t:e}".split("e")[0].rstrip("0").replace(".", "")
            assert len(digits) <= 2, (stem, t, ticks)


def test_the_short_matrix_is_all_zero_corruption_with_valid_calls_and_no_leaks(tmp_path):
    out = tmp_path / "matrix"
    r = matrix(out, "--dsa-model", str(tmp_path / "dsa-tiny"), "--index-k", "bf16")
    assert r.returncode == 0, r.stdout + r.stderr[-6000:]
    m = json.loads((out / "matrix.json").read_text())
    names = [row["name"] for row in m["rows"]]
    assert names == [
        f"dsa-bf16-{mirror}-{mode}" for mirror in ("mirror", "nomirror") for mode in ("pd", "unified")
    ] + [f"smol-{mirror}-{mode}" for mirror in ("mirror", "nomirror") for mode in ("pd", "unified")], names
    for row in m["rows"]:
        s, d = row["summary"], row["summary"]["differential"]
        assert s["requests"] == 12 and s["errors"] == 0, (row["name"], s)
        # Every answer was replayed alone on the reference and matched it token for token.
        assert d["compared"] == 12 and d["corrupted"] == 0 and d["reference_errors"] == 0, (row["name"], d)
        # Turn 1 of each session forces a call: every call not cut short by max_tokens parsed
        # and matched its tool's schema.
        assert d["tool_calls_expected"] + d["tool_calls_truncated"] == 6, (row["name"], d)
        assert d["tool_calls_valid"] == d["tool_calls_expected"], (row["name"], d)
        assert row["leaked"] is None, (row["name"], row["leaked"])
        assert row["fault"] is None
        # The configuration is what it says: PD rows moved prompts through rooms, unified
        # ones did not; without the mirror no prompt token came from the host tier.
        src = row["prompt_sources"]
        assert (src.get("transferred", 0) > 0) == row["name"].endswith("-pd"), (row["name"], src)
        if "nomirror" in row["name"]:
            assert src.get("host", 0) == 0, (row["name"], src)
        assert 0 < s["ttft"]["p50"] <= s["ttft"]["max"] and s["output_tokens_per_s"] > 0, s
        # Each configuration's own report.
        cell = out / row["name"]
        rep = json.loads((cell / "report.json").read_text())
        assert [x["label"] for x in rep] == [row["name"]] and rep[0]["levels"][0] == s
        png_ok(cell / "ttft.png")
        assert (cell / "mesh.log").stat().st_size > 0
    # SmolLM2 calls (about 33 tokens) complete within 40: validity is measured.
    smol = [row for row in m["rows"] if row["name"].startswith("smol")]
    assert all(row["summary"]["differential"]["tool_calls_expected"] > 0 for row in smol)
    # The caches were used where they exist (the sessions share a system prompt).
    cached = {row["name"]: row["summary"]["cached_share"] for row in m["rows"]}
    assert cached["smol-mirror-pd"] > 0.2 and cached["dsa-bf16-mirror-unified"] > 0.2, cached

    # The table, in the seed's terms: one line per configuration.
    md = (out / "matrix.md").read_text()
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len(lines) == 1 + 8, md
    assert "corruption" in lines[0] and "tool calls valid" in lines[0] and "TTFT p50" in lines[0]
    assert sum("| 0/12 | 0.0% |" in ln for ln in lines) == 8, md
    assert md in r.stdout, "the table is printed too"
    # All configurations side by side: the table, and a labelled bar for each in each chart.
    charts_name_every_configuration(out, m["rows"])
    assert "<table id=\"results\">" in (out / "index.html").read_text()
    # The reference mesh ran once per model and index-K form, and each configuration's
    # mesh was stopped with nothing left behind (stop_up-like: `up` exited 0 on SIGTERM).
    assert sorted(p.name for p in out.iterdir() if p.name.endswith("-reference")) == [
        "dsa-bf16-mirror-pd-reference", "smol-mirror-pd-reference"]


def test_the_seeds_bug_forced_on_shows_as_corruption_and_fails_the_matrix(tmp_path):
    out = tmp_path / "matrix"
    r = matrix(out, "--dsa-model", str(tmp_path / "dsa-tiny"), "--models", "dsa", "--index-k", "bf16",
               "--mirror", "on", "--mode", "pd,unified", "--fault", "missize-index-k-unchecked")
    assert r.returncode != 0, r.stdout + r.stderr[-4000:]
    assert "differ from their reference" in r.stderr, r.stderr[-4000:]
    rows = {row["name"]: row for row in json.loads((out / "matrix.json").read_text())["rows"]}
    assert rows.keys() == {"dsa-bf16-mirror-pd", "dsa-bf16-mirror-unified"}
    pd = rows["dsa-bf16-mirror-pd"]["summary"]["differential"]
    # The mis-sized copy happens in the hand-over: only the disaggregated mesh corrupts.
    assert pd["corrupted"] > 0, pd
    assert rows["dsa-bf16-mirror-unified"]["summary"]["differential"]["corrupted"] == 0
    assert all(row["fault"] == "missize-index-k-unchecked" for row in rows.values())
    md = (out / "matrix.md").read_text()
    assert "(fault injected)" in md
    charts_name_every_configuration(out, list(rows.values()))


def test_bad_matrix_arguments_are_clear_errors(tmp_path):
    r = matrix(tmp_path / "m", "--mode", "sideways")
    assert r.returncode == 2 and "sideways" in r.stderr, r.stderr
    r = matrix(tmp_path / "m", "--dsa-model", str(tmp_path / "nope"), "--models", "dsa", "--pdmesh", str(tmp_path / "no-such-binary"))
    assert r.returncode == 1 and "no-such-binary" in r.stderr, r.stderr
