//! `kvfleet sim`: simulate a fleet on a trace with one or more policies.

use crate::cache_aware_args::with_overrides;
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_bench::bounds::{bounds_with_tiers, pooled_queue};
use kvfleet_bench::report::{sim_markdown, write_sim_report};
use kvfleet_bench::sim::cost_model::CostModel;
use kvfleet_bench::sim::{simulate, SimConfig, SimPolicy, SimResult, TierScoring};
use kvfleet_bench::Trace;
use kvfleet_core::decode_reserve::DecodeReserveConfig;
use kvfleet_routing::policy::{default_peer_pull_min_blocks, CacheAwareConfig, PullTrigger};
use std::path::PathBuf;

/// Arguments of `kvfleet sim`.
#[derive(Args)]
pub struct SimArgs {
    /// The trace (JSONL).
    #[arg(long)]
    trace: PathBuf,
    /// Simulated workers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// KV cache blocks per worker, in the trace's blocks (after --tokens-per-id).
    #[arg(long, default_value_t = 1000)]
    cache_blocks: usize,
    /// Host-tier blocks per worker below the device (0: none); a block evicted from the
    /// device is demoted there, and loaded back at the cost model's host bandwidth.
    #[arg(long, default_value_t = 0)]
    host_blocks: usize,
    /// Disk-tier blocks per worker below the host tier (0: none).
    #[arg(long, default_value_t = 0)]
    disk_blocks: usize,
    /// How kvfleet's router scores host and disk hits: load-time (by the cost model's
    /// bandwidths), discount (Dynamo's fixed 0.75 / 0.25) or device-only.
    #[arg(long, default_value = "load-time", value_parser = parse_tier_scoring)]
    tier_scoring: TierScoring,
    /// kvfleet's router pulls a prompt's prefix from the worker holding it when that
    /// saves at least this many blocks, priced by the cost model's peer bandwidth
    /// (0: no pulls; default: as `kvfleet router` does, 16 tokens' worth in the
    /// trace's blocks).
    #[arg(long)]
    peer_pull_min_blocks: Option<usize>,
    /// When `cache-aware` moves a request to pull its prefix elsewhere: `idle-wait`
    /// (default) or `cost`, as `kvfleet router --peer-pull-trigger`.
    #[arg(long, default_value = "idle-wait", value_parser = crate::serve_args::parse_pull_trigger)]
    peer_pull_trigger: PullTrigger,
    /// `cache-aware`'s weights as a JSON object, inline or in a file, as `kvfleet
    /// router --cache-aware-config` takes them.
    #[arg(long, value_parser = crate::cache_aware_args::parse_cache_aware_config)]
    cache_aware_config: Option<crate::cache_aware_args::CacheAwareOverrides>,
    /// The SGLang baselines' settings as a JSON object, inline or in a file (e.g.
    /// `'{"idle_guard": true}'`, an experiment that is not SGLang's: see
    /// docs/policy-sweep.md).
    #[arg(long, value_parser = crate::sglang_args::parse_sglang_config)]
    sglang_config: Option<kvfleet_bench::sim::sglang_cache_aware::SglangConfig>,
    #[command(flatten)]
    pool: PoolModelArgs,
    /// Policies, comma-separated or repeated: cache-aware, round-robin, least-loaded,
    /// consistent-hash, random, sglang-cache-aware, dynamo-kv-cost, sglang-spill,
    /// dynamo-lmetric, or `all`.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    policy: Vec<String>,
    /// Cost model file (JSON, see crates/kvfleet-bench/cost-models); default: the
    /// built-in H200 estimate.
    #[arg(long)]
    cost_model: Option<PathBuf>,
    /// Simulate the trace as replayed with K tokens per hash id (as `bench replay
    /// --tokens-per-id K`).
    #[arg(long)]
    tokens_per_id: Option<usize>,
    /// Multiply every timestamp by this (2 = half the arrival rate).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Only the first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Write sim.json, sim.md and plots here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write every request's outcome here, one JSON line each (index, worker, sent_ms,
    /// ttft_ms, prompt_tokens, cached_tokens, policy), to compare with `kvfleet bench
    /// replay`'s outcomes request by request.
    #[arg(long)]
    requests_out: Option<PathBuf>,
    /// Time from a request's last token at its worker to its child's arrival, ms (the
    /// answer's way to the client and the next request's way back); `bench replay`'s
    /// client on the same machine takes about 1.
    #[arg(long, default_value_t = 0.0)]
    client_rtt_ms: f64,
    /// Print JSON instead of Markdown.
    #[arg(long)]
    json: bool,
}

/// Parses a tier scoring mode.
pub fn parse_tier_scoring(s: &str) -> std::result::Result<TierScoring, String> {
    match s.trim() {
        "load-time" => Ok(TierScoring::LoadTime),
        "discount" => Ok(TierScoring::Discount),
        "device-only" => Ok(TierScoring::DeviceOnly),
        other => Err(format!(
            "unknown tier scoring {other:?}; valid: load-time, discount, device-only"
        )),
    }
}

/// Parses a policy list (`all` expands to every policy).
pub fn parse_policies(list: &[String]) -> Result<Vec<SimPolicy>> {
    let mut out = Vec::new();
    for p in list {
        if p.trim() == "all" {
            out.extend(SimPolicy::all());
        } else {
            out.push(p.parse::<SimPolicy>().map_err(anyhow::Error::msg)?);
        }
    }
    anyhow::ensure!(!out.is_empty(), "no policy given");
    Ok(out)
}

/// How a simulated worker's pool treats a request's blocks (`kvfleet sim` and `kvfleet
/// bench sweep` share these flags).
#[derive(Args, Debug, Clone, Copy)]
pub struct PoolModelArgs {
    /// Hold every request's blocks as an engine does: never evicted from the start of
    /// its prefill to its last token (a queued request holds none), and a worker's
    /// prefill starts only once the running sequences' blocks and its own fit the pool
    /// (default: held blocks may be evicted and prefill never waits for memory).
    #[arg(long)]
    pub hold_blocks: bool,
    /// Take each request's cached prefix when its prefill starts, as an engine admits
    /// a waiting sequence, holding that prefix while it is queued, as the engine does
    /// (default: when it is queued, so a router sees the evictions of the requests
    /// queued ahead of a new one before they happen).
    #[arg(long)]
    pub hits_at_admission: bool,
    /// With --hold-blocks, admit and grow as the engine's scheduler does: a request's
    /// output takes blocks as it is generated, and a prefill starts only while the
    /// free blocks cover it and this share of what the running requests may still
    /// generate, relaxing to 0.1 while nothing is preempted (a worker's
    /// --decode-reserve-ratio; 0.3 is its default). Without it, each request's whole
    /// output is booked when its prefill starts.
    #[arg(long)]
    pub decode_reserve_ratio: Option<f64>,
    /// Run each worker's prefills in the steps of its decoding sequences, as the
    /// engine's continuous batching does: a prefill waits for the step under way to
    /// end and takes one decode step longer (the rows its own step runs), the
    /// decoding sequences wait out its time, and the queued prefills that fit one
    /// step's token budget run in it together (default: a prefill lane beside
    /// decodes that never wait for it).
    #[arg(long)]
    pub mixed_steps: bool,
}

impl PoolModelArgs {
    /// The flags as given, for a page's "Run:" line (empty for the defaults).
    pub fn flags(&self) -> String {
        let mut s = String::new();
        if self.hold_blocks {
            s.push_str(" --hold-blocks");
        }
        if self.hits_at_admission {
            s.push_str(" --hits-at-admission");
        }
        if let Some(r) = self.decode_reserve_ratio {
            s.push_str(&format!(" --decode-reserve-ratio {r}"));
        }
        if self.mixed_steps {
            s.push_str(" --mixed-steps");
        }
        s
    }

    /// The engine's memory rule these flags ask for, as the worker's defaults set it
    /// apart from the ratio; an error for a ratio outside [0, 1] (the simulation
    /// itself refuses one without --hold-blocks).
    pub fn decode_reserve(&self) -> Result<Option<DecodeReserveConfig>> {
        let Some(ratio) = self.decode_reserve_ratio else {
            return Ok(None);
        };
        let c = DecodeReserveConfig {
            init_ratio: ratio,
            ..DecodeReserveConfig::default()
        };
        c.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(c))
    }
}

/// Writes every policy's request outcomes to `path` as JSON lines (`policy` added to
/// each).
fn write_requests(path: &std::path::Path, results: &[SimResult]) -> Result<()> {
    let mut out = String::new();
    for r in results {
        for o in &r.outcomes {
            let mut v = serde_json::to_value(o)?;
            v["policy"] = serde_json::Value::String(r.policy.clone());
            out.push_str(&v.to_string());
            out.push('\n');
        }
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Runs `kvfleet sim`.
pub fn run(args: SimArgs) -> Result<()> {
    anyhow::ensure!(
        args.time_scale > 0.0 && args.time_scale.is_finite(),
        "--time-scale must be positive"
    );
    let policies = parse_policies(&args.policy)?;
    let cost = match &args.cost_model {
        Some(p) => CostModel::read_path(p)?,
        None => CostModel::h200_llama8b(),
    };
    let mut trace = Trace::read_path(&args.trace)?;
    if let Some(n) = args.max_requests {
        trace = trace.truncated(n);
    }
    if let Some(k) = args.tokens_per_id {
        anyhow::ensure!(k > 0, "--tokens-per-id must be at least 1");
        trace = trace.with_tokens_per_id(k);
    }
    if args.time_scale != 1.0 {
        trace = trace.scaled_time(args.time_scale);
    }
    let b = bounds_with_tiers(
        &trace,
        args.workers,
        args.cache_blocks,
        args.host_blocks + args.disk_blocks,
        &cost,
    );
    // Worked out once: every policy's run uses the same weights.
    let cache_aware = with_overrides(
        CacheAwareConfig {
            pull_trigger: args.peer_pull_trigger,
            ..CacheAwareConfig::default()
        },
        args.cache_aware_config.as_ref(),
    )?;
    let mut results = Vec::new();
    for p in policies {
        let mut cfg = SimConfig::new(args.workers, args.cache_blocks, p);
        cfg.cost = cost.clone();
        cfg.host_blocks = args.host_blocks;
        cfg.disk_blocks = args.disk_blocks;
        cfg.tier_scoring = args.tier_scoring;
        cfg.hold_blocks = args.pool.hold_blocks;
        cfg.hits_at_admission = args.pool.hits_at_admission;
        cfg.decode_reserve = args.pool.decode_reserve()?;
        cfg.mixed_steps = args.pool.mixed_steps;
        cfg.client_rtt_ms = args.client_rtt_ms;
        cfg.record_requests = args.requests_out.is_some();
        cfg.router.cache_aware = cache_aware.clone();
        if let Some(sglang) = &args.sglang_config {
            cfg.sglang = sglang.clone();
        }
        cfg.peer_pull_min_blocks = args
            .peer_pull_min_blocks
            .unwrap_or_else(|| default_peer_pull_min_blocks(trace.block_size()));
        let r = simulate(&trace, &cfg).with_context(|| format!("simulating {}", p.as_str()))?;
        eprintln!(
            "{}: hit ratio {:.3}, TTFT p99 {:.0} ms, {:.2} s wall",
            r.policy, r.hit_ratio, r.ttft_ms.p99, r.wall_s
        );
        if r.rejected > 0 {
            eprintln!(
                "{}: {} of {} requests refused: their prompt needs more than {} KV blocks",
                r.policy, r.rejected, r.requests, args.cache_blocks
            );
        }
        results.push(r);
    }
    if let Some(dir) = &args.out {
        write_sim_report(dir, &results, &b)?;
    }
    if let Some(path) = &args.requests_out {
        write_requests(path, &results)?;
    }
    let pooled_queue_ms = pooled_queue(&trace, args.workers, args.cache_blocks, &cost);
    if args.json {
        let v = serde_json::json!({ "bounds": b, "pooled_queue_ms": pooled_queue_ms, "results": results });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "{} requests, {} workers × {} blocks (+ {} host, {} disk), cost model {}\n",
            trace.records.len(),
            args.workers,
            args.cache_blocks,
            args.host_blocks,
            args.disk_blocks,
            cost.name
        );
        if args.host_blocks + args.disk_blocks > 0 {
            println!(
                "Pooled bound with tiers ({} blocks): {:.3}\n",
                b.pooled_tiered_blocks, b.pooled_tiered
            );
        }
        println!(
            "Pooled queue (every prefill lane sharing one queue, the fleet's memory one LRU cache) TTFT p50 / p90 / p99: {:.0} / {:.0} / {:.0} ms\n",
            pooled_queue_ms.p50, pooled_queue_ms.p90, pooled_queue_ms.p99
        );
        print!("{}", sim_markdown(&results, &b));
    }
    Ok(())
}
