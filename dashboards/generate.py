#!/usr/bin/env python3
"""The pdmesh Grafana dashboards, defined in code and written as JSON next to this file.

    python3 dashboards/generate.py           # (re)write dashboards/*.json
    python3 dashboards/generate.py --check   # exit 1 if a committed JSON differs

Standard library only. The output is byte-stable: the same code always writes the same
bytes, so CI can fail on a hand edit (`--check`). Panels query only metrics the gateway
exports today (services/gateway/src/metrics.rs); tests/e2e/test_dashboards.py checks every
name against a real scrape and every expression with `promtool`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROMETHEUS = {"type": "prometheus", "uid": "pdmesh-prometheus"}
TEMPO = {"type": "tempo", "uid": "pdmesh-tempo"}
REFRESH = "5s"
TAG = "pdmesh"
# Grafana's per-panel window for rate(): at least four scrape intervals.
RATE = "$__rate_interval"
# Rare events (failures, timeouts) read better as counts per fixed window.
WINDOW = "5m"

# The cache service's default room deadlines by state (services/cache/src/lib.rs,
# --room-*-ms). A room older than its deadline should already have been failed, so one
# that stays older means the deadline sweeper itself is wedged.
# deploy/prometheus/rules/pdmesh.rules.yml alerts on the same numbers (the e2e test
# checks they agree).
ROOM_DEADLINES_S = {
    "bootstrapping": 60,
    "waiting_for_input": 120,
    "transferring": 30,
    "success": 30,
}

# The span attribute the Tempo links search on. No span carries it yet (tracing arrives
# with the observability work); the links are templates for when one does.
TRACE_ROOM_STATE_ATTR = "pdmesh.room.state"


# --- helpers -----------------------------------------------------------------------------

def target(expr: str, legend: str = "", instant: bool = False) -> dict:
    """One Prometheus query (its refId is set by the panel)."""
    return {
        "datasource": PROMETHEUS,
        "editorMode": "code",
        "expr": expr,
        "instant": instant,
        "legendFormat": legend or "__auto",
        "range": not instant,
    }


def thresholds(*steps: tuple) -> dict:
    """Absolute thresholds from (value, color) pairs; the first step has no value."""
    out = [{"color": "green", "value": None}]
    out += [{"color": color, "value": value} for value, color in steps]
    return {"mode": "absolute", "steps": out}


def _panel(kind: str, title: str, description: str, targets: list, unit: str,
           w: int, h: int) -> dict:
    refs = [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": PROMETHEUS,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "targets": refs,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }


def timeseries(title: str, description: str, targets: list, unit: str, *,
               stack: bool = False, steps: tuple = (), min0: bool = True,
               overrides: list | None = None, links: list | None = None,
               w: int = 12, h: int = 8) -> dict:
    p = _panel("timeseries", title, description, targets, unit, w, h)
    defaults = p["fieldConfig"]["defaults"]
    defaults["custom"] = {
        "drawStyle": "line",
        "fillOpacity": 20 if stack else 5,
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stack else "none"},
        "thresholdsStyle": {"mode": "line" if steps else "off"},
    }
    if min0:
        defaults["min"] = 0
    defaults["thresholds"] = thresholds(*steps)
    defaults["color"] = {"mode": "palette-classic"}
    if links:
        defaults["links"] = links
    p["fieldConfig"]["overrides"] = overrides or []
    p["options"] = {
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return p


def _reduce() -> dict:
    return {"calcs": ["lastNotNull"], "fields": "", "values": False}


def stat(title: str, description: str, targets: list, unit: str, *, steps: tuple = (),
         mappings: list | None = None, w: int = 6, h: int = 4) -> dict:
    p = _panel("stat", title, description, targets, unit, w, h)
    defaults = p["fieldConfig"]["defaults"]
    defaults["thresholds"] = thresholds(*steps)
    defaults["color"] = {"mode": "thresholds"}
    defaults["mappings"] = mappings or []
    p["options"] = {
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": _reduce(),
        "textMode": "auto",
    }
    return p


def bargauge(title: str, description: str, targets: list, unit: str, *,
             w: int = 12, h: int = 8) -> dict:
    p = _panel("bargauge", title, description,
               [dict(t, instant=True, range=False) for t in targets], unit, w, h)
    defaults = p["fieldConfig"]["defaults"]
    defaults["min"] = 0
    defaults["thresholds"] = thresholds()
    defaults["color"] = {"mode": "continuous-BlPu"}
    p["options"] = {
        "displayMode": "gradient",
        "orientation": "horizontal",
        "reduceOptions": _reduce(),
        "showUnfilled": True,
        "valueMode": "color",
    }
    return p


def text(title: str, content: str, *, w: int = 24, h: int = 4) -> dict:
    return {
        "type": "text",
        "title": title,
        "gridPos": {"h": h, "w": w, "x": 0, "y": 0},
        "options": {"content": content, "mode": "markdown"},
    }


def override(ref_id: str, *properties: tuple) -> dict:
    """Field settings, from (id, value) pairs, for the series of one query."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref_id},
        "properties": [{"id": k, "value": v} for k, v in properties],
    }


def right_axis(*ref_ids: str, unit: str = "short") -> list:
    """Overrides that put these queries' series on the right axis, in `unit`."""
    return [override(ref, ("custom.axisPlacement", "right"), ("unit", unit)) for ref in ref_ids]


def tempo_explore_url(traceql: str) -> str:
    """A Grafana Explore URL that runs `traceql` on the Tempo datasource over the
    dashboard's time range. Grafana placeholders (`${...}`) stay unencoded so Grafana
    fills them in when the link is followed."""
    panes = {
        "tempo": {
            "datasource": TEMPO["uid"],
            "queries": [
                {
                    "datasource": TEMPO,
                    "limit": 20,
                    "query": traceql,
                    "queryType": "traceql",
                    "refId": "A",
                }
            ],
            "range": {"from": "${__from}", "to": "${__to}"},
        }
    }
    raw = json.dumps(panes, separators=(",", ":"))
    # Encode everything but the placeholders.
    out, rest = [], raw
    while "${" in rest:
        head, _, tail = rest.partition("${")
        var, _, rest = tail.partition("}")
        out += [urllib.parse.quote(head, safe=""), "${" + var + "}"]
    out.append(urllib.parse.quote(rest, safe=""))
    return "/explore?schemaVersion=1&orgId=1&panes=" + "".join(out)


def dashboard(uid: str, title: str, description: str, panels: list) -> dict:
    """A dashboard; panels flow left to right in rows of 24 columns."""
    x = y = row_h = 0
    placed = []
    for i, p in enumerate(panels, start=1):
        pos = p["gridPos"]
        if x + pos["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        placed.append(dict(p, id=i, gridPos=dict(pos, x=x, y=y)))
        x += pos["w"]
        row_h = max(row_h, pos["h"])
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "editable": True,
        "graphTooltip": 1,
        "refresh": REFRESH,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {"list": []},
        "links": [
            {
                "asDropdown": False,
                "includeVars": False,
                "keepTime": True,
                "tags": [TAG],
                "targetBlank": False,
                "title": "pdmesh",
                "type": "dashboards",
            }
        ],
        "panels": placed,
    }


def rate(metric: str, by: str = "", window: str = RATE) -> str:
    """`sum [by (...)] (rate(metric[window]))`."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}[{window}]))"


def increase(metric: str, by: str = "", window: str = WINDOW) -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (increase({metric}[{window}]))"


def quantile(q: float, histogram: str, by: str = "", selector: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return (f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({histogram}_bucket{selector}[{RATE}])))")


# --- dashboards --------------------------------------------------------------------------

API = '{endpoint=~"chat_completions|completions"}'


def overview() -> dict:
    return dashboard("pdmesh-overview", "pdmesh / Overview",
                     "Traffic, errors, tokens and the KV pool of one pdmesh gateway.", [
        stat("Request rate", "HTTP requests answered per second, all endpoints.",
             [target(rate("mesh_requests_total"), "requests/s")], "reqps"),
        stat("Error rate", "Requests that ended in an error per second.",
             [target(f"sum(rate(mesh_errors_total[{RATE}])) or vector(0)", "errors/s")],
             "reqps", steps=((0.01, "red"),)),
        stat("Prompt cache-hit ratio (range)",
             "Prompt tokens served from the prefix cache over the shown range "
             "(mesh_cached_prompt_tokens_total / mesh_prompt_tokens_total).",
             [target("sum(increase(mesh_cached_prompt_tokens_total[$__range])) / "
                     "sum(increase(mesh_prompt_tokens_total[$__range]))", "hit ratio")],
             "percentunit"),
        stat("Workers read", "1: the last scrape read every worker's state; 0: a worker "
             "did not answer and the worker gauges are stale (mesh_workers_read).",
             [target("min(mesh_workers_read)", "workers read")], "none",
             steps=((1, "green"),),
             mappings=[{"type": "value", "options": {
                 "0": {"color": "red", "index": 0, "text": "stale"},
                 "1": {"color": "green", "index": 1, "text": "read"}}}]),
        timeseries("Requests by endpoint and status",
                   "mesh_requests_total, per second.",
                   [target(rate("mesh_requests_total", "endpoint, status"),
                           "{{endpoint}} {{status}}")], "reqps", stack=True),
        timeseries("Errors by type", "mesh_errors_total by error_type, per second.",
                   [target(rate("mesh_errors_total", "error_type"), "{{error_type}}")],
                   "reqps", stack=True),
        timeseries("Tokens per second", "Prompt tokens processed, of which served from the "
                   "prefix cache, and completion tokens generated.",
                   [target(rate("mesh_prompt_tokens_total"), "prompt"),
                    target(rate("mesh_cached_prompt_tokens_total"), "prompt, cached"),
                    target(rate("mesh_generated_tokens_total"), "generated")], "short"),
        timeseries("Prompt cache-hit ratio",
                   "mesh_cached_prompt_tokens_total / mesh_prompt_tokens_total, per rate window.",
                   [target(f"{rate('mesh_cached_prompt_tokens_total')} / "
                           f"{rate('mesh_prompt_tokens_total')}", "hit ratio")],
                   "percentunit"),
        timeseries("KV pages in use vs total",
                   "The worker's KV pool, read at scrape: pages held by requests "
                   "(total - free - cached), pages only the prefix cache holds (evictable), "
                   "and the pool size.",
                   [target("sum(mesh_kv_pages_total) - sum(mesh_kv_pages_free) - "
                           "sum(mesh_kv_pages_cached)", "held by requests"),
                    target("sum(mesh_kv_pages_cached)", "prefix cache (evictable)"),
                    target("sum(mesh_kv_pages_total)", "total")], "short",
                   stack=True,
                   overrides=[override(  # the pool size: a dashed line, not stacked
                       "C",
                       ("custom.stacking", {"group": "A", "mode": "none"}),
                       ("custom.fillOpacity", 0),
                       ("custom.lineStyle", {"dash": [10, 10], "fill": "dash"}))]),
        timeseries("Requests in the workers",
                   "mesh_worker_requests: waiting, reserved (decode, KV in flight), running.",
                   [target("sum by (state) (mesh_worker_requests)", "{{state}}")], "short",
                   stack=True),
        timeseries("Tool-call parse failures",
                   "Model outputs whose tool-call markup failed to parse (the request "
                   "failed), by parser and reason, per second.",
                   [target(rate("mesh_tool_call_parse_failures_total", "parser, reason"),
                           "{{parser}} {{reason}}")], "reqps", w=24),
    ])


def latency() -> dict:
    qs = (0.5, 0.9, 0.99)
    return dashboard("pdmesh-latency", "pdmesh / Latency",
                     "Time to first token, inter-token latency, request and stream durations "
                     "from the gateway's histograms.", [
        text("About these histograms",
             "`mesh_time_to_first_token_seconds` runs from a request's arrival to its first "
             "generated token reaching the gateway; `mesh_inter_token_latency_seconds` "
             "between consecutive tokens of one request. "
             "`mesh_request_duration_seconds` runs from the request to the response "
             "headers; for a stream that is **not** the time to first token. "
             "`mesh_stream_duration_seconds` runs to the end of an SSE stream.",
             h=3),
        timeseries("Time to first token p50 / p90 / p99",
                   "histogram_quantile over mesh_time_to_first_token_seconds_bucket.",
                   [target(quantile(q, "mesh_time_to_first_token_seconds"), f"p{round(q * 100)}")
                    for q in qs], "s"),
        timeseries("Inter-token latency p50 / p90 / p99",
                   "histogram_quantile over mesh_inter_token_latency_seconds_bucket.",
                   [target(quantile(q, "mesh_inter_token_latency_seconds"), f"p{round(q * 100)}")
                    for q in qs], "s"),
        timeseries("Request duration p50 / p90 / p99 (API endpoints)",
                   "histogram_quantile over mesh_request_duration_seconds_bucket, by endpoint.",
                   [target(quantile(q, "mesh_request_duration_seconds", "endpoint", API),
                           f"p{round(q * 100)} {{{{endpoint}}}}") for q in qs], "s", w=24),
        timeseries("Stream duration p50 / p90 / p99",
                   "histogram_quantile over mesh_stream_duration_seconds_bucket.",
                   [target(quantile(q, "mesh_stream_duration_seconds"), f"p{round(q * 100)}")
                    for q in qs], "s"),
        timeseries("Mean durations",
                   "_sum / _count of both histograms, per rate window.",
                   [target(f"{rate('mesh_request_duration_seconds_sum' + API, 'endpoint')} / "
                           f"{rate('mesh_request_duration_seconds_count' + API, 'endpoint')}",
                           "request {{endpoint}}"),
                    target(f"sum(rate(mesh_stream_duration_seconds_sum[{RATE}])) / "
                           f"sum(rate(mesh_stream_duration_seconds_count[{RATE}]))", "stream")],
                   "s"),
        timeseries("Requests timed, by endpoint",
                   "mesh_request_duration_seconds_count per second (every endpoint), and "
                   "streams finished per second.",
                   [target(rate("mesh_request_duration_seconds_count", "endpoint"), "{{endpoint}}"),
                    target(rate("mesh_stream_duration_seconds_count"), "streams")], "reqps", w=24),
    ])


def cache_tiers() -> dict:
    hit = "mesh_kv_cache_hit_tokens_total"
    return dashboard("pdmesh-cache-tiers", "pdmesh / Cache tiers",
                     "The device prefix cache, the host tier and the cache service's host "
                     "mirror.", [
        timeseries("Prompt tokens served from cache, by tier",
                   "mesh_kv_cache_hit_tokens_total: device = the worker's prefix cache, "
                   "host = loaded back from the host tier. Tokens per second.",
                   [target(rate(f'{hit}{{tier="device"}}'), "device"),
                    target(rate(f'{hit}{{tier="host"}}'), "host")], "short"),
        timeseries("Share of prompt tokens served from cache, by tier",
                   "Hit tokens per tier / prompt tokens processed.",
                   [target(f"{rate(hit, 'tier')} / scalar({rate('mesh_prompt_tokens_total')})",
                           "{{tier}}")], "percentunit"),
        timeseries("Host tier: load-back and write-back bytes/s",
                   "mesh_kv_cache_load_back_bytes_total (host tier -> device) and "
                   "mesh_kv_cache_write_back_bytes_total (device -> host tier).",
                   [target(rate("mesh_kv_cache_load_back_bytes_total"), "load-back"),
                    target(rate("mesh_kv_cache_write_back_bytes_total"), "write-back")],
                   "Bps"),
        timeseries("Host tier: load-back time and speed",
                   "Seconds spent loading back per second (checksums included), and the "
                   "average load-back speed (bytes / seconds). No write-back timing is "
                   "exported yet.",
                   [target(rate("mesh_kv_cache_load_back_seconds_total"), "load-back s/s"),
                    target(f"{rate('mesh_kv_cache_load_back_bytes_total')} / "
                           f"{rate('mesh_kv_cache_load_back_seconds_total')}",
                           "load-back speed")], "s",
                   overrides=right_axis("B", unit="Bps")),
        timeseries("Evictions, by tier",
                   "Cached KV pages evicted to make room, pages per second.",
                   [target(rate("mesh_kv_cache_evictions_total", "tier"), "{{tier}}")], "short"),
        timeseries(f"Checksum failures (per {WINDOW})",
                   "Host-tier pages that failed their checksum on load (recomputed, never "
                   "served), and pages the cache service refused at commit for a bad "
                   "checksum. Any is a bug or bad memory.",
                   [target(increase("mesh_kv_cache_checksum_failures_total", "tier"),
                           "load {{tier}}"),
                    target(increase("mesh_host_mirror_commit_rejections_total", "tier"),
                           "commit rejected {{tier}}")], "short", steps=((1, "red"),)),
        timeseries("Host mirror pages", "The cache service's host mirror by state "
                   "(total, used, pinned).",
                   [target("sum by (state) (mesh_host_mirror_pages)", "{{state}}")], "short"),
        timeseries("Host mirror leases",
                   f"Workers holding a live lease, and leases expired per {WINDOW} (workers "
                   "that stopped heartbeating).",
                   [target("sum(mesh_host_mirror_leases)", "live leases"),
                    target(increase("mesh_host_mirror_expired_leases_total"),
                           f"expired per {WINDOW}")], "short"),
        bargauge("Router's view: cached pages per prefill worker",
                 "mesh_router_cached_pages: pages each prefill worker's device cache holds, "
                 "as the gateway knows from its KV events.",
                 [target("sum by (worker) (mesh_router_cached_pages)", "{{worker}}")],
                 "short", w=24),
    ])


def transfers() -> dict:
    b, s = "mesh_kv_transfer_bytes_total", "mesh_kv_transfer_seconds_total"
    return dashboard("pdmesh-transfers", "pdmesh / Transfers",
                     "KV handed from prefill to decode workers, and the routing of prefills.", [
        timeseries("Transfer bytes/s", "mesh_kv_transfer_bytes_total by side.",
                   [target(rate(b, "side"), "{{side}}")], "Bps", w=8),
        timeseries("Transfer time (s/s)",
                   "mesh_kv_transfer_seconds_total by side: seconds spent copying "
                   "transferred pages (checksums included) per second.",
                   [target(rate(s, "side"), "{{side}}")], "s", w=8),
        timeseries("Average transfer speed", "Bytes / seconds of copying, by side.",
                   [target(f"{rate(b, 'side')} / {rate(s, 'side')}", "{{side}}")], "Bps", w=8),
        timeseries(f"Transfer failures by reason (per {WINDOW})",
                   "mesh_kv_transfer_failures_total: requests that failed in transfer.",
                   [target(increase("mesh_kv_transfer_failures_total", "reason"), "{{reason}}")],
                   "short", steps=((1, "red"),), w=8),
        timeseries(f"Admission timeouts (per {WINDOW})",
                   "Requests refused because no KV pages became free before the "
                   "admission deadline.",
                   [target(increase("mesh_admission_timeouts_total", "side"), "{{side}}")],
                   "short", steps=((1, "orange"),), w=8),
        timeseries(f"Late writes rejected (per {WINDOW})",
                   "Commits refused because their room had already failed.",
                   [target(increase("mesh_room_late_writes_rejected_total", "tier"), "{{tier}}")],
                   "short", w=8),
        timeseries("Prefill routing", "Prefill workers chosen per second: for the longest "
                   "cached prefix, or by load alone (mesh_route_prefill_total).",
                   [target(rate("mesh_route_prefill_total", "reason"), "{{reason}}")],
                   "reqps", stack=True, w=16),
        stat("Routed by cached prefix (range)",
             "Share of prefill routings over the shown range that followed a cached prefix.",
             [target('sum(increase(mesh_route_prefill_total{reason="prefix"}[$__range])) / '
                     "sum(increase(mesh_route_prefill_total[$__range]))", "prefix share")],
             "percentunit", w=8, h=8),
    ])


def wedges() -> dict:
    search = tempo_explore_url(
        f'{{ span.{TRACE_ROOM_STATE_ATTR} = "${{__field.labels.state}}" }}')
    long_traces = tempo_explore_url(
        f"{{ duration > {min(ROOM_DEADLINES_S.values())}s }}")
    oldest = timeseries(
        "Oldest room age by state",
        "mesh_room_oldest_seconds: age of the oldest room in each state at the cache "
        "service. Lines: the shortest default deadline (transferring, success) and the "
        "longest (waiting_for_input); a room above its state's deadline should already "
        "have failed (alert RoomOlderThanDeadline). Click a series for a data link to "
        "the Tempo trace search for rooms in that state (a link only: it needs the "
        f"`{TRACE_ROOM_STATE_ATTR}` span attribute).",
        [target("max by (state) (mesh_room_oldest_seconds)", "{{state}}")], "s",
        steps=((ROOM_DEADLINES_S["transferring"], "orange"),
               (max(ROOM_DEADLINES_S.values()), "red")),
        links=[{"targetBlank": True,
                "title": "Traces of rooms in state ${__field.labels.state} (Tempo)",
                "url": search}],
        w=24)
    oldest["links"] = [{"targetBlank": True,
                        "title": "Tempo: traces longer than the shortest room deadline",
                        "url": long_traces}]
    return dashboard("pdmesh-wedges", "pdmesh / Wedge tracing",
                     "Where requests get stuck: rooms by state and age, reservations, "
                     "stalls and watchdogs.", [
        oldest,
        timeseries("Rooms by state", "mesh_rooms: rooms at the cache service, by state.",
                   [target("sum by (state) (mesh_rooms)", "{{state}}")], "short", stack=True),
        timeseries("Room slots", "mesh_room_slots: host-mirror slots held by rooms, "
                   "transferring or quarantined after a failure (until the sender's lease "
                   "lets go).",
                   [target("sum by (state) (mesh_room_slots)", "{{state}}")], "short",
                   stack=True),
        timeseries(f"Room timeouts by stage (per {WINDOW})",
                   "mesh_room_timeouts_total: rooms failed by a deadline, by the state they "
                   "were stuck in.",
                   [target(increase("mesh_room_timeouts_total", "stage"), "{{stage}}")],
                   "short", steps=((1, "orange"),)),
        timeseries(f"Room aborts by reason (per {WINDOW})",
                   "mesh_room_aborts_total: sender, receiver, lease_lost, watchdog.",
                   [target(increase("mesh_room_aborts_total", "reason"), "{{reason}}")],
                   "short"),
        timeseries("Reserved decode pages vs requests",
                   "mesh_kv_reserved_pages (left) against mesh_worker_requests reserved and "
                   "running (right). Reserved pages with no reserved request is a leak.",
                   [target("sum(mesh_kv_reserved_pages)", "reserved decode pages"),
                    target('sum(mesh_worker_requests{state="reserved"})', "requests reserved"),
                    target('sum(mesh_worker_requests{state="running"})', "requests running")],
                   "short", overrides=right_axis("B", "C")),
        timeseries(f"Stalls (per {WINDOW})",
                   "mesh_engine_stalls_total: engine loops with work and no step past the "
                   "watchdog threshold, by side; mesh_stalls_total: everything the watchdogs "
                   "saw, by component (rooms past half their deadline, engine stalls).",
                   [target(increase("mesh_engine_stalls_total", "side"), "engine {{side}}"),
                    target(increase("mesh_stalls_total", "component"),
                           "watchdog saw {{component}}")],
                   "short", steps=((1, "orange"),)),
        timeseries(f"Watchdog aborts (per {WINDOW})",
                   "mesh_watchdog_aborts_total: requests a hard-mode watchdog ended because "
                   "their engine loop stalled.",
                   [target(increase("mesh_watchdog_aborts_total", "component"), "{{component}}")],
                   "short", steps=((1, "red"),), w=8),
        timeseries("Workers read", "mesh_workers_read: 0 means the last scrape could not "
                   "read a worker, so the worker gauges above are stale.",
                   [target("min(mesh_workers_read)", "workers read")], "none",
                   steps=((1, "green"),), w=16),
    ])


DASHBOARDS = {
    "overview.json": overview,
    "latency.json": latency,
    "cache-tiers.json": cache_tiers,
    "transfers.json": transfers,
    "wedges.json": wedges,
}


def render(build) -> bytes:
    """The JSON a dashboard is written as: the same bytes on every run and platform."""
    return (json.dumps(build(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a dashboard JSON differs from the code")
    ap.add_argument("--out", type=Path, default=HERE, help="directory (default: this one)")
    args = ap.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = args.out / name
        want = render(build)
        if args.check:
            if not path.is_file() or path.read_bytes() != want:
                stale.append(name)
        else:
            path.write_bytes(want)
    if args.check:
        extra = sorted(p.name for p in args.out.glob("*.json") if p.name not in DASHBOARDS)
        for name in stale:
            print(f"{name} differs from dashboards/generate.py: run python3 dashboards/generate.py",
                  file=sys.stderr)
        for name in extra:
            print(f"{name} is not generated by dashboards/generate.py: define it there",
                  file=sys.stderr)
        return 1 if stale or extra else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
