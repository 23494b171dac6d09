//! Reports: JSON, Markdown and SVG plots for simulations and replays.

use crate::bounds::Bounds;
use crate::plots::{bar_chart, cdf_points, line_chart};
use crate::replay::ReplayReport;
use crate::sim::SimResult;
use anyhow::{Context, Result};
use std::fmt::Write;
use std::path::Path;

/// Writes `text` to `dir/name`, creating `dir`.
pub fn write_file(dir: &Path, name: &str, text: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let p = dir.join(name);
    std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
}

/// The Markdown table of simulation results beside the bounds.
pub fn sim_markdown(results: &[SimResult], bounds: &Bounds) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Bounds: ceiling (one unbounded cache) **{:.3}**, pooled LRU ({} blocks) **{:.3}**; no-queue floor TTFT (ceiling hits, no waiting) p50 / p90 / p99 **{:.0} / {:.0} / {:.0} ms**.\n",
        bounds.ceiling,
        bounds.pooled_blocks,
        bounds.pooled,
        bounds.no_queue_floor_ms.p50,
        bounds.no_queue_floor_ms.p90,
        bounds.no_queue_floor_ms.p99
    );
    s.push_str("| policy | hit ratio | vs pooled | vs ceiling | prefill tokens | work max/mean | session moves | sessions max/mean | TTFT p50 ms | p90 | p99 | p99 over floor | input cost | sim wall s |\n");
    s.push_str(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in results {
        let _ = writeln!(
            s,
            "| {} | {:.3} | {:.2} | {:.2} | {} | {:.2} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
            r.policy,
            r.hit_ratio,
            r.hit_ratio / bounds.pooled.max(1e-12),
            r.hit_ratio / bounds.ceiling.max(1e-12),
            r.prefill_tokens,
            r.work_max_over_mean,
            r.session_moves,
            r.sessions_max_over_mean,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.ttft_ms.p99 - bounds.no_queue_floor_ms.p99,
            r.input_cost_relative,
            r.wall_s
        );
    }
    s
}

/// Writes a simulation report (JSON, Markdown, plots) to `dir`.
pub fn write_sim_report(dir: &Path, results: &[SimResult], bounds: &Bounds) -> Result<()> {
    let json = serde_json::json!({ "bounds": bounds, "results": results });
    write_file(dir, "sim.json", &serde_json::to_string_pretty(&json)?)?;
    write_file(dir, "sim.md", &sim_markdown(results, bounds))?;
    let cdf: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .map(|r| (r.policy.clone(), cdf_points(&r.ttft_samples, 200)))
        .collect();
    write_file(
        dir,
        "ttft_cdf.svg",
        &line_chart(
            "TTFT CDF (simulated)",
            "TTFT ms (log)",
            "fraction",
            &cdf,
            true,
        ),
    )?;
    let hits: Vec<(String, Vec<(f64, f64)>)> = results
        .iter()
        .map(|r| (r.policy.clone(), r.hit_timeline.clone()))
        .collect();
    write_file(
        dir,
        "hit_ratio.svg",
        &line_chart(
            "Hit ratio over time",
            "arrival time s",
            "hit ratio",
            &hits,
            false,
        ),
    )?;
    if let Some(r) = results.first() {
        let bars: Vec<(String, f64)> = r
            .worker_prefill_tokens
            .iter()
            .enumerate()
            .map(|(i, &v)| (format!("{i}"), v as f64))
            .collect();
        write_file(
            dir,
            "worker_load.svg",
            &bar_chart(
                &format!("Prefill tokens per worker ({})", r.policy),
                "tokens",
                &bars,
            ),
        )?;
    }
    Ok(())
}

/// The Markdown of a replay report.
pub fn replay_markdown(r: &ReplayReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Replay against {}\n", r.target);
    let _ = writeln!(s, "| figure | value |\n| --- | ---: |");
    let rows = [
        ("requests ok / failed", format!("{} / {}", r.ok, r.failed)),
        ("tokens per hash id", r.tokens_per_id.to_string()),
        (
            "TTFT p50 / p90 / p99 ms",
            format!(
                "{:.1} / {:.1} / {:.1}",
                r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99
            ),
        ),
        (
            "inter-token latency p50 / p99 ms",
            format!("{:.1} / {:.1}", r.itl_ms.p50, r.itl_ms.p99),
        ),
        (
            "request latency p50 / p90 / p99 ms",
            format!(
                "{:.1} / {:.1} / {:.1}",
                r.latency_ms.p50, r.latency_ms.p90, r.latency_ms.p99
            ),
        ),
        ("duration s", format!("{:.1}", r.duration_s)),
        ("throughput req/s", format!("{:.2}", r.throughput_rps)),
        ("output tokens/s", format!("{:.1}", r.output_tokens_per_s)),
        (
            "cached-token ratio (fleet)",
            format!(
                "{:.3} ({} of {})",
                r.cached_token_ratio, r.cached_tokens, r.prompt_tokens
            ),
        ),
        (
            "trace ceiling (unbounded single cache, blocks)",
            format!("{:.3}", r.ceiling),
        ),
        (
            "input cost vs. no caching (cached at 10%)",
            format!("{:.3}", r.input_cost_relative),
        ),
        (
            "per-worker prefill max/mean",
            format!("{:.2}", r.work_max_over_mean),
        ),
        (
            "session moves (turns served away from the turn before)",
            r.session_moves.to_string(),
        ),
        (
            "per-worker sessions max/mean",
            format!("{:.2}", r.sessions_max_over_mean),
        ),
    ];
    for (k, v) in rows {
        let _ = writeln!(s, "| {k} | {v} |");
    }
    let _ = writeln!(
        s,
        "\n| worker | requests | prefill tokens | sessions |\n| --- | ---: | ---: | ---: |"
    );
    for (w, t) in &r.workers {
        let _ = writeln!(
            s,
            "| {w} | {} | {} | {} |",
            t.requests, t.prefill_tokens, t.sessions
        );
    }
    if !r.errors.is_empty() {
        let _ = writeln!(s, "\nFirst errors:\n");
        for e in &r.errors {
            let _ = writeln!(s, "- {e}");
        }
    }
    s
}

/// Writes a replay report (JSON, Markdown, plots) to `dir`.
pub fn write_replay_report(dir: &Path, r: &ReplayReport) -> Result<()> {
    write_file(dir, "replay.json", &serde_json::to_string_pretty(r)?)?;
    write_file(dir, "replay.md", &replay_markdown(r))?;
    let mut ttft: Vec<f64> = r
        .outcomes
        .iter()
        .filter(|o| o.ok)
        .map(|o| o.ttft_ms)
        .collect();
    ttft.sort_by(f64::total_cmp);
    write_file(
        dir,
        "ttft_cdf.svg",
        &line_chart(
            "TTFT CDF (replay)",
            "TTFT ms (log)",
            "fraction",
            &[("replay".into(), cdf_points(&ttft, 200))],
            true,
        ),
    )?;
    write_file(
        dir,
        "hit_ratio.svg",
        &line_chart(
            "Cached-token ratio over time",
            "send time s",
            "cached ratio",
            &[
                ("replay".into(), r.hit_timeline.clone()),
                (
                    "ceiling".into(),
                    r.hit_timeline.iter().map(|p| (p.0, r.ceiling)).collect(),
                ),
            ],
            false,
        ),
    )?;
    let bars: Vec<(String, f64)> = r
        .workers
        .iter()
        .map(|(w, t)| (w.clone(), t.prefill_tokens as f64))
        .collect();
    write_file(
        dir,
        "worker_load.svg",
        &bar_chart("Prefill tokens per worker (replay)", "tokens", &bars),
    )?;
    Ok(())
}
