//! `kvfleet bench tiers`: what host and disk tiers buy, and how the router should
//! price them. Each trace runs, side by side on one fleet and cost model:
//!
//! - `cache-aware` without tiers (device blocks only);
//! - `cache-aware` with tiers, hits priced by load time (kvfleet's default);
//! - `cache-aware` with tiers, hits priced by Dynamo-style fixed discounts (a host
//!   token saves 0.75 of a recompute, a disk token 0.25);
//! - `cache-aware` with tiers but tier-blind routing (host and disk hits score as
//!   misses; the workers still use them);
//! - `dynamo-kv-cost` (device overlap only) with tiers;
//! - `cache-aware` with peer pulls ([`PULL_MIN_BLOCKS`] blocks or more), without and
//!   with tiers: a prefix another worker holds is fetched instead of recomputed.
//!
//! The checks of issue 17: with tiers, the hit ratio is at least 0.85 × the ceiling,
//! and p99 TTFT no worse than without tiers.

use crate::bounds::{bounds_with_tiers, Bounds};
use crate::sim::cost_model::CostModel;
use crate::sim::{simulate, SimConfig, SimPolicy, SimResult};
use crate::trace::Trace;
use anyhow::Result;
use kvfleet_routing::policy::TierScoring;
use kvfleet_routing::PolicyKind;
use rayon::prelude::*;
use serde::Serialize;
use std::fmt::Write;

/// The smallest pull the pull variants make, in blocks.
pub const PULL_MIN_BLOCKS: usize = 4;

/// The fleet of a comparison.
#[derive(Clone, Debug)]
pub struct TierFleet {
    /// Workers.
    pub workers: usize,
    /// Device blocks per worker.
    pub device_blocks: usize,
    /// Host-tier blocks per worker.
    pub host_blocks: usize,
    /// Disk-tier blocks per worker.
    pub disk_blocks: usize,
}

/// One configuration of the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TierVariant {
    /// Row label.
    pub label: &'static str,
    /// Policy.
    #[serde(skip)]
    pub policy: SimPolicy,
    /// Whether the workers have host and disk tiers.
    pub tiers: bool,
    /// How the router scores tier hits.
    pub scoring: TierScoring,
    /// Whether the router may pull a prefix from a peer.
    pub pulls: bool,
}

/// The variants, in table order.
pub fn variants() -> Vec<TierVariant> {
    let ca = SimPolicy::Kvfleet(PolicyKind::CacheAware);
    vec![
        TierVariant {
            label: "cache-aware, no tiers",
            policy: ca,
            tiers: false,
            scoring: TierScoring::LoadTime,
            pulls: false,
        },
        TierVariant {
            label: "cache-aware, tiers, load-time pricing",
            policy: ca,
            tiers: true,
            scoring: TierScoring::LoadTime,
            pulls: false,
        },
        TierVariant {
            label: "cache-aware, tiers, Dynamo discounts 0.75 / 0.25",
            policy: ca,
            tiers: true,
            scoring: TierScoring::Discount,
            pulls: false,
        },
        TierVariant {
            label: "cache-aware, tiers, tier-blind routing",
            policy: ca,
            tiers: true,
            scoring: TierScoring::DeviceOnly,
            pulls: false,
        },
        TierVariant {
            label: "dynamo-kv-cost (device overlap), tiers",
            policy: SimPolicy::DynamoKvCost,
            tiers: true,
            scoring: TierScoring::LoadTime,
            pulls: false,
        },
        TierVariant {
            label: "cache-aware, no tiers, peer pulls",
            policy: ca,
            tiers: false,
            scoring: TierScoring::LoadTime,
            pulls: true,
        },
        TierVariant {
            label: "cache-aware, tiers and peer pulls",
            policy: ca,
            tiers: true,
            scoring: TierScoring::LoadTime,
            pulls: true,
        },
    ]
}

/// One row: a variant on a trace.
#[derive(Clone, Debug, Serialize)]
pub struct TierRow {
    /// Trace name.
    pub trace: String,
    /// The variant.
    pub variant: TierVariant,
    /// The trace's bounds on the fleet (with its tiers).
    pub bounds: Bounds,
    /// The simulation.
    pub result: SimResult,
}

/// Runs every variant on every trace, in parallel.
pub fn run_tiers(
    traces: &[(String, Trace)],
    fleet: &TierFleet,
    cost: &CostModel,
) -> Result<Vec<TierRow>> {
    let lower = fleet.host_blocks + fleet.disk_blocks;
    let bounds: Vec<Bounds> = traces
        .par_iter()
        .map(|(_, t)| bounds_with_tiers(t, fleet.workers, fleet.device_blocks, lower, cost))
        .collect();
    let jobs: Vec<(usize, TierVariant)> = (0..traces.len())
        .flat_map(|t| variants().into_iter().map(move |v| (t, v)))
        .collect();
    jobs.par_iter()
        .map(|&(t, v)| {
            let mut sc = SimConfig::new(fleet.workers, fleet.device_blocks, v.policy);
            sc.cost = cost.clone();
            if v.tiers {
                sc.host_blocks = fleet.host_blocks;
                sc.disk_blocks = fleet.disk_blocks;
            }
            sc.tier_scoring = v.scoring;
            if v.pulls {
                sc.peer_pull_min_blocks = PULL_MIN_BLOCKS;
            }
            Ok(TierRow {
                trace: traces[t].0.clone(),
                variant: v,
                bounds: bounds[t],
                result: simulate(&traces[t].1, &sc)?,
            })
        })
        .collect()
}

/// The comparison as Markdown: one table per trace, with the checks.
pub fn tiers_markdown(rows: &[TierRow], fleet: &TierFleet) -> String {
    let mut out = String::new();
    let mut names: Vec<&str> = rows.iter().map(|r| r.trace.as_str()).collect();
    names.dedup();
    for name in names {
        let rs: Vec<&TierRow> = rows.iter().filter(|r| r.trace == name).collect();
        let b = rs[0].bounds;
        let _ = writeln!(
            out,
            "### {name}\n\n{} workers × {} device blocks, {} host + {} disk blocks per worker. Ceiling **{:.3}**, pooled device bound {:.3}, pooled bound with tiers {:.3}.\n",
            fleet.workers,
            fleet.device_blocks,
            fleet.host_blocks,
            fleet.disk_blocks,
            b.ceiling,
            b.pooled,
            b.pooled_tiered
        );
        out.push_str("| configuration | hit ratio | ÷ ceiling | host hits | disk hits | peer hits | load time s | TTFT p50 ms | TTFT p99 ms | work max/mean |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for r in &rs {
            let x = &r.result;
            let _ = writeln!(
                out,
                "| {} | {:.3} | {:.2} | {:.3} | {:.3} | {:.3} | {:.1} | {:.0} | {:.0} | {:.2} |",
                r.variant.label,
                x.hit_ratio,
                x.hit_ratio / b.ceiling.max(1e-12),
                x.host_hit_blocks as f64 / x.total_blocks.max(1) as f64,
                x.disk_hit_blocks as f64 / x.total_blocks.max(1) as f64,
                x.peer_hit_blocks as f64 / x.total_blocks.max(1) as f64,
                x.tier_load_ms / 1000.0,
                x.ttft_ms.p50,
                x.ttft_ms.p99,
                x.work_max_over_mean
            );
        }
        if let (Some(none), Some(ours)) = (
            rs.iter().find(|r| !r.variant.tiers && !r.variant.pulls),
            rs.iter().find(|r| {
                r.variant.tiers
                    && !r.variant.pulls
                    && r.variant.scoring == TierScoring::LoadTime
                    && matches!(r.variant.policy, SimPolicy::Kvfleet(_))
            }),
        ) {
            let ratio = ours.result.hit_ratio / b.ceiling.max(1e-12);
            let _ = writeln!(
                out,
                "\nChecks (load-time pricing): hit ratio {:.3} = {:.2} × ceiling (target ≥ 0.85: **{}**); p99 TTFT {:.0} ms vs {:.0} ms without tiers (target no worse: **{}**).\n",
                ours.result.hit_ratio,
                ratio,
                if ratio >= 0.85 { "met" } else { "missed" },
                ours.result.ttft_ms.p99,
                none.result.ttft_ms.p99,
                if ours.result.ttft_ms.p99 <= none.result.ttft_ms.p99 { "met" } else { "missed" }
            );
        }
    }
    out
}
