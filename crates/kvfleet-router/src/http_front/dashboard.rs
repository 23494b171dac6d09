//! `GET /dashboard`: the live cache map, one self-contained page (HTML, CSS and JS
//! embedded in the binary: the fleet's machines may be offline), and
//! `GET /dashboard/state`: the JSON snapshot the page polls.
//!
//! The snapshot's fields (all token counts are prompt tokens):
//!
//! - `generated_unix_ms`, `uptime_ms`, `model`, `block_size`, `cached_token_price`
//!   (the fraction of the input price a cached token is billed at: 0.1).
//! - `last_seq`: number of the newest routing decision (grows with traffic).
//! - `totals`: `requests`, `prompt_tokens`, `predicted_cached_tokens`,
//!   `known_requests` / `known_prompt_tokens` / `cached_tokens` (requests whose usage
//!   has arrived), `cached_ratio` (cached ÷ prompt of those), `realized_discount`
//!   (input cost saved: `cached_ratio × (1 − cached_token_price)`), `ok`, `failed`,
//!   `in_flight`, `workers`, `healthy_workers`, `indexed_blocks`, `reservations`,
//!   `fork_groups_colocated` / `fork_group_requests`.
//! - `workers[]`: `id`, `endpoint`, `healthy`, `routed`; `hit_ratio`, `prompt_tokens`,
//!   `cached_tokens` (cumulative) and `hit_ratio_1m`, `requests_1m` (last minute);
//!   from the worker's last load report `running`, `waiting`, `queued_prefill_tokens`,
//!   `free_blocks`, `admit_blocks` (the blocks a new sequence may take now: free less
//!   the running sequences' expected growth; `null` from a worker that does not say),
//!   `cached_blocks`, `total_blocks`; from the router's index
//!   `indexed_blocks`, `reservations`, `inflight_requests`, and `routing_load`, the
//!   load the policy scores (`active_sequences`, `prefill_backlog_tokens`,
//!   `prefills_ahead`: the last report, lowered by the loads the worker pushed since
//!   with its KV events, plus this router's requests since); `kv_tiers` (below;
//!   `null` before its first load report).
//! - `kv_tiers`: the fleet's sum of the workers' `kv_tiers`, from their load reports
//!   (so it counts every router's traffic, since each worker started):
//!   `tiered_workers` (workers with a host/disk tier), `prompt_tokens`,
//!   `cached_tokens`; `hits` (cached prompt tokens by where they came from: `device`
//!   = already in the pool, `host`, `disk`, `peer`) and `hit_ratio` (each ÷
//!   `prompt_tokens`); `bytes_moved` (`demoted` pool → host, `promoted` host/disk/peer
//!   → pool, `peer_pulled` received from peers); `blocks_moved` (`demoted`,
//!   `demoted_off_thread` (of those, copied by the write-out thread while the engine
//!   stepped), `promoted_host`, `promoted_disk`, `promoted_peer`, `peer_pulled`); `held`
//!   (`host_blocks`, `host_bytes`, `disk_blocks`, `disk_bytes`); `demotion_misses`,
//!   `disk_faults`.
//! - `prefix_groups[]` (the [`GROUPS_SHOWN`](crate::decision_log::GROUPS_SHOWN) most
//!   recently routed, newest first): `id` (hex), `label` (fork group or session),
//!   `requests`, `hit_ratio`, `blocks` (blocks of its latest prompt, capped),
//!   `last_worker`, `last_unix_ms`, and `holders`: worker id → how many of those
//!   blocks the prefix index says the worker holds, in prefix order.
//! - `decisions[]`: the newest routing decisions first (`?decisions=N`, default 60, at
//!   most [`DECISIONS_KEPT`](crate::decision_log::DECISIONS_KEPT)); fields as in
//!   [`DecisionRecord`](crate::decision_log::DecisionRecord).
//!
//! The snapshot takes the decision log's lock once and the routing core's lock once,
//! for a few prefix lookups: its cost is bounded whatever the traffic or index size.

use crate::decision_log::{LogSnapshot, DECISIONS_KEPT};
use crate::fleet::Fleet;
use crate::supervision::WorkerStatus;
use crate::wall_clock::unix_ms;
use crate::worker_tiers::WorkerTiers;
use axum::extract::{RawQuery, State};
use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The page: markup, style and script in one file.
const PAGE: &str = include_str!("dashboard.html");

/// What a cached prompt token is billed at, as a fraction of an uncached one.
pub const CACHED_TOKEN_PRICE: f64 = 0.1;

/// Decisions a snapshot carries unless `?decisions=N` says otherwise.
const DEFAULT_DECISIONS: usize = 60;

/// `GET /dashboard`.
pub async fn page() -> Response {
    ([(header::CACHE_CONTROL, "no-store")], Html(PAGE)).into_response()
}

/// `GET /dashboard/state`: the snapshot described in the module docs.
pub async fn state(State(fleet): State<Arc<Fleet>>, RawQuery(query): RawQuery) -> Response {
    let limit = query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("decisions="))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(DEFAULT_DECISIONS)
        .min(DECISIONS_KEPT);
    (
        [(header::CACHE_CONTROL, "no-store")],
        Json(snapshot(&fleet, limit)),
    )
        .into_response()
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// The `kv_tiers` object of one worker or of the fleet (see the module docs).
fn tiers_json(t: &WorkerTiers) -> Value {
    let device = t.device_cached_tokens();
    let share = |n: u64| ratio(n, t.prompt_tokens);
    json!({
        "tiered_workers": t.tiered_workers,
        "prompt_tokens": t.prompt_tokens,
        "cached_tokens": t.cached_tokens,
        "hits": {
            "device": device,
            "host": t.host_cached_tokens,
            "disk": t.disk_cached_tokens,
            "peer": t.peer_cached_tokens,
        },
        "hit_ratio": {
            "device": share(device),
            "host": share(t.host_cached_tokens),
            "disk": share(t.disk_cached_tokens),
            "peer": share(t.peer_cached_tokens),
        },
        "bytes_moved": {
            "demoted": t.demoted_bytes,
            "promoted": t.promoted_bytes,
            "peer_pulled": t.peer_pulled_bytes,
        },
        "blocks_moved": {
            "demoted": t.demoted_blocks,
            "demoted_off_thread": t.demoted_off_thread_blocks,
            "promoted_host": t.promoted_host_blocks,
            "promoted_disk": t.promoted_disk_blocks,
            "promoted_peer": t.promoted_peer_blocks,
            "peer_pulled": t.peer_pulled_blocks,
        },
        "held": {
            "host_blocks": t.host_blocks,
            "host_bytes": t.host_bytes,
            "disk_blocks": t.disk_blocks,
            "disk_bytes": t.disk_bytes,
        },
        "demotion_misses": t.demotion_misses,
        "disk_faults": t.disk_faults,
    })
}

/// The sum of the workers' tier totals (those that have reported load).
fn fleet_tiers(statuses: &[WorkerStatus]) -> WorkerTiers {
    let mut total = WorkerTiers::default();
    for t in statuses.iter().filter_map(|s| s.tiers.as_ref()) {
        total += t;
    }
    total
}

/// Builds the dashboard's JSON snapshot with at most `limit` decisions.
pub fn snapshot(fleet: &Fleet, limit: usize) -> Value {
    let now = unix_ms();
    let log: LogSnapshot = fleet.decisions.snapshot(limit, now);
    let statuses = fleet.workers.statuses();
    // Copied out of the routing core under one short lock: per-worker index counts and
    // how deep each shown group's chain is held. The JSON is built after.
    let chains: Vec<&[kvfleet_core::BlockHash]> =
        log.groups.iter().map(|g| g.chain.as_slice()).collect();
    let (router, depths) = fleet.routing.snapshot_with_depths(&chains);
    let holders: Vec<Map<String, Value>> = depths
        .iter()
        .map(|per_worker| {
            router
                .workers
                .iter()
                .zip(per_worker)
                .map(|(w, depth)| (w.id.clone(), json!(depth)))
                .collect()
        })
        .collect();
    let (colocated, fork_requests) = fleet.decisions.fork_colocation();

    let hits = |id: &str| log.workers.iter().find(|w| w.worker == id);
    let workers: Vec<Value> = statuses
        .iter()
        .map(|s| {
            let h = hits(&s.id);
            let r = router.workers.iter().find(|w| w.id == s.id);
            let l = s.load.unwrap_or_default();
            json!({
                "id": s.id,
                "endpoint": s.endpoint,
                "healthy": s.healthy,
                "routed": h.map_or(0, |h| h.routed),
                "hit_ratio": h.map_or(0.0, |h| h.total.hit_ratio),
                "prompt_tokens": h.map_or(0, |h| h.total.prompt_tokens),
                "cached_tokens": h.map_or(0, |h| h.total.cached_tokens),
                "hit_ratio_1m": h.map_or(0.0, |h| h.last_minute.hit_ratio),
                "requests_1m": h.map_or(0, |h| h.last_minute.requests),
                "running": l.running,
                "waiting": l.waiting,
                "queued_prefill_tokens": l.queued_prefill_tokens,
                "free_blocks": l.free_blocks,
                "admit_blocks": l.admit_blocks,
                "cached_blocks": l.cached_blocks,
                "total_blocks": l.total_blocks,
                "indexed_blocks": r.map_or(0, |r| r.cached_blocks),
                "reservations": r.map_or(0, |r| r.reservations),
                "inflight_requests": r.map_or(0, |r| r.load.inflight_requests),
                "routing_load": r.map(|r| json!({
                    "active_sequences": r.load.active_sequences(),
                    "prefill_backlog_tokens": r.load.prefill_backlog_tokens(),
                    "prefills_ahead": r.load.prefills_ahead(),
                })),
                "kv_tiers": s.tiers.as_ref().map(tiers_json),
            })
        })
        .collect();
    let groups: Vec<Value> = log
        .groups
        .iter()
        .zip(holders)
        .map(|(g, holders)| {
            json!({
                "id": g.id,
                "label": g.label,
                "requests": g.requests,
                "hit_ratio": g.hits.hit_ratio,
                "blocks": g.chain.len(),
                "last_worker": g.last_worker,
                "last_unix_ms": g.last_unix_ms,
                "holders": holders,
            })
        })
        .collect();
    let t = &log.totals;
    let cached_ratio = ratio(t.known.cached_tokens, t.known.prompt_tokens);
    json!({
        "generated_unix_ms": now,
        "uptime_ms": fleet.now_ms(),
        "model": fleet.model().map(|m| m.0),
        "block_size": router.block_size,
        "cached_token_price": CACHED_TOKEN_PRICE,
        "last_seq": log.last_seq,
        "totals": {
            "requests": t.requests,
            "prompt_tokens": t.prompt_tokens,
            "predicted_cached_tokens": t.predicted_cached_tokens,
            "known_requests": t.known.requests,
            "known_prompt_tokens": t.known.prompt_tokens,
            "cached_tokens": t.known.cached_tokens,
            "cached_ratio": cached_ratio,
            "realized_discount": cached_ratio * (1.0 - CACHED_TOKEN_PRICE),
            "ok": t.ok,
            "failed": t.failed,
            "in_flight": t.requests.saturating_sub(t.ok + t.failed),
            "workers": statuses.len(),
            "healthy_workers": statuses.iter().filter(|s| s.healthy).count(),
            "indexed_blocks": router.indexed_blocks,
            "reservations": router.reservations,
            "fork_groups_colocated": colocated,
            "fork_group_requests": fork_requests,
        },
        "workers": workers,
        "kv_tiers": tiers_json(&fleet_tiers(&statuses)),
        "prefix_groups": groups,
        "decisions": log.decisions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision_log::{NewDecision, GROUPS_SHOWN};
    use crate::fleet::FleetConfig;
    use kvfleet_core::BlockHash;

    fn routed(fleet: &Fleet, i: u64) -> u64 {
        let hashes: Vec<BlockHash> = (0..10).map(|b| BlockHash(i * 100 + b)).collect();
        fleet.decisions.record(
            NewDecision {
                unix_ms: unix_ms(),
                at_ms: i,
                request_id: format!("req-{i}"),
                endpoint: "completions",
                worker: format!("w{}", i % 3),
                policy: "cache-aware",
                prompt_tokens: 160,
                predicted_cached_tokens: 0,
                fork_group: None,
                session: None,
                decision_us: 3,
                accept_us: 500,
                attempts: 1,
                placement: crate::decision_log::PlacementStep::None,
            },
            &hashes,
        )
    }

    #[test]
    fn the_snapshot_is_bounded_newest_first_and_counts_cached_tokens() {
        let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
        for i in 0..400 {
            let seq = routed(&fleet, i);
            fleet
                .decisions
                .outcome(seq, Some(if i % 2 == 0 { 96 } else { 0 }), Some("ok"));
        }
        let s = snapshot(&fleet, 10_000);
        let decisions = s["decisions"].as_array().expect("decisions");
        assert_eq!(decisions.len(), DECISIONS_KEPT);
        assert_eq!(decisions[0]["request_id"], "req-399");
        assert_eq!(decisions[0]["seq"], 400);
        assert_eq!(decisions[0]["actual_cached_tokens"], 0);
        assert_eq!(decisions[1]["actual_cached_tokens"], 96);
        assert_eq!(s["last_seq"], 400);
        assert_eq!(
            s["prefix_groups"].as_array().map(Vec::len),
            Some(GROUPS_SHOWN)
        );
        assert_eq!(s["prefix_groups"][0]["requests"], 1);
        assert_eq!(s["prefix_groups"][0]["blocks"], 10);
        let t = &s["totals"];
        assert_eq!(t["requests"], 400);
        assert_eq!(t["cached_tokens"], 200 * 96);
        assert_eq!(t["known_prompt_tokens"], 400 * 160);
        assert_eq!(t["cached_ratio"], 0.3);
        assert_eq!(t["in_flight"], 0);
        let discount = t["realized_discount"].as_f64().expect("discount");
        assert!((discount - 0.27).abs() < 1e-12, "{discount}");
        assert_eq!(
            snapshot(&fleet, 5)["decisions"].as_array().map(Vec::len),
            Some(5)
        );
        // No worker has reported load: no tiers, nothing moved.
        let k = &s["kv_tiers"];
        assert_eq!(k["tiered_workers"], 0);
        assert_eq!(k["hits"]["host"], 0);
        assert_eq!(k["bytes_moved"]["promoted"], 0);
    }

    fn status(id: &str, tiers: Option<WorkerTiers>) -> WorkerStatus {
        WorkerStatus {
            id: id.into(),
            endpoint: format!("{id}:50051"),
            healthy: true,
            load: None,
            tiers,
            circuit: crate::circuit_breaker::CircuitState::Closed,
        }
    }

    #[test]
    fn tier_hits_and_bytes_moved_per_worker_sum_into_the_fleet_totals() {
        let tiered = WorkerTiers {
            tiered_workers: 1,
            prompt_tokens: 2_000,
            cached_tokens: 1_200,
            host_cached_tokens: 640,
            disk_cached_tokens: 160,
            peer_cached_tokens: 0,
            host_blocks: 90,
            host_bytes: 90 * 4096,
            disk_blocks: 200,
            disk_bytes: 200 * 4200,
            demoted_blocks: 120,
            demoted_bytes: 120 * 4096,
            demoted_off_thread_blocks: 90,
            promoted_host_blocks: 40,
            promoted_disk_blocks: 10,
            promoted_peer_blocks: 0,
            promoted_bytes: 50 * 4096,
            demotion_misses: 2,
            disk_faults: 1,
            ..WorkerTiers::default()
        };
        // No tiers of its own, but it pulled 3 blocks from a peer.
        let puller = WorkerTiers {
            prompt_tokens: 1_000,
            cached_tokens: 100,
            peer_cached_tokens: 48,
            peer_pulled_blocks: 3,
            peer_pulled_bytes: 3 * 4096,
            ..WorkerTiers::default()
        };
        let statuses = [
            status("w0", Some(tiered)),
            status("w1", Some(puller)),
            status("w2", None),
        ];
        let one = tiers_json(&tiered);
        assert_eq!(
            one["hits"],
            json!({"device": 400, "host": 640, "disk": 160, "peer": 0})
        );
        assert_eq!(one["hit_ratio"]["host"], 0.32);
        assert_eq!(one["hit_ratio"]["device"], 0.2);
        assert_eq!(
            one["bytes_moved"],
            json!({"demoted": 120 * 4096, "promoted": 50 * 4096, "peer_pulled": 0})
        );
        assert_eq!(one["blocks_moved"]["promoted_host"], 40);
        assert_eq!(one["blocks_moved"]["demoted_off_thread"], 90);
        assert_eq!(one["held"]["disk_bytes"], 200 * 4200);
        let fleet = tiers_json(&fleet_tiers(&statuses));
        assert_eq!(fleet["tiered_workers"], 1);
        assert_eq!(
            (
                fleet["prompt_tokens"].clone(),
                fleet["cached_tokens"].clone()
            ),
            (json!(3_000), json!(1_300))
        );
        assert_eq!(
            fleet["hits"],
            json!({"device": 452, "host": 640, "disk": 160, "peer": 48})
        );
        assert_eq!(fleet["hit_ratio"]["peer"], 0.016);
        assert_eq!(
            fleet["bytes_moved"],
            json!({"demoted": 120 * 4096, "promoted": 50 * 4096, "peer_pulled": 3 * 4096})
        );
        assert_eq!(fleet["blocks_moved"]["peer_pulled"], 3);
        assert_eq!(
            (
                fleet["demotion_misses"].clone(),
                fleet["disk_faults"].clone()
            ),
            (json!(2), json!(1))
        );
        let keys: Vec<&str> = fleet
            .as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default();
        assert_eq!(
            keys,
            [
                "tiered_workers",
                "prompt_tokens",
                "cached_tokens",
                "hits",
                "hit_ratio",
                "bytes_moved",
                "blocks_moved",
                "held",
                "demotion_misses",
                "disk_faults"
            ]
        );
    }
}
