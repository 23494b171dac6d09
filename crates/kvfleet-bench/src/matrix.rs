//! The benchmark matrix behind `docs/benchmarks.md`: traces × fleet sizes × loads ×
//! policies, each row beside the ceiling and the pooled bound, plus the scale figure
//! (100k requests over 1,000 workers).
//!
//! Load is the arrival rate relative to the fleet's simulated capacity: the requests
//! per second the fleet could serve if every request hit the cache as often as the
//! pooled bound allows (`workers / (overhead + mean prompt × (1 − pooled) / prefill
//! rate)`). The trace's timestamps are scaled to reach that rate.

use crate::bounds::{bounds, Bounds};
use crate::plots::{bar_chart, cdf_points, line_chart};
use crate::report::write_file;
use crate::sim::cost_model::CostModel;
use crate::sim::{comparison_pull_min_blocks, simulate, SimConfig, SimPolicy, SimResult};
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
    /// The bounds.
    pub bounds: Bounds,
    /// The result.
    pub result: SimResult,
}

/// Time-scale factor that brings `trace` to `load × capacity`.
pub fn load_scale(
    trace: &Trace,
    workers: usize,
    pooled: f64,
    cost: &CostModel,
    load: f64,
) -> (f64, f64) {
    let n = trace.records.len().max(1) as f64;
    let mean_in = trace
        .records
        .iter()
        .map(|r| r.input_length as f64)
        .sum::<f64>()
        / n;
    let service_s = (cost.prefill_ms(0)
        + mean_in * (1.0 - pooled) * 1000.0 / cost.prefill_tokens_per_s)
        / 1000.0;
    let capacity = workers as f64 / service_s;
    let rate = load * capacity;
    let natural = n / (trace.span_ms().max(1) as f64 / 1000.0);
    (natural / rate, rate)
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
            for (load, factor) in &cfg.loads {
                let (scale, rate) = load_scale(&t.trace, n, b.pooled, &cfg.cost, *factor);
                let scaled = t.trace.scaled_time(scale);
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
                        bounds: b,
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
