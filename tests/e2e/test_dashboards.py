"""The Grafana dashboards (dashboards/) and Prometheus alert rules (deploy/prometheus/rules/)
against the code and a real scrape: the committed JSON is what dashboards/generate.py
writes; the gateway's /metrics passes `promtool check metrics`; every series a panel or a
rule selects exists in the first scrape of a mesh that has answered no request yet (a
labelled counter is there at 0 before its first event, so `increase(...) > 0` sees that
event); the rules pass `promtool check rules` and their unit tests; every expression is
valid PromQL.

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

from conftest import REPO, http, start_up, stop_up

DASHBOARDS = REPO / "dashboards"
GENERATE = DASHBOARDS / "generate.py"
RULES_DIR = REPO / "deploy" / "prometheus" / "rules"
RULES = RULES_DIR / "pdmesh.rules.yml"
RULE_TESTS = RULES_DIR / "pdmesh.rules.test.yml"
# The gateway's metric registry: its module's files, their unit tests aside.
METRICS_DIR = REPO / "services" / "gateway" / "src" / "metrics"
DASHBOARD_FILES = ["overview.json", "latency.json", "cache-tiers.json", "transfers.json", "wedges.json"]

# Labelled counters whose every series must be in a fresh scrape at 0: family -> its
# label names. Their label sets are closed (error classes, failure reasons, parsers, room
# states), so the gateway creates each series when it starts.
ZERO_AT_START = {
    "mesh_errors_total": {"error_type"},
    "mesh_kv_transfer_failures_total": {"reason"},
    "mesh_room_aborts_total": {"reason"},
    "mesh_room_timeouts_total": {"stage"},
    "mesh_tool_call_parse_failures_total": {"parser", "reason"},
    "mesh_incidents_total": {"kind"},
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
        for a in board["annotations"]["list"]:
            out.append((name, f'annotation "{a["name"]}"', "", a["expr"]))
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


# Words of PromQL that are never metric names: aggregation operators (which may be followed
# by `by (...)` instead of their parenthesis), keywords and the float literals.
PROMQL_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}
PROMQL_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
PROMQL_WORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan"}
PROMQL_TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      | (?P<range>\[[^\]]*\])
      | (?P<number>\.?[0-9][\w.]*)
      | (?P<ident>[a-zA-Z_:][\w:]*)
      | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>,@(){}])
      | (?P<space>\s+)""",
    re.X,
)


def promql_tokens(expr: str) -> list[tuple[str, str]]:
    """(kind, text) of every token but blanks; fails on anything PromQL cannot hold."""
    out, pos = [], 0
    while pos < len(expr):
        m = PROMQL_TOKEN.match(expr, pos)
        assert m, f"cannot read PromQL at {expr[pos:]!r} in {expr!r}"
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def unquote(s: str) -> str:
    """A PromQL string literal's value."""
    if s[0] == "`":
        return s[1:-1]
    body = s[1:-1]
    if s[0] == "'":
        body = body.replace("\\'", "'").replace('"', '\\"')
    return json.loads('"' + body + '"')


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Every vector selector of a PromQL expression: (metric name, [(label, op, value)]).
    Names come from identifiers that are not functions, aggregations, keywords or label
    lists of `by`/`without`/`on`/`ignoring`/`group_*`, or from a `__name__` matcher;
    strings, ranges and numbers are skipped whole."""
    toks = promql_tokens(as_promql(expr))

    def matchers(i: int) -> tuple[list[tuple[str, str, str]], int]:
        assert toks[i][1] == "{"
        out, i = [], i + 1
        while toks[i][1] != "}":
            (k1, label), (k2, op), (k3, value) = toks[i : i + 3]
            assert k1 == "ident" and op in ("=", "!=", "=~", "!~") and k3 == "string", (expr, toks[i : i + 3])
            out.append((label, op, unquote(value)))
            i += 3
            if toks[i][1] == ",":
                i += 1
        return out, i + 1

    out, i = [], 0
    while i < len(toks):
        kind, text = toks[i]
        after = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "ident" and text in PROMQL_LABEL_LISTS:
            i += 1
            if after == "(":
                while toks[i][1] != ")":
                    i += 1
                i += 1
        elif kind == "ident" and (after == "(" or text in PROMQL_AGGREGATIONS or text in PROMQL_WORDS):
            i += 1
        elif kind == "ident":
            found, i = [], i + 1
            if after == "{":
                found, i = matchers(i)
            out.append((text, found))
        elif text == "{":
            found, i = matchers(i)
            names = [v for label, op, v in found if label == "__name__" and op == "="]
            assert names, f"a selector without a metric name in {expr!r}"
            out.append((names[0], [m for m in found if m[0] != "__name__"]))
        else:
            i += 1
    return out


def rule_names() -> set[str]:
    """Series the rules file records (a query may select them instead of a mesh_ metric)."""
    return set(re.findall(r"^\s*-\s*record:\s*(\S+)", RULES.read_text(), re.M))


# --- without a mesh -----------------------------------------------------------------------

def test_the_promql_reader_finds_every_selector_and_nothing_else():
    got = selectors(
        'histogram_quantile(0.99, sum by (le, endpoint) (rate(mesh_a_bucket{endpoint=~"x|y", le!="+Inf"}'
        '[$__rate_interval]))) / on(instance) group_left(job) sum without (tier) (mesh_b offset 5m)'
        ' > bool 1e3 or {__name__="mesh_c", side=\'all\'} unless count(mesh_d[5m:1m] @ end())'
        ' or vector(0) + max_over_time(mesh_e{reason="a,b}"}[1h])'
    )
    assert got == [
        ("mesh_a_bucket", [("endpoint", "=~", "x|y"), ("le", "!=", "+Inf")]),
        ("mesh_b", []),
        ("mesh_c", [("side", "=", "all")]),
        ("mesh_d", []),
        ("mesh_e", [("reason", "=", "a,b}")]),
    ], got

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
    # Incident reports: marks on every panel where one was filed, and a table by kind.
    [incidents] = wedges["annotations"]["list"]
    assert incidents["datasource"]["uid"] == "pdmesh-prometheus" and incidents["enable"], incidents
    assert "mesh_incidents_total" in incidents["expr"] and incidents["tagKeys"] == "kind", incidents
    [table] = [p for p in wedges["panels"] if p["type"] == "table"]
    assert [t["expr"] for t in table["targets"]] == ["sum by (kind) (increase(mesh_incidents_total[$__range])) > 0"]
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"]), table["targets"]


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
def fresh_mesh(tmp_path_factory):
    """A mesh of this module's own, started without `pdmesh up`'s smoke test, so its first
    scrape comes before any API request."""
    m = start_up(tmp_path_factory.mktemp("dashboards"), ["--no-smoke-test"])
    yield m
    code = stop_up(m)
    assert code == 0, f"pdmesh up exited with {code} on SIGTERM:\n{m.log()}"


@pytest.fixture(scope="module")
def fresh_scrape(fresh_mesh) -> str:
    """The first /metrics of `fresh_mesh`: only health checks came before it."""
    status, body = http("GET", fresh_mesh.base + "/metrics")
    assert status == 200, body
    return body.decode()


@pytest.fixture(scope="module")
def scrape(fresh_mesh, fresh_scrape) -> str:
    """/metrics after real traffic (on the same mesh, after `fresh_scrape`): chat and
    completions, a stream, an error, and an output whose tool-call markup fails to parse."""
    mesh = fresh_mesh
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


def series(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample line."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$", line)
        assert m, f"unparsable sample line: {line!r}"
        pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")
        out.append((m.group(1), {k: json.loads(f'"{v}"') for k, v in pairs}, float(m.group(3))))
    return out


def samples(text: str) -> dict[str, set[str]]:
    """{sample name: label names seen on it}."""
    out: dict[str, set[str]] = {}
    for name, labels, _ in series(text):
        out.setdefault(name, set()).update(labels)
    return out


def selects(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    """Whether a series with `labels` matches every matcher (PromQL regexes are anchored)."""
    for label, op, want in matchers:
        have = labels.get(label, "")
        if op in ("=", "!="):
            ok = (have == want) == (op == "=")
        else:
            ok = (re.fullmatch(want, have) is not None) == (op == "=~")
        if not ok:
            return False
    return True


@pytest.mark.parametrize("which", ["fresh_scrape", "scrape"])
def test_the_scrape_passes_promtool_check_metrics(which, request):
    text = request.getfixturevalue(which)
    r = run_promtool("check", "metrics", stdin=text)
    problems = {l.strip() for l in (r.stdout + r.stderr).splitlines() if l.strip()}
    unknown = problems - KNOWN_LINT
    assert not unknown, f"promtool check metrics (exit {r.returncode}):\n" + "\n".join(sorted(problems))
    # Exit 3 is lint problems only; anything else (1: unparsable) is a failure.
    assert r.returncode in ((0,) if not problems else (3,)), f"promtool check metrics exit {r.returncode}:\n{problems}"
    fixed = KNOWN_LINT - problems
    assert not fixed, f"no longer reported, remove from KNOWN_LINT: {fixed}"


def test_every_queried_series_and_label_exists_in_a_fresh_scrape(fresh_scrape):
    """Before any request, each selector of each panel and rule selects a series (so no
    panel shows "No data" and no `increase(...)` misses a first event), and every label a
    query groups by or a legend shows is carried by a metric the query selects."""
    have, seen, recorded = series(fresh_scrape), samples(fresh_scrape), rule_names()
    missing, bad_labels = [], []
    for where, legend, expr in all_exprs():
        found = selectors(expr)
        assert found, f"{where}: selects no series: {expr}"
        carried = set(SCRAPE_LABELS)
        for name, matchers in found:
            if name in recorded:
                continue
            if not name.startswith("mesh_"):
                missing.append(f"{where}: {name} is no pdmesh metric")
                continue
            if name not in seen:
                missing.append(f"{where}: {name}")
                continue
            carried |= seen[name]
            for label, _, _ in matchers:
                if label not in seen[name] | SCRAPE_LABELS:
                    bad_labels.append(f"{where}: {name} has no label {label}")
            # Prometheus adds `instance` and `job` at scrape; the rest must match as scraped.
            own = [m for m in matchers if m[0] not in ("instance", "job")]
            if not any(selects(labels, own) for n, labels, _ in have if n == name):
                shown = ", ".join(f"{l}{op}{v!r}" for l, op, v in own)
                missing.append(f"{where}: {name}{{{shown}}}")
        # Grouping and legends name labels some queried metric carries.
        grouped = [l.strip() for g in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for l in g.split(",")]
        for label in [l for l in grouped if l] + re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
            if label not in carried:
                bad_labels.append(f"{where}: no queried metric has label {label}")
    assert not (missing or bad_labels), (
        "series queried but absent from a fresh scrape:\n" + "\n".join(sorted(set(missing)))
        + "\nlabels queried but absent:\n" + "\n".join(sorted(set(bad_labels)))
    )


def test_closed_label_sets_exist_at_zero_before_their_first_event(fresh_scrape, scrape):
    """The labelled counters of closed sets have their series at 0 in a fresh scrape, and
    traffic (an error, a failed tool-call parse, ...) creates no series that was not
    already there: a counter's first event is an increase from 0, not a new series."""
    fresh = series(fresh_scrape)
    for family, label_names in ZERO_AT_START.items():
        got = [(labels, v) for name, labels, v in fresh if name == family]
        assert got, f"{family} has no series in a fresh scrape"
        for labels, value in got:
            assert set(labels) == label_names and value == 0, (family, labels, value)
    before = {(name, tuple(sorted(labels.items()))) for name, labels, _ in fresh}
    after = {(name, tuple(sorted(labels.items()))) for name, labels, _ in series(scrape)}
    new = sorted(f"{name}{dict(labels)}" for name, labels in after - before)
    assert not new, "series that appeared only after their first event:\n" + "\n".join(new)
    # The traffic did count its error and its parse failure, on those series.
    counted = {name for name, _, v in series(scrape) if v > 0}
    assert {"mesh_errors_total", "mesh_tool_call_parse_failures_total"} <= counted, counted


def test_every_registered_family_has_a_series_in_a_fresh_scrape(fresh_scrape):
    """No metric the gateway defines waits for an event to appear."""
    files = sorted(p for p in METRICS_DIR.glob("*.rs") if p.name != "tests.rs")
    assert files, METRICS_DIR
    source = "\n".join(re.split(r"#\[cfg\(test\)\]\s*mod tests", p.read_text())[0] for p in files)
    defined = set(re.findall(r'"(mesh_[a-z0-9_]+)"', source))
    assert len(defined) > 30, defined
    seen = samples(fresh_scrape)
    absent = sorted(
        name for name in defined if not any(name + suffix in seen for suffix in ("", *HISTOGRAM_SUFFIXES))
    )
    assert not absent, "defined in the gateway's metrics but without a series in a fresh scrape:\n" + "\n".join(absent)
