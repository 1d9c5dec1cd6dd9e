#!/usr/bin/env python3
"""The pdmesh Grafana dashboards, defined in code and written as JSON next to this file.

    python3 dashboards/generate.py           # (re)write dashboards/*.json
    python3 dashboards/generate.py --check   # exit 1 if a committed JSON differs

Standard library only. The output is byte-stable: the same code always writes the same
bytes, so CI can fail on a hand edit (`--check`). Panels query only metrics the gateway
exports today (services/gateway/src/metrics/); tests/e2e/test_dashboards.py checks every
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

# The workers' default hand-over deadline (--transfer-timeout-ms): a KV hand-over older
# than this, as the workers see it, should already have failed on its side.
# deploy/prometheus/rules/pdmesh.rules.yml alerts on the same number
# (HandoverOlderThanDeadline); change them together.
HANDOVER_DEADLINE_S = 60

# The workers' default watchdog threshold (--watchdog-stall-ms): an engine loop with work
# and no step for this long counts a stall.
WATCHDOG_STALL_S = 10

# The cache service's age thresholds for mesh_rooms_older_than (its `seconds` label).
ROOM_AGE_BUCKETS_S = (1, 5, 30, 120)

# The span attribute the Tempo links search on: the cache service's room-call spans carry
# the state each call left the room in (a wedged room shows as RoomWait spans ending in
# its state), named as mesh_room_oldest_seconds's `state` label values.
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
         mappings: list | None = None, text_mode: str = "auto", graph: bool = True,
         w: int = 6, h: int = 4) -> dict:
    """A single value; `text_mode="name"` shows the series name (its legend) instead, as
    for a label-only series such as mesh_build_info."""
    p = _panel("stat", title, description, targets, unit, w, h)
    defaults = p["fieldConfig"]["defaults"]
    defaults["thresholds"] = thresholds(*steps)
    defaults["color"] = {"mode": "thresholds"}
    defaults["mappings"] = mappings or []
    p["options"] = {
        "colorMode": "value",
        "graphMode": "area" if graph else "none",
        "justifyMode": "auto",
        "orientation": "auto",
        "reduceOptions": _reduce(),
        "textMode": text_mode,
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


def table(title: str, description: str, targets: list, unit: str, *, value: str,
          w: int = 12, h: int = 8) -> dict:
    """One row per series of instant queries: its labels, then its value named `value`."""
    p = _panel("table", title, description,
               [dict(t, instant=True, range=False, format="table") for t in targets], unit, w, h)
    p["fieldConfig"]["defaults"]["thresholds"] = thresholds()
    p["options"] = {"showHeader": True, "cellHeight": "sm",
                    "sortBy": [{"displayName": value, "desc": True}]}
    p["transformations"] = [{"id": "organize", "options": {
        "excludeByName": {"Time": True}, "renameByName": {"Value": value}}}]
    return p


def prometheus_annotation(name: str, expr: str, title: str, text: str, tag: str,
                          color: str) -> dict:
    """Marks on every time panel where `expr` has a series: one per series and step."""
    return {
        "name": name,
        "datasource": PROMETHEUS,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": expr,
        "step": "1m",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": tag,
        "useValueForTime": False,
    }


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


def dashboard(uid: str, title: str, description: str, panels: list,
              annotations: list = ()) -> dict:
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
        "annotations": {"list": list(annotations)},
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

# mesh_prompt_token_sources_total: computed + device + host are the prompt tokens;
# transferred is counted besides (tokens whose KV a prefill worker handed to a decode one).
SOURCES = "mesh_prompt_token_sources_total"
PROMPT_SOURCES = f'{SOURCES}{{source=~"computed|device|host"}}'
CACHED_SOURCES = f'{SOURCES}{{source=~"device|host"}}'


def prompt_sources_panel(w: int = 12) -> dict:
    return timeseries(
        "Prompt tokens by source",
        "Prompt tokens per second by where their KV came from (stacked, adding up to the "
        "prompt tokens): computed by a prefill, device = the worker's prefix cache, host = "
        "loaded back from the host tier. The dashed line, not stacked, is the tokens whose KV "
        "a prefill worker handed to a decode worker (mesh_prompt_token_sources_total).",
        [target(rate(PROMPT_SOURCES, "source"), "{{source}}"),
         target(rate(f'{SOURCES}{{source="transferred"}}'), "transferred")], "short",
        stack=True,
        overrides=[override(  # transferred: a dashed line on top, not part of the stack
            "B",
            ("custom.stacking", {"group": "A", "mode": "none"}),
            ("custom.fillOpacity", 0),
            ("custom.lineStyle", {"dash": [10, 10], "fill": "dash"}))],
        w=w)


def cache_hit_by_tier_panel(w: int = 12) -> dict:
    return timeseries(
        "Cache hit ratio by tier",
        "Share of prompt tokens whose KV came from a cache, per rate window: device (the "
        "worker's prefix cache) or host (the host tier), each over computed + device + host "
        "(mesh_prompt_token_sources_total, counted per request by the gateway).",
        [target(f"{rate(CACHED_SOURCES, 'source')} / scalar({rate(PROMPT_SOURCES)})",
                "{{source}}")],
        "percentunit", w=w)


def overview() -> dict:
    return dashboard("pdmesh-overview", "pdmesh / Overview",
                     "Traffic, errors, tokens and the KV pool of one pdmesh gateway.", [
        stat("Request rate", "HTTP requests answered per second, all endpoints.",
             [target(rate("mesh_requests_total"), "requests/s")], "reqps", w=5),
        stat("Error rate", "Requests that ended in an error per second.",
             [target(f"sum(rate(mesh_errors_total[{RATE}])) or vector(0)", "errors/s")],
             "reqps", steps=((0.01, "red"),), w=5),
        stat("Prompt cache-hit ratio (range)",
             "Prompt tokens served from the prefix cache over the shown range "
             "(mesh_cached_prompt_tokens_total / mesh_prompt_tokens_total).",
             [target("sum(increase(mesh_cached_prompt_tokens_total[$__range])) / "
                     "sum(increase(mesh_prompt_tokens_total[$__range]))", "hit ratio")],
             "percentunit", w=5),
        stat("Workers read", "1: the last scrape read every worker's state; 0: a worker "
             "did not answer and the worker gauges are stale (mesh_workers_read).",
             [target("min(mesh_workers_read)", "workers read")], "none",
             steps=((1, "green"),),
             mappings=[{"type": "value", "options": {
                 "0": {"color": "red", "index": 0, "text": "stale"},
                 "1": {"color": "green", "index": 1, "text": "read"}}}], w=5),
        stat("Version", "The pdmesh version the gateway was built from (mesh_build_info). "
             "Two versions at once mean gateways of different versions are answering.",
             [target("max by (version) (mesh_build_info)", "{{version}}", instant=True)],
             "none", text_mode="name", graph=False, w=4),
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
        prompt_sources_panel(),
        cache_hit_by_tier_panel(),
        timeseries("KV pages in use vs total",
                   "The worker's KV pool, read at scrape: pages held by requests "
                   "(total - free - cached), pages only the prefix cache holds (evictable), "
                   "and the pool size.",
                   [target("sum(mesh_kv_pages_capacity) - sum(mesh_kv_pages_free) - "
                           "sum(mesh_kv_pages_cached)", "held by requests"),
                    target("sum(mesh_kv_pages_cached)", "prefix cache (evictable)"),
                    target("sum(mesh_kv_pages_capacity)", "total")], "short",
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
    stage = "mesh_request_stage_seconds"
    return dashboard("pdmesh-latency", "pdmesh / Latency",
                     "Time to first token, inter-token latency, request and stream durations, "
                     "time per request stage and the gateway's event loop delay, from the "
                     "gateway's histograms.", [
        text("About these histograms",
             "`mesh_time_to_first_token_seconds` runs from a request's arrival to its first "
             "generated token reaching the gateway; `mesh_inter_token_latency_seconds` "
             "between consecutive tokens of one request. "
             "`mesh_request_duration_seconds` runs from the request to the response "
             "headers; for a stream that is **not** the time to first token. "
             "`mesh_stream_duration_seconds` runs to the end of an SSE stream. "
             "`mesh_request_stage_seconds` splits a request into stages: tokenize (in the "
             "gateway), queue (waiting for admission), prefill (to the first token), transfer "
             "(first token to the KV in the decode pool) and decode (first token to last). "
             "`mesh_event_loop_delay_seconds` is how late the gateway runs a timer due every "
             "100 ms.",
             h=4),
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
        timeseries("Time per stage p50",
                   "Median time a request spent in each stage (histogram_quantile over "
                   "mesh_request_stage_seconds_bucket, by stage).",
                   [target(quantile(0.5, stage, "stage"), "{{stage}}")], "s"),
        timeseries("Time per stage p95",
                   "95th percentile of the time a request spent in each stage "
                   "(histogram_quantile over mesh_request_stage_seconds_bucket, by stage).",
                   [target(quantile(0.95, stage, "stage"), "{{stage}}")], "s"),
        timeseries("Queue time p50 / p95 / p99",
                   "How long requests waited for admission (stage queue of "
                   "mesh_request_stage_seconds): a rising queue time means the workers are "
                   "full.",
                   [target(quantile(q, stage, selector='{stage="queue"}'), f"p{round(q * 100)}")
                    for q in (0.5, 0.95, 0.99)], "s"),
        timeseries("Gateway event loop delay p99 / p99.9",
                   "How late the gateway's async runtime ran a timer due every 100 ms "
                   "(mesh_event_loop_delay_seconds). A high value means the gateway's event "
                   "loop is busy or blocked, which delays every request it serves.",
                   [target(quantile(0.99, "mesh_event_loop_delay_seconds"), "p99"),
                    target(quantile(0.999, "mesh_event_loop_delay_seconds"), "p99.9")], "s"),
        timeseries("Requests timed, by endpoint",
                   "mesh_request_duration_seconds_count per second (every endpoint), and "
                   "streams finished per second.",
                   [target(rate("mesh_request_duration_seconds_count", "endpoint"), "{{endpoint}}"),
                    target(rate("mesh_stream_duration_seconds_count"), "streams")], "reqps", w=24),
    ])


WRITE_BACK_BYTES = 'mesh_kv_cache_write_back_bytes_total{tier="host"}'
WRITE_BACK_SECONDS = 'mesh_kv_cache_write_back_seconds_total{tier="host"}'


def cache_tiers() -> dict:
    hit = "mesh_kv_cache_hit_tokens_total"
    return dashboard("pdmesh-cache-tiers", "pdmesh / Cache tiers",
                     "The device prefix cache, the host tier, the cache service's host "
                     "mirror and the disk tier below it.", [
        timeseries("Prompt tokens served from cache, by tier",
                   "mesh_kv_cache_hit_tokens_total: device = the worker's prefix cache, "
                   "host = loaded back from the host tier, disk = the part of host that the "
                   "cache service promoted from its disk tier for that request. Tokens per "
                   "second.",
                   [target(rate(f'{hit}{{tier="device"}}'), "device"),
                    target(rate(f'{hit}{{tier="host"}}'), "host"),
                    target(rate(f'{hit}{{tier="disk"}}'), "disk")], "short", w=8),
        timeseries("Share of prompt tokens served from cache, by tier",
                   "Hit tokens per tier, as the workers count them, / prompt tokens processed.",
                   [target(f"{rate(hit, 'tier')} / scalar({rate('mesh_prompt_tokens_total')})",
                           "{{tier}}")], "percentunit", w=8),
        cache_hit_by_tier_panel(w=8),
        prompt_sources_panel(w=24),
        timeseries("Host tier: load-back and write-back bytes/s",
                   "mesh_kv_cache_load_back_bytes_total (host tier -> device) and "
                   "mesh_kv_cache_write_back_bytes_total (device -> host tier).",
                   [target(rate("mesh_kv_cache_load_back_bytes_total"), "load-back"),
                    target(rate("mesh_kv_cache_write_back_bytes_total"), "write-back")],
                   "Bps", w=8),
        timeseries("Host tier: load-back time and speed",
                   "Seconds spent loading back per second (checksums included), and the "
                   "average load-back speed (bytes / seconds).",
                   [target(rate("mesh_kv_cache_load_back_seconds_total"), "load-back s/s"),
                    target(f"{rate('mesh_kv_cache_load_back_bytes_total')} / "
                           f"{rate('mesh_kv_cache_load_back_seconds_total')}",
                           "load-back speed")], "s",
                   overrides=right_axis("B", unit="Bps"), w=8),
        timeseries("Host tier: write-back time and speed",
                   "Seconds spent writing KV pages to the host tier per second (checksums "
                   "included), and the average write-back speed (bytes / seconds).",
                   [target(rate(WRITE_BACK_SECONDS), "write-back s/s"),
                    target(f"{rate(WRITE_BACK_BYTES)} / {rate(WRITE_BACK_SECONDS)}",
                           "write-back speed")], "s",
                   overrides=right_axis("B", unit="Bps"), w=8),
        timeseries("Host tier: store queue and fetches",
                   "The workers never wait on the host tier: pages to store wait in a "
                   "bounded queue (mesh_kv_cache_write_back_queued_pages), pages offered "
                   f"while it was full are dropped (per {WINDOW}), and admitted requests "
                   "whose prompt pages are being fetched hold their pages meanwhile "
                   "(mesh_kv_cache_host_fetching_requests).",
                   [target("sum(mesh_kv_cache_write_back_queued_pages)", "queued pages"),
                    target(increase("mesh_kv_cache_write_back_dropped_pages_total"),
                           f"dropped pages per {WINDOW}"),
                    target("sum(mesh_kv_cache_host_fetching_requests)", "fetching requests")],
                   "short", w=8),
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
        timeseries("Disk tier: pages spilled, promoted, dropped and late",
                   "mesh_kv_disk_pages_total, pages per second: spilled = written from the "
                   "host mirror as it evicted them, promoted = read back into the mirror on "
                   "a hit, spill_dropped = not written (queue full, degraded), late = pages not "
                   "promoted by their match's deadline (a miss for it, never a wait).",
                   [target(rate("mesh_kv_disk_pages_total", "event"), "{{event}}")], "short",
                   w=8),
        timeseries("Disk tier: bytes and promote latency",
                   "Bytes per second written to and read from the disk tiers "
                   "(mesh_kv_disk_io_bytes_total), and the mean time from a match asking to "
                   "a promoted page being in the host mirror (right axis).",
                   [target(rate("mesh_kv_disk_io_bytes_total", "direction"), "{{direction}}"),
                    target(rate("mesh_kv_disk_promote_seconds_total") + " / "
                           + rate('mesh_kv_disk_pages_total{event="promoted"}'),
                           "promote latency")], "Bps",
                   overrides=right_axis("B", unit="s"), w=8),
        timeseries(f"Disk tier: files discarded (per {WINDOW}) and state",
                   "mesh_kv_disk_discards_total by reason: page files found unsound or of "
                   "another layout or model, at start or at load, removed and never served. "
                   "foreign_layout after a model or layout change is expected; any other is "
                   "a damaged disk or a crash mid-write. The degraded line (1) is a full or "
                   "unwritable disk: nothing is spilled until a retry succeeds.",
                   [target(increase("mesh_kv_disk_discards_total", "reason"), "{{reason}}"),
                    target('max(mesh_kv_disk_tier{state="degraded"})', "degraded")],
                   "short", steps=((1, "red"),), w=8),
        timeseries("Disk tier: pages and bytes",
                   "Pages on the hosts' disk tiers (mesh_kv_disk_pages), and their bytes "
                   "against --disk-size (mesh_kv_disk_bytes, right axis).",
                   [target("sum(mesh_kv_disk_pages)", "pages"),
                    target("sum by (state) (mesh_kv_disk_bytes)", "bytes {{state}}")],
                   "short", overrides=right_axis("B", unit="bytes"), w=24),
        bargauge("Router's view: cached pages per prefill worker",
                 "mesh_router_cached_pages: pages each prefill worker's device cache holds, "
                 "as the gateway knows from its KV events.",
                 [target("sum by (worker) (mesh_router_cached_pages)", "{{worker}}")],
                 "short", w=24),
    ])


TRANSFERS = "mesh_kv_transfers_total"
TRANSFERS_FAILED = f'{TRANSFERS}{{outcome="failed"}}'
PEER_PAGES_RECEIVED = 'mesh_kv_peer_pages_total{direction="received"}'


def handovers_panel(w: int = 12) -> dict:
    return timeseries(
        "Hand-overs under way, by side",
        "mesh_handovers: KV hand-overs the workers have under way now. Prefill: from the "
        "start until its commit; decode: until its pages are verified.",
        [target("sum by (side) (mesh_handovers)", "{{side}}")], "short", w=w)


def handover_oldest_panel(w: int = 12) -> dict:
    return timeseries(
        "Oldest hand-over by side (workers' view)",
        "mesh_handover_oldest_seconds: age of the oldest KV hand-over under way, as the "
        "workers on each side see it. Unlike the rooms' ages it keeps rising while the cache "
        "service is stopped or frozen. The line is the workers' default hand-over deadline "
        f"({HANDOVER_DEADLINE_S} s): one that stays above it is stuck (alert "
        "HandoverOlderThanDeadline).",
        [target("max by (side) (mesh_handover_oldest_seconds)", "{{side}}")], "s",
        steps=((HANDOVER_DEADLINE_S, "red"),), w=w)


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
        timeseries("Transfers by outcome",
                   "KV hand-overs per second as the decode side ended them: ok (pages "
                   "verified) or failed (mesh_kv_transfers_total).",
                   [target(rate(TRANSFERS, "outcome"), "{{outcome}}")], "reqps", stack=True,
                   w=8),
        timeseries(f"Transfer failure ratio (per {WINDOW})",
                   f"Failed hand-overs / all hand-overs ended in the last {WINDOW} "
                   "(mesh_kv_transfers_total). Alert KvTransfersFailing fires on any failure.",
                   [target(f"{increase(TRANSFERS_FAILED)} / {increase(TRANSFERS)}", "failed")],
                   "percentunit", steps=((0.01, "red"),), w=8),
        timeseries(f"Transfer failures by reason (per {WINDOW})",
                   "mesh_kv_transfer_failures_total: requests that failed in transfer.",
                   [target(increase("mesh_kv_transfer_failures_total", "reason"), "{{reason}}")],
                   "short", steps=((1, "red"),), w=8),
        handovers_panel(),
        handover_oldest_panel(),
        timeseries(f"Admission timeouts (per {WINDOW})",
                   "Requests refused because no KV pages became free before the "
                   "admission deadline.",
                   [target(increase("mesh_admission_timeouts_total", "side"), "{{side}}")],
                   "short", steps=((1, "orange"),)),
        timeseries(f"Late writes rejected (per {WINDOW})",
                   "Commits refused because their room had already failed.",
                   [target(increase("mesh_room_late_writes_rejected_total", "tier"), "{{tier}}")],
                   "short"),
        timeseries("KV between hosts (bytes/s)",
                   "mesh_kv_peer_bytes_total: KV bytes moved between hosts' cache services "
                   "over the page transport, by direction, summed over every host.",
                   [target(rate("mesh_kv_peer_bytes_total", "direction"), "{{direction}}")],
                   "Bps", w=8),
        timeseries("Prompt pages decode already held (share)",
                   "Of the prompt pages bound for another host, the share its receiver "
                   "already held, which did not cross (mesh_kv_held_pages_skipped_total over "
                   "those plus mesh_kv_peer_pages_total received).",
                   [target(f'{rate("mesh_kv_held_pages_skipped_total")} / '
                           f'({rate("mesh_kv_held_pages_skipped_total")} + '
                           f'{rate(PEER_PAGES_RECEIVED)})', "held")],
                   "percentunit", w=8),
        timeseries(f"Between hosts: failures and layout refusals (per {WINDOW})",
                   "mesh_kv_peer_transfer_failures_total: rooms whose pages could not reach "
                   "their home host (each fails its request cleanly). "
                   "mesh_kv_peer_layout_refusals_total: peers refused for another KV layout "
                   "(alert PeerKvLayoutRefused): nothing crossed, but that host cannot serve "
                   "with this one until its layout matches.",
                   [target(increase("mesh_kv_peer_transfer_failures_total"), "transfer failures"),
                    target(increase("mesh_kv_peer_layout_refusals_total"), "layout refusals")],
                   "short", steps=((1, "red"),), w=8),
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
        "have failed (alert RoomOlderThanDeadline). While the cache service does not "
        "answer these ages cannot be read: the workers' view of the hand-overs, next to "
        "this panel, still rises. Click a series for a data link to "
        "the Tempo trace search for rooms in that state (the cache service's room calls "
        f"carry `{TRACE_ROOM_STATE_ATTR}` when traces are exported).",
        [target("max by (state) (mesh_room_oldest_seconds)", "{{state}}")], "s",
        steps=((ROOM_DEADLINES_S["transferring"], "orange"),
               (max(ROOM_DEADLINES_S.values()), "red")),
        links=[{"targetBlank": True,
                "title": "Traces of rooms in state ${__field.labels.state} (Tempo)",
                "url": search}],
        w=12)
    oldest["links"] = [{"targetBlank": True,
                        "title": "Tempo: traces longer than the shortest room deadline",
                        "url": long_traces}]
    reports = ("`pdmesh incident list` (then `pdmesh incident show ID`) on the reports' "
               "directory, or `GET /debug/incidents` on the gateway with the API key")
    incidents = prometheus_annotation(
        "Incident reports",
        "sum by (kind) (increase(mesh_incidents_total[1m])) > 0",
        "Incident: {{kind}}",
        "{{value}} failures of kind {{kind}} filed an incident report in this minute; read "
        "them with " + reports + ".",
        "kind", "red")
    return dashboard("pdmesh-wedges", "pdmesh / Wedge tracing",
                     "Where requests get stuck: rooms by state and age, hand-overs as the "
                     "workers see them, reservations, stalls and watchdogs. Red marks: "
                     "incident reports filed.", [
        table("Incident reports in this time range",
              "mesh_incidents_total: failures the mesh filed an incident report for in the "
              "dashboard's time range, by kind (wedge, room_deadline, checksum, "
              "layout_refused, engine_stall, tool_parse, first_token_mismatch, disk_degraded), "
              "the gateway's "
              "own and the workers' and cache services' as the gateway last read them. "
              "Repeats of one cause in one component within five minutes share a report. "
              "The reports: " + reports + ".",
              [target("sum by (kind) (increase(mesh_incidents_total[$__range])) > 0")],
              "short", value="failures reported", w=12, h=8),
        oldest,
        handover_oldest_panel(),
        timeseries("Rooms older than N seconds",
                   "mesh_rooms_older_than: rooms at the cache service under way longer than "
                   "N seconds in their state, for N = "
                   + ", ".join(str(n) for n in ROOM_AGE_BUCKETS_S)
                   + ". The counts are cumulative: a room older than 120 s is also counted "
                   "in > 30 s, > 5 s and > 1 s.",
                   [target("sum by (seconds) (mesh_rooms_older_than)", "> {{seconds}} s")],
                   "short"),
        handovers_panel(),
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
                   "short", overrides=right_axis("B", "C"), w=16),
        timeseries("Workers read", "mesh_workers_read: 0 means the last scrape could not "
                   "read a worker, so the worker gauges on this dashboard are stale.",
                   [target("min(mesh_workers_read)", "workers read")], "none",
                   steps=((1, "green"),), w=8),
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
                   "short", steps=((1, "red"),)),
        timeseries("Watchdog progress: engine steps/s",
                   "mesh_engine_steps_total: engine loop steps per second, summed over the "
                   "workers; the counter the watchdogs read. Steps falling to 0 while "
                   "requests are running (right axis) means the engine loops stopped moving.",
                   [target(rate('mesh_engine_steps_total{side="all"}'), "steps/s"),
                    target('sum(mesh_worker_requests{state="running"})', "requests running")],
                   "short", overrides=right_axis("B")),
        timeseries("Engine idle with work",
                   "mesh_engine_idle_seconds: the longest any worker's engine loop has had work "
                   "without a step, read at scrape. The line is the workers' default watchdog "
                   f"threshold ({WATCHDOG_STALL_S} s), past which a stall is counted.",
                   [target("max(mesh_engine_idle_seconds)", "longest idle with work")], "s",
                   steps=((WATCHDOG_STALL_S, "orange"),)),
    ], annotations=[incidents])


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
