//! The benchmark matrix behind `docs/benchmarks.md`: traces × fleet sizes × loads ×
//! policies, each row beside the ceiling and the pooled bound, plus the scale figure
//! (100k requests over 1,000 workers).
//!
//! Load is the arrival rate relative to the fleet's simulated capacity: the requests
//! per second the fleet could serve if every request hit the cache as often as the
//! pooled bound allows (`workers / (overhead + mean prompt × (1 − pooled) / prefill
//! rate)`). The trace's timestamps are scaled to reach that rate. For a trace whose
//! turns wait for their parents, the pooled bound is taken at the speed it is replayed
//! at (see [`LoadCalibration`]).

use crate::bounds::{bounds, has_parents, pooled_queue, Bounds, NoQueueReplay};
use crate::plots::{bar_chart, cdf_points, line_chart};
use crate::report::write_file;
use crate::sim::cost_model::CostModel;
use crate::sim::{
    comparison_pull_min_blocks, simulate, Percentiles, SimConfig, SimPolicy, SimResult,
};
use crate::trace::Trace;
use anyhow::Result;
use serde::Serialize;
use std::fmt::Write;
use std::path::Path;

/// One named trace of the matrix.
pub struct MatrixTrace {
    /// Short name.
    pub name: String,
    /// What it is.
    pub description: String,
    /// The trace.
    pub trace: Trace,
}

/// The matrix settings.
pub struct MatrixConfig {
    /// Traces.
    pub traces: Vec<MatrixTrace>,
    /// Fleet sizes.
    pub workers: Vec<usize>,
    /// Cache blocks per worker.
    pub cache_blocks: usize,
    /// (name, load factor).
    pub loads: Vec<(String, f64)>,
    /// Policies.
    pub policies: Vec<SimPolicy>,
    /// Cost model.
    pub cost: CostModel,
    /// `cache-aware`'s pull threshold (`None`: the serving default; see
    /// [`comparison_pull_min_blocks`]); the baselines never pull.
    pub peer_pull_min_blocks: Option<usize>,
}

/// One row: a simulation with its setup.
#[derive(Clone, Debug, Serialize)]
pub struct MatrixRow {
    /// Trace name.
    pub trace: String,
    /// Load name.
    pub load: String,
    /// Load factor.
    pub load_factor: f64,
    /// Arrival rate, requests/s.
    pub rate_rps: f64,
    /// The pooled bound at this speed, which the load is calibrated on (the bounds'
    /// `pooled` unless the trace's turns wait for their parents; see [`LoadCalibration`]).
    pub load_pooled: f64,
    /// The bounds.
    pub bounds: Bounds,
    /// TTFT at this load in one queue shared by the fleet's prefill lanes, with the
    /// fleet's memory as one LRU cache ([`crate::bounds::pooled_queue`]).
    pub pooled_queue_ms: Percentiles,
    /// The result.
    pub result: SimResult,
}

/// How a trace is sped up to reach a load: see [`LoadCalibration`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LoadScale {
    /// The factor every timestamp is multiplied by.
    pub scale: f64,
    /// The arrival rate reached, requests/s.
    pub rate: f64,
    /// The pooled bound the capacity assumes: over the no-queue start order at this
    /// speed ([`NoQueueReplay::pooled`]).
    pub pooled: f64,
}

/// The fleet's capacity in requests/s if every request hit the cache `pooled` of the
/// time.
fn capacity(mean_in: f64, workers: usize, pooled: f64, cost: &CostModel) -> f64 {
    let service_s = (cost.prefill_ms(0)
        + mean_in * (1.0 - pooled) * 1000.0 / cost.prefill_tokens_per_s)
        / 1000.0;
    workers as f64 / service_s
}

/// The time scale that brings a trace to `load ×` the capacity of a fleet, the
/// capacity taken at the pooled bound *at that speed*, for every load of one (trace,
/// fleet): what does not depend on the load is worked out once.
///
/// Without parents the trace's order does not depend on its speed and each load is
/// one closed form at the bounds' pooled bound. With parents a faster replay
/// interleaves more sessions (each turn waits for the one before, and decode time does
/// not shrink), which lowers the hits the fleet's memory can hold and with them its
/// capacity; the scale is then found by bisection. This keeps a multi-turn trace under
/// memory pressure from being called "light" at a rate where even one pooled cache
/// could not hold its sessions; queueing stretches sessions further, which no
/// policy-independent bound sees.
pub struct LoadCalibration<'a> {
    cost: &'a CostModel,
    workers: usize,
    /// The fleet's blocks (one pooled cache's size).
    blocks: usize,
    /// Mean prompt length, tokens.
    mean_in: f64,
    /// The trace's own arrival rate, requests/s.
    natural: f64,
    /// The pooled bound in the trace's order.
    pooled: f64,
    /// With parents: the trace prepared for the bisection.
    replay: Option<NoQueueReplay<'a>>,
}

impl<'a> LoadCalibration<'a> {
    /// `trace` on a fleet of `workers` with `bounds` (from [`bounds`] on that fleet).
    pub fn new(trace: &'a Trace, bounds: &Bounds, workers: usize, cost: &'a CostModel) -> Self {
        let n = trace.records.len().max(1) as f64;
        Self {
            cost,
            workers,
            blocks: bounds.pooled_blocks,
            mean_in: trace
                .records
                .iter()
                .map(|r| r.input_length as f64)
                .sum::<f64>()
                / n,
            natural: n / (trace.span_ms().max(1) as f64 / 1000.0),
            pooled: bounds.pooled,
            replay: has_parents(trace).then(|| NoQueueReplay::new(trace, cost)),
        }
    }

    /// The scale of `load` if the fleet hit the cache `pooled` of the time.
    fn at_pooled(&self, load: f64, pooled: f64) -> LoadScale {
        let rate = load * capacity(self.mean_in, self.workers, pooled, self.cost);
        LoadScale {
            scale: self.natural / rate,
            rate,
            pooled,
        }
    }

    /// The time scale of `load`.
    pub fn at(&self, load: f64) -> LoadScale {
        let Some(replay) = &self.replay else {
            return self.at_pooled(load, self.pooled);
        };
        // The scale lies between those of the capacities at all hits and at none;
        // bisect on its logarithm to 1%. The pooled bound rises with the scale, so the
        // scale the load asks for falls with it: the answer is where the two meet.
        let (mut lo, mut hi) = (
            self.at_pooled(load, 1.0).scale.ln(),
            self.at_pooled(load, 0.0).scale.ln(),
        );
        let run = |ln_scale: f64| {
            let scale = ln_scale.exp();
            let pooled = replay.pooled(self.blocks, scale);
            (
                self.at_pooled(load, pooled).scale,
                LoadScale {
                    scale,
                    rate: self.natural / scale,
                    pooled,
                },
            )
        };
        let mut best = run(hi).1;
        while hi - lo > 0.01 {
            let mid = 0.5 * (lo + hi);
            let (asked, got) = run(mid);
            if mid < asked.ln() {
                // Replayed this fast, the trace arrives faster than the load asks for.
                lo = mid;
            } else {
                hi = mid;
                best = got;
            }
        }
        best
    }
}

/// [`LoadCalibration::at`] for one load.
pub fn load_scale(
    trace: &Trace,
    bounds: &Bounds,
    workers: usize,
    cost: &CostModel,
    load: f64,
) -> LoadScale {
    LoadCalibration::new(trace, bounds, workers, cost).at(load)
}

/// Runs the matrix.
pub fn run_matrix(
    cfg: &MatrixConfig,
    mut progress: impl FnMut(&MatrixRow),
) -> Result<Vec<MatrixRow>> {
    let mut rows = Vec::new();
    for t in &cfg.traces {
        for &n in &cfg.workers {
            let b = bounds(&t.trace, n, cfg.cache_blocks, &cfg.cost);
            let calibration = LoadCalibration::new(&t.trace, &b, n, &cfg.cost);
            for (load, factor) in &cfg.loads {
                let ls = calibration.at(*factor);
                let (scaled, rate) = (t.trace.scaled_time(ls.scale), ls.rate);
                let pooled_queue_ms = pooled_queue(&scaled, n, cfg.cache_blocks, &cfg.cost);
                for &p in &cfg.policies {
                    let mut sc = SimConfig::new(n, cfg.cache_blocks, p);
                    sc.cost = cfg.cost.clone();
                    sc.peer_pull_min_blocks = comparison_pull_min_blocks(
                        p,
                        cfg.peer_pull_min_blocks,
                        scaled.block_size(),
                    );
                    let result = simulate(&scaled, &sc)?;
                    let row = MatrixRow {
                        trace: t.name.clone(),
                        load: load.clone(),
                        load_factor: *factor,
                        rate_rps: rate,
                        load_pooled: ls.pooled,
                        bounds: b,
                        pooled_queue_ms,
                        result,
                    };
                    progress(&row);
                    rows.push(row);
                }
            }
        }
    }
    Ok(rows)
}

const BASELINES: [&str; 6] = [
    "sglang-cache-aware",
    "sglang-spill",
    "dynamo-kv-cost",
    "dynamo-lmetric",
    "round-robin",
    "consistent-hash",
];

/// The target check of one (trace, workers, load) group: cache-aware's p99 TTFT
/// against the best baseline's, and its hit ratio against the best baseline's.
#[derive(Clone, Debug, Serialize)]
pub struct TargetCheck {
    /// Trace.
    pub trace: String,
    /// Workers.
    pub workers: usize,
    /// Load.
    pub load: String,
    /// cache-aware p99 / best baseline p99 (target ≤ 0.8).
    pub p99_ratio: f64,
    /// The baseline with the best p99.
    pub best_p99_baseline: String,
    /// cache-aware hit / best baseline hit (target ≥ 0.95).
    pub hit_ratio_ratio: f64,
    /// The baseline with the best hit ratio.
    pub best_hit_baseline: String,
    /// Both targets met.
    pub met: bool,
}

/// The target checks of `rows`.
pub fn target_checks(rows: &[MatrixRow]) -> Vec<TargetCheck> {
    let mut out = Vec::new();
    for ours in rows.iter().filter(|r| r.result.policy == "cache-aware") {
        let group: Vec<&MatrixRow> = rows
            .iter()
            .filter(|r| {
                r.trace == ours.trace
                    && r.load == ours.load
                    && r.result.workers == ours.result.workers
                    && BASELINES.contains(&r.result.policy.as_str())
            })
            .collect();
        let Some(best_p99) = group
            .iter()
            .min_by(|a, b| a.result.ttft_ms.p99.total_cmp(&b.result.ttft_ms.p99))
        else {
            continue;
        };
        let Some(best_hit) = group
            .iter()
            .max_by(|a, b| a.result.hit_ratio.total_cmp(&b.result.hit_ratio))
        else {
            continue;
        };
        let p99_ratio = ours.result.ttft_ms.p99 / best_p99.result.ttft_ms.p99.max(1e-9);
        let hit_ratio_ratio = ours.result.hit_ratio / best_hit.result.hit_ratio.max(1e-12);
        out.push(TargetCheck {
            trace: ours.trace.clone(),
            workers: ours.result.workers,
            load: ours.load.clone(),
            p99_ratio,
            best_p99_baseline: best_p99.result.policy.clone(),
            hit_ratio_ratio,
            best_hit_baseline: best_hit.result.policy.clone(),
            met: p99_ratio <= 0.8 && hit_ratio_ratio >= 0.95,
        });
    }
    out
}

/// Writes the matrix tables and plots: `md` gets the Markdown, `plots` the SVGs
/// (referenced as `plots/NAME.svg`).
pub fn matrix_markdown(cfg: &MatrixConfig, rows: &[MatrixRow], plots: &Path) -> Result<String> {
    let mut s = String::new();
    let checks = target_checks(rows);
    s.push_str("### Target check: `cache-aware` vs. the best baseline\n\n");
    s.push_str("Target: p99 TTFT ≤ 0.8 × the best baseline's and hit ratio ≥ 0.95 × the best baseline's (baselines: SGLang cache_aware and its spill rule, Dynamo KV cost and lmetric, round-robin, consistent-hash).\n\n");
    s.push_str("| trace | workers | load | p99 / best p99 | best-p99 baseline | hit / best hit | best-hit baseline | met |\n| --- | ---: | --- | ---: | --- | ---: | --- | --- |\n");
    for c in &checks {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.2} | {} | {:.3} | {} | {} |",
            c.trace,
            c.workers,
            c.load,
            c.p99_ratio,
            c.best_p99_baseline,
            c.hit_ratio_ratio,
            c.best_hit_baseline,
            if c.met { "yes" } else { "**no**" }
        );
    }
    let met = checks.iter().filter(|c| c.met).count();
    let _ = writeln!(s, "\nMet in {met} of {} groups.\n", checks.len());
    for t in &cfg.traces {
        let _ = writeln!(s, "### Trace `{}`\n\n{}\n", t.name, t.description);
        for &n in &cfg.workers {
            for (load, _) in &cfg.loads {
                let group: Vec<&MatrixRow> = rows
                    .iter()
                    .filter(|r| r.trace == t.name && r.result.workers == n && &r.load == load)
                    .collect();
                let Some(first) = group.first() else { continue };
                let b = first.bounds;
                let _ = writeln!(
                    s,
                    "**{} workers × {} blocks, load {} ({:.2} × capacity, {:.1} req/s)** — ceiling **{:.3}**, pooled bound **{:.3}**\n",
                    n, cfg.cache_blocks, load, first.load_factor, first.rate_rps, b.ceiling, b.pooled
                );
                s.push_str("| policy | hit ratio | / pooled | / ceiling | prefill Mtok | work max/mean | TTFT p50 ms | p90 | p99 | input cost |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
                for r in &group {
                    let x = &r.result;
                    let _ = writeln!(
                        s,
                        "| {} | {:.3} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.0} | {:.3} |",
                        x.policy,
                        x.hit_ratio,
                        x.hit_ratio / b.pooled.max(1e-12),
                        x.hit_ratio / b.ceiling.max(1e-12),
                        x.prefill_tokens as f64 / 1e6,
                        x.work_max_over_mean,
                        x.ttft_ms.p50,
                        x.ttft_ms.p90,
                        x.ttft_ms.p99,
                        x.input_cost_relative
                    );
                }
                s.push('\n');
            }
        }
        // Plots for the smallest fleet at the middle load.
        let n = cfg.workers[0];
        let mid = &cfg.loads[cfg.loads.len() / 2].0;
        let group: Vec<&MatrixRow> = rows
            .iter()
            .filter(|r| r.trace == t.name && r.result.workers == n && &r.load == mid)
            .collect();
        if !group.is_empty() {
            let cdf: Vec<(String, Vec<(f64, f64)>)> = group
                .iter()
                .map(|r| {
                    (
                        r.result.policy.clone(),
                        cdf_points(&r.result.ttft_samples, 200),
                    )
                })
                .collect();
            let name = format!("{}_{}w_{}_ttft_cdf.svg", t.name, n, mid);
            write_file(
                plots,
                &name,
                &line_chart(
                    &format!("TTFT CDF — {} , {} workers, {}", t.name, n, mid),
                    "TTFT ms (log)",
                    "fraction",
                    &cdf,
                    true,
                ),
            )?;
            let hits: Vec<(String, Vec<(f64, f64)>)> = group
                .iter()
                .map(|r| (r.result.policy.clone(), r.result.hit_timeline.clone()))
                .collect();
            let hname = format!("{}_{}w_{}_hit_ratio.svg", t.name, n, mid);
            write_file(
                plots,
                &hname,
                &line_chart(
                    &format!("Hit ratio over time — {}, {} workers, {}", t.name, n, mid),
                    "arrival time s",
                    "hit ratio",
                    &hits,
                    false,
                ),
            )?;
            let _ = writeln!(
                s,
                "![TTFT CDF](plots/{name})\n![hit ratio over time](plots/{hname})\n"
            );
            for pol in ["cache-aware", "sglang-cache-aware"] {
                if let Some(r) = group.iter().find(|r| r.result.policy == pol) {
                    let bars: Vec<(String, f64)> = r
                        .result
                        .worker_prefill_tokens
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| (i.to_string(), v as f64))
                        .collect();
                    let lname = format!("{}_{}w_{}_{}_load.svg", t.name, n, mid, pol);
                    write_file(
                        plots,
                        &lname,
                        &bar_chart(
                            &format!("Prefill tokens per worker — {pol}"),
                            "tokens",
                            &bars,
                        ),
                    )?;
                    let _ = writeln!(s, "![per-worker load, {pol}](plots/{lname})");
                }
            }
            s.push('\n');
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bounds::{distinct_blocks_of, pooled, pooled_no_queue};
    use crate::trace_gen::{generate, GenConfig};

    /// Multi-turn conversations whose turns wait for their parents.
    fn conversations() -> Trace {
        generate(&GenConfig::conversation(100, 8_000)).unwrap()
    }

    #[test]
    fn without_parents_the_load_is_the_closed_form_at_the_pooled_bound() {
        let mut t = conversations();
        for r in &mut t.records {
            r.parent_id = None;
        }
        let cost = CostModel::h200_llama8b();
        let (workers, blocks) = (8, distinct_blocks_of(&t) * 3 / 10 / 8);
        let ls = load_scale(&t, &bounds(&t, workers, blocks, &cost), workers, &cost, 0.5);
        assert_eq!(ls.pooled, pooled(&t, workers * blocks));
        let mean_in =
            t.records.iter().map(|r| r.input_length as f64).sum::<f64>() / t.records.len() as f64;
        let want = 0.5 * capacity(mean_in, workers, ls.pooled, &cost);
        assert!(
            (ls.rate - want).abs() < 1e-9 * want,
            "{} vs {want}",
            ls.rate
        );
    }

    #[test]
    fn with_parents_a_faster_replay_is_priced_at_the_hits_memory_holds_at_that_speed() {
        let t = conversations();
        let cost = CostModel::h200_llama8b();
        let (workers, blocks) = (8, distinct_blocks_of(&t) * 3 / 10 / 8);
        let fixed = pooled(&t, workers * blocks);
        let mean_in =
            t.records.iter().map(|r| r.input_length as f64).sum::<f64>() / t.records.len() as f64;
        let mut last = f64::INFINITY;
        let b = bounds(&t, workers, blocks, &cost);
        for load in [0.5, 0.9, 1.3] {
            let ls = load_scale(&t, &b, workers, &cost, load);
            // Replayed this fast, sessions overlap more than in the trace's own
            // order, so one pooled cache holds fewer of them...
            assert!(ls.pooled < fixed, "{} vs {fixed}", ls.pooled);
            assert!(ls.pooled <= last, "higher loads hold fewer hits");
            last = ls.pooled;
            // ...the pooled bound is that of the order at the chosen speed...
            let at = pooled_no_queue(&t, workers * blocks, ls.scale, &cost);
            assert_eq!(ls.pooled, at);
            // ...and the rate is at most the load's share of the capacity at those
            // hits (the bound moves in steps; the bisection ends on a step's slow
            // side), and not far below it.
            let want = load * capacity(mean_in, workers, ls.pooled, &cost);
            assert!(ls.rate <= want * 1.011, "{} vs {want}", ls.rate);
            assert!(ls.rate >= want * 0.8, "{} vs {want}", ls.rate);
            // The old calibration, at the fixed bound, asked for a faster replay.
            let old = load * capacity(mean_in, workers, fixed, &cost);
            assert!(ls.rate < old, "{} vs {old}", ls.rate);
        }
    }
}
