#!/usr/bin/env python3
"""Writes the Grafana dashboards under helm/kvfleet/dashboards/ (JSON, schema 39).

The JSON files are what the chart ships and the tests check; this script is how they
are made, so that a panel is one line here rather than forty of JSON. Run it after
editing a panel: `python3 scripts/gen_dashboards.py`.

Every query names only series `kvfleet` itself exports (tests/e2e_deploy_assets.rs
compares them with a live /metrics scrape), never a recording rule, so the dashboards
work without the rules installed.
"""

import json
import os

OUT = os.path.join(os.path.dirname(__file__), "..", "helm", "kvfleet", "dashboards")
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
CACHED = f'sum(rate(kvfleet_prompt_tokens_total{{cached="true"}}[{RI}]))'
PROMPT = f"sum(rate(kvfleet_prompt_tokens_total[{RI}]))"
LOAD = "max by (worker) (kvfleet_router_worker_running + kvfleet_router_worker_waiting)"


def variables(worker=False, price=False):
    v = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        }
    ]
    if worker:
        v.append(
            {
                "name": "worker",
                "label": "Worker",
                "type": "query",
                "datasource": DS,
                "query": {
                    "query": "label_values(kvfleet_router_worker_running, worker)",
                    "refId": "workers",
                },
                "definition": "label_values(kvfleet_router_worker_running, worker)",
                "refresh": 2,
                "multi": True,
                "includeAll": True,
                "allValue": ".*",
                "current": {"text": "All", "value": "$__all"},
                "sort": 1,
            }
        )
    if price:
        v.append(
            {
                "name": "price",
                "label": "Input price, $ per 1M tokens",
                "type": "textbox",
                "query": "3",
                "current": {"text": "3", "value": "3"},
                "description": "List price of one million uncached input tokens; "
                "cached tokens are billed at 10 % of it.",
            }
        )
    return v


class Board:
    def __init__(self, uid, title, description, **vars_):
        self.uid, self.title, self.description = uid, title, description
        self.vars = variables(**vars_)
        self.panels = []
        self.x = self.y = self.row_h = 0

    def panel(self, title, exprs, kind="timeseries", unit="short", w=12, h=8,
              description="", legend=None, decimals=None):
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_h
            self.row_h = 0
        targets = []
        for i, e in enumerate(exprs if isinstance(exprs, list) else [exprs]):
            expr, fmt = e if isinstance(e, tuple) else (e, legend or "")
            targets.append({"datasource": DS, "expr": expr, "legendFormat": fmt,
                            "refId": chr(ord("A") + i)})
        defaults = {"unit": unit}
        if decimals is not None:
            defaults["decimals"] = decimals
        p = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": h},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
            if kind == "timeseries"
            else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
            "targets": targets,
        }
        self.panels.append(p)
        self.x += w
        self.row_h = max(self.row_h, h)

    def write(self):
        board = {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["kvfleet"],
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "graphTooltip": 1,
            "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"},
            "timezone": "",
            "templating": {"list": self.vars},
            "annotations": {"list": []},
            "links": [],
            "panels": self.panels,
        }
        path = os.path.join(OUT, f"{self.uid}.json")
        with open(path, "w") as f:
            json.dump(board, f, indent=2)
            f.write("\n")


def fleet():
    b = Board("kvfleet-fleet", "kvfleet / Fleet cache",
              "Fleet-wide prefix-cache effect: cached-token ratio, what it saves, "
              "fork-group co-location, prefix breaks and request outcomes.", price=True)
    b.panel("Cached-token ratio", f"{CACHED} / {PROMPT}", kind="stat", unit="percentunit", w=6,
            h=5, description="Share of prompt tokens served from the prefix cache.")
    b.panel("Realized discount on input", f"0.9 * {CACHED} / {PROMPT}", kind="stat",
            unit="percentunit", w=6, h=5,
            description="Cached tokens billed at 10 %: discount = 0.9 x cached / prompt.")
    b.panel("Money saved (time range)",
            f'0.9 * $price * sum(increase(kvfleet_prompt_tokens_total{{cached="true"}}[$__range])) / 1e6',
            kind="stat", unit="currencyUSD", w=6, h=5, decimals=2,
            description="0.9 x cached tokens x $price per 1M tokens, over the dashboard's range.")
    b.panel("Savings rate", f"0.9 * $price * 3600 * {CACHED} / 1e6", kind="stat", unit="currencyUSD",
            w=6, h=5, decimals=2, description="Dollars per hour saved at the current rate.")
    b.panel("Cached-token ratio over time",
            [(f"{CACHED} / {PROMPT}", "cached / prompt"),
             (f"0.9 * {CACHED} / {PROMPT}", "realized discount")], unit="percentunit")
    b.panel("Prompt tokens, cached vs computed",
            f"sum by (cached) (rate(kvfleet_prompt_tokens_total[{RI}]))", legend="cached={{cached}}",
            unit="short")
    b.panel("Fork-group co-location",
            [("max(kvfleet_fork_group_colocation_ratio)", "co-located share (running)"),
             (f"sum(rate(kvfleet_fork_group_requests_total{{colocated=\"true\"}}[{RI}])) / "
              f"sum(rate(kvfleet_fork_group_requests_total[{RI}]))", "co-located share (rate)")],
            unit="percentunit",
            description="Share of fork-group requests that landed on their group's first worker.")
    b.panel("Prefix breaks by reason",
            f"sum by (reason) (rate(kvfleet_prefix_breaks_total[{RI}]))", legend="{{reason}}",
            unit="reqps", description="Session turns that lost the cache of the turn before.")
    b.panel("Requests by outcome",
            f"sum by (outcome) (rate(kvfleet_requests_total[{RI}]))", legend="{{outcome}}",
            unit="reqps")
    b.panel("Router cache prediction accuracy",
            f"sum(rate(kvfleet_actual_cached_tokens_total[{RI}])) / "
            f"sum(rate(kvfleet_predicted_cached_tokens_total[{RI}]))", unit="percentunit",
            legend="actual / predicted",
            description="Cached tokens workers reported over those the router predicted.")
    b.write()


def workers():
    b = Board("kvfleet-workers", "kvfleet / Workers",
              "Per-worker cache affinity and load, as routers see it (load polls) and as "
              "workers report it.", worker=True)
    w = '{worker=~"$worker"}'
    b.panel("Requests routed per worker",
            f"sum by (worker) (rate(kvfleet_routed_total{w}[{RI}]))", legend="{{worker}}",
            unit="reqps")
    b.panel("Cache hit ratio per worker",
            f"sum by (worker) (rate(kvfleet_worker_cached_tokens_total{w}[{RI}])) / "
            f"sum by (worker) (rate(kvfleet_worker_prompt_tokens_total{w}[{RI}]))",
            legend="{{worker}}", unit="percentunit",
            description="Cache affinity: share of each worker's prompt tokens it did not compute.")
    b.panel("Running + waiting sequences",
            f"max by (worker) (kvfleet_router_worker_running{w} + kvfleet_router_worker_waiting{w})",
            legend="{{worker}}")
    b.panel("Load imbalance (max / avg)",
            f"max({LOAD}) / clamp_min(avg({LOAD}), 1)", legend="max / avg", decimals=2,
            description="1 = even; the alert KvfleetWorkerImbalance fires above 3.")
    b.panel("Queued prefill tokens",
            f"max by (worker) (kvfleet_router_worker_queued_prefill_tokens{w})", legend="{{worker}}")
    b.panel("KV blocks cached / free",
            [(f"max by (worker) (kvfleet_router_worker_cached_blocks{w})", "cached {{worker}}"),
             (f"max by (worker) (kvfleet_router_worker_free_blocks{w})", "free {{worker}}")])
    b.panel("Prompt tokens computed per worker",
            f"sum by (worker) (rate(kvfleet_worker_prompt_tokens_computed_total{w}[{RI}]))",
            legend="{{worker}}", unit="short")
    b.panel("KV event-stream lag",
            f"max by (worker) (kvfleet_router_worker_events_behind{w})", legend="{{worker}}",
            description="Events a worker published that a router's index has not applied.")
    # KV tiers below each worker's pool (docs/kv-tiers-worker.md); all zero while
    # --host-cache-gib is 0.
    b.panel("KV tier hits (blocks promoted) by tier",
            [(f"sum by (worker, tier) (rate(kvfleet_worker_tier_promoted_blocks_total{w}[{RI}]))",
              "{{worker}} {{tier}}"),
             (f"sum by (worker) (rate(kvfleet_worker_tier_demotion_misses_total{w}[{RI}]))",
              "{{worker}} demotion misses"),
             (f"sum by (worker) (rate(kvfleet_worker_tier_demoted_blocks_total{w}[{RI}]))"
              f" - sum by (worker) (rate(kvfleet_worker_tier_demoted_off_thread_blocks_total{w}[{RI}]))",
              "{{worker}} copied down on the engine thread")],
            description="Blocks promoted into the pool instead of recomputed, by source "
            "(host memory, disk, a peer worker); cached blocks the pool evicted before "
            "they were copied down (lost to the tiers); and blocks copied down on the "
            "engine thread between steps because the write-out thread had not copied them "
            "in time (or the backend cannot read KV memory off-thread).")
    b.panel("KV tier bytes moved by direction",
            f"sum by (worker, direction) (rate(kvfleet_worker_tier_bytes_moved_total{w}[{RI}]))",
            legend="{{worker}} {{direction}}", unit="Bps",
            description="Copied down (demote: pool to host), back up (promote: host, disk or "
            "peer into the pool) and written to block files (disk_write).")
    b.panel("KV tier bytes held",
            f"max by (worker, tier) (kvfleet_worker_tier_bytes{w})",
            legend="{{worker}} {{tier}}", unit="bytes",
            description="Bytes each worker holds below its pool, per tier.")
    b.panel("KV tier blocks held",
            f"max by (worker, tier) (kvfleet_worker_tier_blocks{w})",
            legend="{{worker}} {{tier}}",
            description="Blocks each worker holds below its pool, per tier.")
    b.panel("Disk tier faults by kind",
            f"sum by (worker, kind) (rate(kvfleet_worker_disk_tier_faults_total{w}[{RI}]))",
            legend="{{worker}} {{kind}}",
            description="full (ENOSPC or quota: demotion to disk pauses), write_error, backlog "
            "(writer queue full: the demotion is dropped), missing and corrupt files (read as "
            "a miss). Each costs a recompute, never a wrong block.")
    # Peer pulls are on by default (router --peer-pull-min-blocks); the worker counters
    # are exposed at 0 from start.
    b.panel("Peer pulls: blocks pulled and failed pulls",
            [(f"sum by (worker) (rate(kvfleet_worker_peer_pull_blocks_total{w}[{RI}]))",
              "{{worker}} blocks"),
             (f"sum by (worker) (rate(kvfleet_worker_peer_pull_failures_total{w}[{RI}]))",
              "{{worker}} failed pulls")],
            description="Blocks a worker fetched from the peer holding them (FetchBlocks) "
            "instead of recomputing them, and pulls that stopped short (peer unreachable, "
            "refused or dead mid-transfer: the rest is recomputed). Steady failures mean "
            "the workers cannot reach each other's gRPC port: open it, or run the router "
            "with --peer-pull-min-blocks 0.")
    b.write()


def latency():
    b = Board("kvfleet-latency", "kvfleet / Latency",
              "Router decision latency, time to first token and inter-token latency.",
              worker=True)

    def q(p, metric, by=""):
        by_ = f"le, {by}" if by else "le"
        return f"histogram_quantile({p}, sum by ({by_}) (rate({metric}_bucket[{RI}])))"

    b.panel("Router decision latency p50 / p99 by phase",
            [(q(0.5, "kvfleet_router_decision_seconds", "phase"), "p50 {{phase}}"),
             (q(0.99, "kvfleet_router_decision_seconds", "phase"), "p99 {{phase}}")], unit="s")
    b.panel("Time to first token",
            [(q(0.5, "kvfleet_ttft_seconds"), "p50"), (q(0.9, "kvfleet_ttft_seconds"), "p90"),
             (q(0.99, "kvfleet_ttft_seconds"), "p99")], unit="s")
    b.panel("Inter-token latency",
            [(q(0.5, "kvfleet_itl_seconds"), "p50"), (q(0.99, "kvfleet_itl_seconds"), "p99")],
            unit="s")
    b.panel("Request latency",
            [(q(0.5, "kvfleet_request_seconds"), "p50"), (q(0.99, "kvfleet_request_seconds"), "p99")],
            unit="s")
    b.panel("Worker TTFT p99",
            f'histogram_quantile(0.99, sum by (le, worker) (rate(kvfleet_worker_ttft_seconds_bucket{{worker=~"$worker"}}[{RI}])))',
            legend="{{worker}}", unit="s")
    b.panel("Worker queue time p99",
            f'histogram_quantile(0.99, sum by (le, worker) (rate(kvfleet_worker_queue_seconds_bucket{{worker=~"$worker"}}[{RI}])))',
            legend="{{worker}}", unit="s")
    b.write()


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    fleet()
    workers()
    latency()
