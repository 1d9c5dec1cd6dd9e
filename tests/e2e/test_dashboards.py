"""The Grafana dashboards (dashboards/) and Prometheus alert rules (deploy/prometheus/rules/)
against the code and a real scrape: the committed JSON is what dashboards/generate.py
writes; the gateway's /metrics passes `promtool check metrics`; every metric a panel or a
rule queries exists in the scrape; the rules pass `promtool check rules` and their unit
tests; every expression is valid PromQL.

promtool comes from $PROMTOOL, else `promtool` on PATH, else target/tools/promtool (which
tests/run-all fetches from the Debian package `prometheus`). Without it these tests fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from conftest import REPO, http

DASHBOARDS = REPO / "dashboards"
GENERATE = DASHBOARDS / "generate.py"
RULES_DIR = REPO / "deploy" / "prometheus" / "rules"
RULES = RULES_DIR / "pdmesh.rules.yml"
RULE_TESTS = RULES_DIR / "pdmesh.rules.test.yml"
METRICS_RS = REPO / "services" / "gateway" / "src" / "metrics.rs"
DASHBOARD_FILES = ["overview.json", "latency.json", "cache-tiers.json", "transfers.json", "wedges.json"]

# Labelled families the gateway creates only when their first label value is seen: the
# Rust prometheus crate writes no `# HELP`/`# TYPE` for a vector without children, so a
# healthy mesh's scrape lacks them until the first such event, which a plain e2e run
# cannot cause without injecting faults (tests/e2e/test_pd.py does). Each must still be
# registered in metrics.rs with this label. Family -> its label.
LAZY_FAMILIES = {
    # The worker reports a failure reason only after its first failed transfer.
    "mesh_kv_transfer_failures_total": "reason",
    # The cache service reports a stage only after its first room timeout.
    "mesh_room_timeouts_total": "stage",
    # ... and a reason only after its first room abort.
    "mesh_room_aborts_total": "reason",
}

# Lint problems `promtool check metrics` reports today that only a change to the Rust
# metric names can fix. Each entry must still be reported (so it is removed once fixed).
# Lint findings accepted on purpose (none today): each must still be reported, or the
# entry goes.
KNOWN_LINT: set[str] = set()

# Grafana's range variables, as promtool sees them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}
# Labels Prometheus adds at scrape, and the histogram bucket label.
SCRAPE_LABELS = {"instance", "job", "le"}
METRIC = re.compile(r"\bmesh_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def promtool() -> str:
    """The promtool to run; fails (never skips) the test without one."""
    env = os.environ.get("PROMTOOL")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            pytest.fail(f"PROMTOOL={env} is not an executable file", pytrace=False)
        return env
    found = shutil.which("promtool")
    if found:
        return found
    local = REPO / "target" / "tools" / "promtool"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    pytest.fail(
        "promtool not found: set $PROMTOOL, put promtool on PATH, or let tests/run-all fetch it "
        "into target/tools/promtool (Debian package `prometheus`: apt-get download prometheus && "
        "dpkg -x prometheus_*.deb DIR; the binary is DIR/usr/bin/promtool)",
        pytrace=False,
    )


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], input=stdin, capture_output=True, text=True, timeout=120)


def generator():
    spec = importlib.util.spec_from_file_location("pdmesh_dashboards_generate", GENERATE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dashboard_exprs() -> list[tuple[str, str, str, str]]:
    """(file, panel title, legend, expr) of every query in the committed dashboards."""
    out = []
    for name in DASHBOARD_FILES:
        board = json.loads((DASHBOARDS / name).read_text())
        for panel in board["panels"]:
            for t in panel.get("targets", []):
                out.append((name, panel["title"], t.get("legendFormat", ""), t["expr"]))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    """(alert name, expr) of every rule, read without a YAML library: the rules file keeps
    each `expr` a block scalar (or a plain one-line value)."""
    lines = RULES.read_text().splitlines()
    out, name, i = [], "?", 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"\s*-\s*(?:alert|record):\s*(\S+)", line):
            name = m.group(1)
        if m := re.match(r"(\s*)expr:\s*(.*)$", line):
            indent, value = len(m.group(1)), m.group(2).strip()
            if value in ("|", "|-", ">", ">-"):
                body = []
                while i + 1 < len(lines) and (
                    not lines[i + 1].strip() or len(lines[i + 1]) - len(lines[i + 1].lstrip()) > indent
                ):
                    i += 1
                    body.append(lines[i].strip())
                value = " ".join(b for b in body if b)
            out.append((name, value.strip("'\"")))
        i += 1
    assert out, f"no rule expressions found in {RULES}"
    return out


def all_exprs() -> list[tuple[str, str, str]]:
    """(where, legend, expr) of every dashboard query and rule."""
    return [(f"{f}: {title}", legend, e) for f, title, legend, e in dashboard_exprs()] + [
        (f"{RULES.name}: {name}", "", e) for name, e in rule_exprs()
    ]


def as_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


# --- without a mesh -----------------------------------------------------------------------

def test_committed_dashboards_are_what_the_generator_writes():
    r = subprocess.run([sys.executable, str(GENERATE), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"dashboards/generate.py --check:\n{r.stdout}{r.stderr}"


def test_dashboards_use_the_fixed_datasource_uids_and_refresh():
    assert sorted(generator().DASHBOARDS) == sorted(DASHBOARD_FILES)
    uids = set()
    for name in DASHBOARD_FILES:
        board = json.loads((DASHBOARDS / name).read_text())
        assert board["refresh"] == "5s", name
        uids.add(board["uid"])
        for panel in board["panels"]:
            if panel["type"] == "text":
                continue
            assert panel["datasource"]["uid"] == "pdmesh-prometheus", (name, panel["title"])
            assert panel["fieldConfig"]["defaults"]["unit"], (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for t in panel["targets"]:
                assert t["datasource"]["uid"] == "pdmesh-prometheus", (name, panel["title"])
    assert len(uids) == len(DASHBOARD_FILES), "dashboard uids must be distinct"
    wedges = json.loads((DASHBOARDS / "wedges.json").read_text())
    links = [l["url"] for p in wedges["panels"] for l in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]
    assert any("pdmesh-tempo" in u and "${__field.labels.state}" in u for u in links), links


def test_rules_pass_promtool_check_and_their_unit_tests():
    r = run_promtool("check", "rules", str(RULES))
    assert r.returncode == 0, f"promtool check rules:\n{r.stdout}{r.stderr}"
    # Unit tests name their rule files relative to themselves.
    r = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=RULES_DIR,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"promtool test rules:\n{r.stdout}{r.stderr}"


def test_room_deadline_alert_matches_the_dashboard_deadlines():
    text = RULES.read_text()
    for state, seconds in generator().ROOM_DEADLINES_S.items():
        want = f'mesh_room_oldest_seconds{{state="{state}"}} > {seconds}'
        assert want in text, f"{RULES.name} lacks `{want}` (dashboards/generate.py ROOM_DEADLINES_S)"


def test_every_dashboard_and_rule_expression_is_valid_promql(tmp_path):
    exprs = all_exprs()
    rules = []
    for i, (where, _, expr) in enumerate(exprs):
        promql = as_promql(expr)
        assert "$" not in promql, f"{where}: a Grafana variable promtool cannot read: {expr}"
        rules.append({"record": f"pdmesh_check:expr_{i}", "expr": promql})
    # JSON is YAML.
    path = tmp_path / "exprs.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboards_and_rules", "rules": rules}]}, indent=1))
    r = run_promtool("check", "rules", str(path))
    index = "\n".join(f"  expr_{i}: {where}: {e}" for i, (where, _, e) in enumerate(exprs))
    assert r.returncode == 0, f"promtool check rules on every expression:\n{r.stdout}{r.stderr}\n{index}"


# --- against a real scrape -----------------------------------------------------------------

@pytest.fixture(scope="module")
def scrape(mesh) -> str:
    """/metrics after real traffic: chat and completions, a stream, an error, and an
    output whose tool-call markup fails to parse."""
    client = mesh.client()
    ask = [{"role": "user", "content": "Name a colour."}]
    client.chat.completions.create(model=mesh.model, messages=ask, max_tokens=8, temperature=0)
    client.completions.create(model=mesh.model, prompt="The sky is", max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=mesh.model, messages=ask, max_tokens=8, stream=True))
    assert chunks
    status, _ = http("GET", mesh.base + "/no-such-route")
    assert status == 404
    # As tests/e2e/test_tools.py: the grammar makes the model write a tool-call block that
    # never closes, so the parser fails the request and counts it.
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    schema = {"type": "string", "const": '<tool_call>\n{"name": "get_weather", oops'}
    with pytest.raises(openai.APIError):
        client.chat.completions.create(
            model=mesh.model, messages=ask, max_tokens=80, temperature=0, tools=[weather],
            response_format={"type": "json_schema", "json_schema": {"name": "leak", "schema": schema}},
        )
    status, body = http("GET", mesh.base + "/metrics")
    assert status == 200, body
    return body.decode()


def families(text: str) -> dict[str, str]:
    """{family: type} from the `# TYPE` lines."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def samples(text: str) -> dict[str, set[str]]:
    """{sample name: label names seen on it}."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
        assert m, f"unparsable sample line: {line!r}"
        out.setdefault(m.group(1), set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
    return out


def test_the_scrape_passes_promtool_check_metrics(scrape):
    r = run_promtool("check", "metrics", stdin=scrape)
    problems = {l.strip() for l in (r.stdout + r.stderr).splitlines() if l.strip()}
    unknown = problems - KNOWN_LINT
    assert not unknown, f"promtool check metrics (exit {r.returncode}):\n" + "\n".join(sorted(problems))
    # Exit 3 is lint problems only; anything else (1: unparsable) is a failure.
    assert r.returncode in ((0,) if not problems else (3,)), f"promtool check metrics exit {r.returncode}:\n{problems}"
    fixed = KNOWN_LINT - problems
    assert not fixed, f"no longer reported, remove from KNOWN_LINT: {fixed}"


def test_every_queried_metric_and_label_exists_in_the_scrape(scrape):
    types, seen = families(scrape), samples(scrape)
    source = METRICS_RS.read_text()
    registered_label = dict(re.findall(r'"(mesh_[a-z0-9_]+)",\s*"[^"]*",\s*"([a-z_]+)"', source))

    def labels_of(name: str) -> set[str] | None:
        """The label names a queried metric carries, or None if it is not exported."""
        if name in seen:
            return seen[name] | SCRAPE_LABELS
        for suffix in HISTOGRAM_SUFFIXES:
            base = name[: -len(suffix)]
            if name.endswith(suffix) and types.get(base) == "histogram":
                return set().union(*(v for k, v in seen.items() if k.startswith(base))) | SCRAPE_LABELS
        if name in types:  # a family with no sample yet
            return None if types[name] == "histogram" else SCRAPE_LABELS
        if name in LAZY_FAMILIES:
            assert f'"{name}"' in source, f"{name} is listed as lazy but not defined in metrics.rs"
            assert registered_label.get(name) == LAZY_FAMILIES[name], (name, registered_label.get(name))
            return {LAZY_FAMILIES[name]} | SCRAPE_LABELS
        return None

    missing, bad_labels = [], []
    for where, legend, expr in all_exprs():
        names = set(METRIC.findall(expr))
        assert names, f"{where}: queries no mesh_ metric: {expr}"
        carried: set[str] = set()
        for name in sorted(names):
            labels = labels_of(name)
            if labels is None:
                missing.append(f"{where}: {name}")
                continue
            carried |= labels
            # Selectors name labels of their own metric.
            for sel in re.findall(rf"\b{name}\{{([^}}]*)\}}", expr):
                for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", sel):
                    if label not in labels:
                        bad_labels.append(f"{where}: {name} has no label {label}")
        # Grouping and legends name labels some queried metric carries.
        grouped = [l.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for l in g.split(",")]
        for label in [l for l in grouped if l] + re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
            if label not in carried:
                bad_labels.append(f"{where}: no queried metric has label {label}")
    assert not (missing or bad_labels), (
        "metrics queried but absent from the scrape:\n" + "\n".join(missing)
        + "\nlabels queried but absent:\n" + "\n".join(bad_labels)
    )
