//! `kvfleet bench sweep`: does a policy generalize? Every policy runs over a family of
//! generated traces (multi-turn conversations under memory pressure, fork fan-outs, a
//! herd sharing one system prompt, mixed tenants, bursty arrivals, fork fan-outs with
//! prompts short enough that per-request overhead outweighs the prefill) and the shared
//! Mooncake trace, at several fleet sizes and three loads, and `cache-aware` is checked
//! against the best baseline of each group:
//!
//! - its hit ratio is at least the best baseline's;
//! - its p99 TTFT excess over the no-queue floor (p99 − the floor's p99) is at most
//!   half the best baseline's;
//! - no request waited behind others while a worker sat idle long enough that
//!   recomputing its whole prompt there would have been faster
//!   ([`SimResult::avoidable_waits`](crate::sim::SimResult::avoidable_waits); waiting
//!   for a request ahead to compute the request's own prefix is not waiting behind
//!   others).
//!
//! Loads are fractions of the fleet's capacity at the pooled bound at the replay's
//! speed ([`LoadCalibration`]): a multi-turn trace replayed faster interleaves more
//! sessions, and a "light" load must not already exceed what the fleet's memory holds.
//!
//! Each generated trace has `sessions_per_worker × workers` sessions (so a large fleet
//! still sees enough traffic to warm up) and its own memory budget: a fraction of the
//! trace's distinct blocks, spread over the fleet, so memory is short at every size.

use crate::bounds::{bounds, distinct_blocks_of, pooled_queue};
use crate::matrix::{LoadCalibration, MatrixRow};
use crate::sim::cost_model::CostModel;
use crate::sim::sglang_cache_aware::SglangConfig;
use crate::sim::{comparison_pull_min_blocks, simulate, SimConfig, SimPolicy};
use crate::trace::Trace;
use crate::trace_gen::{generate, Arrival, GenConfig};
use anyhow::Result;
use kvfleet_routing::RouterConfig;
use rayon::prelude::*;
use serde::Serialize;
use std::fmt::Write;

/// One trace of the sweep, sized for one fleet.
pub struct SweepTrace {
    /// Short name.
    pub name: String,
    /// What it is.
    pub description: String,
    /// The trace.
    pub trace: Trace,
    /// Cache blocks per worker.
    pub cache_blocks: usize,
}

/// The sweep's settings.
#[derive(Clone)]
pub struct SweepConfig {
    /// Fleet sizes.
    pub workers: Vec<usize>,
    /// (name, load factor), as in the matrix.
    pub loads: Vec<(String, f64)>,
    /// Policies; `cache-aware` is checked against the others.
    pub policies: Vec<SimPolicy>,
    /// Cost model.
    pub cost: CostModel,
    /// kvfleet router settings (the `cache-aware` weights under test).
    pub router: RouterConfig,
    /// Sessions per worker of each generated trace.
    pub sessions_per_worker: usize,
    /// Fewest sessions of a generated trace.
    pub min_sessions: usize,
    /// Seed offset of the generated traces (a second family for a held-out check).
    pub seed: u64,
    /// The shared Mooncake trace, run at 1,000 blocks per worker, if given.
    pub mooncake: Option<Trace>,
    /// Only these trace names (all when empty).
    pub only: Vec<String>,
    /// `cache-aware` pulls a prefix from a peer when it gains at least this many
    /// blocks (0: no pulls; `None`: the serving default for the trace's block size,
    /// see [`comparison_pull_min_blocks`]); the baselines never pull.
    pub peer_pull_min_blocks: Option<usize>,
    /// Simulate with every request's blocks held as an engine holds them
    /// ([`SimConfig::hold_blocks`](crate::sim::SimConfig::hold_blocks)).
    pub hold_blocks: bool,
    /// Simulate with each request's hits taken when its prefill starts
    /// ([`SimConfig::hits_at_admission`](crate::sim::SimConfig::hits_at_admission)).
    pub hits_at_admission: bool,
    /// Simulate with the engine's memory rule
    /// ([`SimConfig::decode_reserve`](crate::sim::SimConfig::decode_reserve)).
    pub decode_reserve: Option<kvfleet_core::decode_reserve::DecodeReserveConfig>,
    /// Prefills share their worker's decode steps
    /// ([`SimConfig::mixed_steps`](crate::sim::SimConfig::mixed_steps)).
    pub mixed_steps: bool,
    /// The SGLang baselines' settings.
    pub sglang: SglangConfig,
}

/// The generated family for a fleet of `workers`, each with its memory budget.
pub fn family(cfg: &SweepConfig, workers: usize) -> Result<Vec<SweepTrace>> {
    let sessions = cfg.min_sessions.max(cfg.sessions_per_worker * workers);
    let seed = cfg.seed * 100;
    // (name, description, generator settings, memory as a fraction of distinct blocks,
    // tokens per hash id if not the generator's)
    let members: Vec<(&str, &str, GenConfig, f64, Option<usize>)> = vec![
        (
            "conversation",
            "multi-turn conversations, no forks: 2k system + 1k tools + 1k history, 12 turns of +768 tokens and 256-token answers, 8 s apart; memory 30% of the distinct blocks",
            GenConfig {
                seed: seed + 1,
                ..GenConfig::conversation(sessions, 8_000)
            },
            0.3,
            None,
        ),
        (
            "fork",
            "fork fan-out (`bench gen` defaults: 46k-token prompts, 3 parent turns, K=5 children of 3 turns); memory 50% of the distinct blocks",
            GenConfig {
                sessions,
                seed: seed + 2,
                ..GenConfig::default()
            },
            0.5,
            None,
        ),
        (
            "herd",
            "as `fork`, every session sharing one 16k-token system prompt and tools; memory 50%",
            GenConfig {
                sessions,
                shared_prefix: true,
                seed: seed + 3,
                ..GenConfig::default()
            },
            0.5,
            None,
        ),
        (
            "tenants",
            "as `herd`, over 8 tenants, each with its own shared prefix; memory 50%",
            GenConfig {
                sessions,
                tenants: 8,
                shared_prefix: true,
                seed: seed + 4,
                ..GenConfig::default()
            },
            0.5,
            None,
        ),
        (
            "bursty",
            "as `fork`, sessions arriving in bursts of 8 at one instant; memory 50%",
            GenConfig {
                sessions,
                arrival: Arrival::Bursty,
                seed: seed + 5,
                ..GenConfig::default()
            },
            0.5,
            None,
        ),
        (
            "short",
            "fork fan-out with short prompts, as `scripts/bench_engine_sim.sh` replays it: 1k system + 1k tools + 1k history, 2 parent turns of +256, K=4 children of 1 turn, 4-token answers, then 16 tokens per hash id (prompts of about 120 tokens, where the 20 ms per-request overhead outweighs the prefill); memory 50%",
            GenConfig {
                sessions,
                system_tokens: 1_024,
                tools_tokens: 1_024,
                history_tokens: 1_024,
                turn_tokens: 256,
                parent_turns: 2,
                child_turns: 1,
                fork_k: 4,
                output_tokens: 4,
                turn_gap_ms: 200,
                seed: seed + 6,
                ..GenConfig::default()
            },
            0.5,
            Some(16),
        ),
    ];
    let mut out = Vec::new();
    for (name, description, gen, frac, tokens_per_id) in members {
        if !cfg.only.is_empty() && !cfg.only.iter().any(|o| o == name) {
            continue;
        }
        let trace = generate(&gen)?;
        let trace = match tokens_per_id {
            Some(n) => trace.with_tokens_per_id(n),
            None => trace,
        };
        let blocks = distinct_blocks_of(&trace);
        out.push(SweepTrace {
            name: name.into(),
            description: format!("{description} ({sessions} sessions)"),
            cache_blocks: ((blocks as f64 * frac / workers as f64) as usize).max(8),
            trace,
        });
    }
    if let Some(m) = &cfg.mooncake {
        if cfg.only.is_empty() || cfg.only.iter().any(|o| o == "mooncake") {
            out.push(SweepTrace {
                name: "mooncake".into(),
                description: format!(
                    "the shared Mooncake synthetic trace ({} requests), 1,000 blocks per worker",
                    m.records.len()
                ),
                trace: m.clone(),
                cache_blocks: 1000,
            });
        }
    }
    Ok(out)
}

/// Runs every (fleet, trace, load, policy) simulation, in parallel.
pub fn run_sweep(cfg: &SweepConfig) -> Result<Vec<MatrixRow>> {
    struct Job {
        trace: String,
        scaled: Trace,
        workers: usize,
        cache_blocks: usize,
        load: (String, f64),
        rate: f64,
        load_pooled: f64,
        bounds: crate::bounds::Bounds,
        pooled_queue_ms: crate::sim::Percentiles,
    }
    // Every (fleet, trace) pair with its bounds, then every load of each: the
    // calibration bisects over the trace for traces with parents, so both run in
    // parallel.
    let mut traces = Vec::new();
    for &n in &cfg.workers {
        traces.extend(family(cfg, n)?.into_iter().map(|t| (n, t)));
    }
    let jobs: Vec<Job> = traces
        .par_iter()
        .flat_map(|(n, t)| {
            let b = bounds(&t.trace, *n, t.cache_blocks, &cfg.cost);
            let calibration = LoadCalibration::new(&t.trace, &b, *n, &cfg.cost);
            cfg.loads.par_iter().map(move |load| {
                let ls = calibration.at(load.1);
                let scaled = t.trace.scaled_time(ls.scale);
                Job {
                    trace: t.name.clone(),
                    pooled_queue_ms: pooled_queue(&scaled, *n, t.cache_blocks, &cfg.cost),
                    scaled,
                    workers: *n,
                    cache_blocks: t.cache_blocks,
                    load: load.clone(),
                    rate: ls.rate,
                    load_pooled: ls.pooled,
                    bounds: b,
                }
            })
        })
        .collect();
    let work: Vec<(&Job, SimPolicy)> = jobs
        .iter()
        .flat_map(|j| cfg.policies.iter().map(move |&p| (j, p)))
        .collect();
    work.par_iter()
        .map(|(j, p)| {
            let mut sc = SimConfig::new(j.workers, j.cache_blocks, *p);
            sc.cost = cfg.cost.clone();
            sc.router = cfg.router.clone();
            sc.peer_pull_min_blocks =
                comparison_pull_min_blocks(*p, cfg.peer_pull_min_blocks, j.scaled.block_size());
            sc.hold_blocks = cfg.hold_blocks;
            sc.hits_at_admission = cfg.hits_at_admission;
            sc.decode_reserve = cfg.decode_reserve;
            sc.mixed_steps = cfg.mixed_steps;
            sc.sglang = cfg.sglang.clone();
            let result = simulate(&j.scaled, &sc)?;
            Ok(MatrixRow {
                trace: j.trace.clone(),
                load: j.load.0.clone(),
                load_factor: j.load.1,
                rate_rps: j.rate,
                load_pooled: j.load_pooled,
                bounds: j.bounds,
                pooled_queue_ms: j.pooled_queue_ms,
                result,
            })
        })
        .collect()
}

/// The check of one (trace, fleet, load) group.
#[derive(Clone, Debug, Serialize)]
pub struct SweepCheck {
    /// Trace.
    pub trace: String,
    /// Workers.
    pub workers: usize,
    /// Cache blocks per worker.
    pub cache_blocks: usize,
    /// Load.
    pub load: String,
    /// The pooled bound.
    pub pooled: f64,
    /// The pooled bound the load was calibrated on: at the replay's speed (the same
    /// as `pooled` for a trace without parents; see [`LoadCalibration`]).
    pub load_pooled: f64,
    /// cache-aware's hit ratio.
    pub hit: f64,
    /// The best baseline hit ratio, and whose.
    pub best_hit: f64,
    /// The baseline with the best hit ratio.
    pub best_hit_baseline: String,
    /// The no-queue floor's p99, ms.
    pub floor_p99_ms: f64,
    /// cache-aware's p99 TTFT over the floor's p99, ms.
    pub excess_ms: f64,
    /// The smallest baseline excess, ms.
    pub best_excess_ms: f64,
    /// The baseline with the smallest excess.
    pub best_excess_baseline: String,
    /// `excess_ms / best_excess_ms` (each at least 1 ms).
    pub excess_ratio: f64,
    /// The p99 excess of one queue shared by every prefill lane, with the fleet's
    /// memory as one LRU cache ([`pooled_queue`]), ms: about the part of any policy's
    /// excess the load and the memory cause.
    pub pooled_queue_excess_ms: f64,
    /// Whether half the best baseline's excess is at least the pooled queue's: where
    /// it is not, the p99 target asks for less queueing than pooling every lane and
    /// all memory gives.
    pub excess_reachable: bool,
    /// cache-aware's avoidable waits.
    pub avoidable_waits: usize,
    /// cache-aware's busiest worker's prefill work over the mean.
    pub work_max_over_mean: f64,
    /// hit ≥ best baseline hit (within 0.002, the simulator's noise between runs).
    pub hit_met: bool,
    /// excess ≤ 0.5 × the best baseline's.
    pub excess_met: bool,
    /// No avoidable wait.
    pub idle_met: bool,
}

/// Hit ratios within this of each other count as equal.
pub const HIT_TOLERANCE: f64 = 0.002;

/// The checks of `rows` (policy `ours` against every other policy of each group).
pub fn sweep_checks(rows: &[MatrixRow], ours: &str) -> Vec<SweepCheck> {
    let excess = |r: &MatrixRow| (r.result.ttft_ms.p99 - r.bounds.no_queue_floor_ms.p99).max(0.0);
    let mut out = Vec::new();
    for o in rows.iter().filter(|r| r.result.policy == ours) {
        let group: Vec<&MatrixRow> = rows
            .iter()
            .filter(|r| {
                r.trace == o.trace
                    && r.load == o.load
                    && r.result.workers == o.result.workers
                    && r.result.policy != ours
            })
            .collect();
        let (Some(bh), Some(be)) = (
            group
                .iter()
                .max_by(|a, b| a.result.hit_ratio.total_cmp(&b.result.hit_ratio)),
            group.iter().min_by(|a, b| excess(a).total_cmp(&excess(b))),
        ) else {
            continue;
        };
        let ex = excess(o);
        let bex = excess(be);
        let ratio = ex.max(1.0) / bex.max(1.0);
        let pooled_ex = (o.pooled_queue_ms.p99 - o.bounds.no_queue_floor_ms.p99).max(0.0);
        out.push(SweepCheck {
            trace: o.trace.clone(),
            workers: o.result.workers,
            cache_blocks: o.result.cache_blocks,
            load: o.load.clone(),
            pooled: o.bounds.pooled,
            load_pooled: o.load_pooled,
            hit: o.result.hit_ratio,
            best_hit: bh.result.hit_ratio,
            best_hit_baseline: bh.result.policy.clone(),
            floor_p99_ms: o.bounds.no_queue_floor_ms.p99,
            excess_ms: ex,
            best_excess_ms: bex,
            best_excess_baseline: be.result.policy.clone(),
            excess_ratio: ratio,
            pooled_queue_excess_ms: pooled_ex,
            excess_reachable: 0.5 * bex.max(1.0) >= pooled_ex,
            avoidable_waits: o.result.avoidable_waits,
            work_max_over_mean: o.result.work_max_over_mean,
            hit_met: o.result.hit_ratio + HIT_TOLERANCE >= bh.result.hit_ratio,
            excess_met: ratio <= 0.5,
            idle_met: o.result.avoidable_waits == 0,
        });
    }
    out
}

/// The sweep's Markdown: the check table, the worst cases, and a summary line.
pub fn sweep_markdown(checks: &[SweepCheck]) -> String {
    let mut s = String::new();
    let n = checks.len();
    let hit = checks.iter().filter(|c| c.hit_met).count();
    let ex = checks.iter().filter(|c| c.excess_met).count();
    let idle = checks.iter().filter(|c| c.idle_met).count();
    let all = checks
        .iter()
        .filter(|c| c.hit_met && c.excess_met && c.idle_met)
        .count();
    let _ = writeln!(
        s,
        "All three met in **{all} of {n}** groups: hit ratio ≥ the best baseline's in {hit}, p99 excess ≤ 0.5 × the best baseline's in {ex}, no avoidable wait in {idle}.\n"
    );
    let missed = checks.iter().filter(|c| !c.excess_met).count();
    let unreachable = checks
        .iter()
        .filter(|c| !c.excess_met && !c.excess_reachable)
        .count();
    let _ = writeln!(
        s,
        "Of the {missed} groups missing the p99 target, {unreachable} ask for less queueing than the *pooled queue* has (every prefill lane sharing one queue, the fleet's memory one LRU cache: perfect routing with pooled lanes and memory): half the best baseline's excess is below its excess.\n"
    );
    let worst_hit = checks
        .iter()
        .min_by(|a, b| (a.hit - a.best_hit).total_cmp(&(b.hit - b.best_hit)));
    let worst_ex = checks
        .iter()
        .max_by(|a, b| a.excess_ratio.total_cmp(&b.excess_ratio));
    let worst_idle = checks.iter().max_by_key(|c| c.avoidable_waits);
    let name = |c: &SweepCheck| format!("`{}` at {} workers, {} load", c.trace, c.workers, c.load);
    if let Some(c) = worst_hit {
        let _ = writeln!(
            s,
            "- Worst hit ratio: {}: {:.3} against {}'s {:.3}.",
            name(c),
            c.hit,
            c.best_hit_baseline,
            c.best_hit
        );
    }
    if let Some(c) = worst_ex {
        let _ = writeln!(
            s,
            "- Worst p99 excess: {}: {:.0} ms over the floor against {}'s {:.0} ms ({:.2}×).",
            name(c),
            c.excess_ms,
            c.best_excess_baseline,
            c.best_excess_ms,
            c.excess_ratio
        );
    }
    if let Some(c) = worst_idle {
        let _ = writeln!(
            s,
            "- Most avoidable waits: {}: {}.",
            name(c),
            c.avoidable_waits
        );
    }
    s.push_str("\n| trace | workers | blocks/worker | load | pooled (at the load's speed) | hit | best baseline hit | floor p99 ms | excess ms | best baseline excess ms | excess ratio | pooled queue excess ms | avoidable waits | work max/mean | met |\n| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |\n");
    for c in checks {
        let met = match (c.hit_met, c.excess_met, c.idle_met) {
            (true, true, true) => "yes".to_string(),
            (h, e, i) => {
                let mut miss = Vec::new();
                if !h {
                    miss.push("hit");
                }
                if !e {
                    miss.push("p99");
                }
                if !i {
                    miss.push("idle");
                }
                format!("**no** ({})", miss.join(", "))
            }
        };
        // The trace-order bound, and the one the load assumed where they differ.
        let pooled = if (c.load_pooled - c.pooled).abs() < 5e-4 {
            format!("{:.3}", c.pooled)
        } else {
            format!("{:.3} ({:.3})", c.pooled, c.load_pooled)
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} ({}) | {:.0} | {:.0} | {:.0} ({}) | {:.2} | {:.0} | {} | {:.2} | {} |",
            c.trace,
            c.workers,
            c.cache_blocks,
            c.load,
            pooled,
            c.hit,
            c.best_hit,
            c.best_hit_baseline,
            c.floor_p99_ms,
            c.excess_ms,
            c.best_excess_ms,
            c.best_excess_baseline,
            c.excess_ratio,
            c.pooled_queue_excess_ms,
            c.avoidable_waits,
            c.work_max_over_mean,
            met
        );
    }
    s
}
