//! `kvfleet bench`: generate traces, replay them against a live endpoint, and run the
//! benchmark matrix behind docs/benchmarks.md.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kvfleet_bench::matrix::{matrix_markdown, run_matrix, MatrixConfig, MatrixTrace};
use kvfleet_bench::replay::{replay, ReplayConfig};
use kvfleet_bench::report::{replay_markdown, write_file, write_replay_report};
use kvfleet_bench::sim::cost_model::CostModel;
use kvfleet_bench::sim::{comparison_pull_min_blocks, simulate, SimConfig, SimPolicy};
use kvfleet_bench::trace_gen::{generate, Arrival, GenConfig};
use kvfleet_bench::Trace;
use std::fmt::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `kvfleet bench`.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Generate a fork fan-out agent trace (JSONL).
    Gen(GenArgs),
    /// Replay a trace against a live OpenAI-compatible endpoint.
    Replay(ReplayArgs),
    /// Run the simulation matrix and write docs/benchmarks.md (see
    /// scripts/benchmarks.sh).
    Matrix(MatrixArgs),
    /// Run every policy over a family of generated traces, fleet sizes and loads, and
    /// check `cache-aware` against the best baseline of each (docs/policy-sweep.md).
    Sweep(SweepArgs),
    /// Host and disk tiers against none, and load-time tier pricing against Dynamo's
    /// fixed discounts, on the Mooncake trace and a generated conversation trace
    /// (docs/kv-tiers.md).
    Tiers(TiersArgs),
    /// Measure one model's engine throughput in process: pp512, pp2048, tg128, and
    /// aggregate decode over 4 and 8 sequences (see scripts/bench/vs-llamacpp.sh).
    Model(ModelArgs),
    /// The serving router's routing core at fleet scale: requests per second and the
    /// decision latency a handler waits for, under a concurrent KV event stream.
    RouterScale(crate::router_scale::RouterScaleArgs),
}

/// Arguments of `kvfleet bench tiers`.
#[derive(Args)]
pub struct TiersArgs {
    /// The shared Mooncake trace (skipped when the file is absent).
    #[arg(long, default_value = "traces/mooncake_synthetic_trace.jsonl")]
    mooncake: PathBuf,
    /// Sessions of the generated conversation trace (0: skip it).
    #[arg(long, default_value_t = 1000)]
    conversation_sessions: usize,
    /// Sessions started per second in the conversation trace.
    #[arg(long, default_value_t = 1.5)]
    conversation_rate: f64,
    /// Think time between a conversation's turns, ms (long gaps keep many sessions
    /// alive at once: memory, not compute, is short).
    #[arg(long, default_value_t = 30_000)]
    conversation_gap_ms: u64,
    /// Workers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Device blocks per worker.
    #[arg(long, default_value_t = 1000)]
    cache_blocks: usize,
    /// Host-tier blocks per worker.
    #[arg(long, default_value_t = 4000)]
    host_blocks: usize,
    /// Disk-tier blocks per worker.
    #[arg(long, default_value_t = 16000)]
    disk_blocks: usize,
    /// Cost model file (default: the built-in H200 estimate).
    #[arg(long)]
    cost_model: Option<PathBuf>,
    /// Write every row as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The conversation trace of `kvfleet bench tiers` (the sweep's `conversation`
/// shape), `gap_ms` apart.
pub fn conversation_gen(sessions: usize, session_rate: f64, gap_ms: u64) -> GenConfig {
    GenConfig {
        session_rate,
        seed: 101,
        ..GenConfig::conversation(sessions, gap_ms)
    }
}

fn run_tiers_cmd(a: TiersArgs) -> Result<()> {
    use kvfleet_bench::tiers::{run_tiers, tiers_markdown, TierFleet};
    let cost = match &a.cost_model {
        Some(p) => CostModel::read_path(p)?,
        None => CostModel::h200_llama8b(),
    };
    let mut traces = Vec::new();
    if a.mooncake.exists() {
        traces.push(("mooncake".to_string(), Trace::read_path(&a.mooncake)?));
    } else {
        eprintln!(
            "{} not found: skipping the Mooncake trace",
            a.mooncake.display()
        );
    }
    if a.conversation_sessions > 0 {
        let t = generate(&conversation_gen(
            a.conversation_sessions,
            a.conversation_rate,
            a.conversation_gap_ms,
        ))?;
        traces.push(("conversation".to_string(), t));
    }
    anyhow::ensure!(!traces.is_empty(), "no trace to run");
    let fleet = TierFleet {
        workers: a.workers,
        device_blocks: a.cache_blocks,
        host_blocks: a.host_blocks,
        disk_blocks: a.disk_blocks,
    };
    let wall = std::time::Instant::now();
    let rows = run_tiers(&traces, &fleet, &cost)?;
    println!(
        "Cost model `{}`; {} simulations in {:.0} s.\n",
        cost.name,
        rows.len(),
        wall.elapsed().as_secs_f64()
    );
    for (name, t) in &traces {
        println!(
            "- {name}: {} requests, {} blocks",
            t.records.len(),
            t.total_blocks()
        );
    }
    println!();
    print!("{}", tiers_markdown(&rows, &fleet));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// Arguments of `kvfleet bench model`.
#[derive(Args)]
pub struct ModelArgs {
    /// The model (as `kvfleet up --model`).
    #[arg(long, default_value = kvfleet_engine::model_cache::DEFAULT_MODEL)]
    model: String,
    /// Runs per case; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// The cases to measure, comma-separated: pp512, pp2048, tg128, agg4, agg8.
    #[arg(long, value_delimiter = ',', value_parser = parse_case,
          default_value = "pp512,pp2048,tg128,agg4,agg8")]
    cases: Vec<kvfleet_engine::throughput::Case>,
}

fn parse_case(name: &str) -> std::result::Result<kvfleet_engine::throughput::Case, String> {
    kvfleet_engine::throughput::Case::parse(name)
        .ok_or_else(|| format!("unknown case {name:?}: pp512, pp2048, tg128, agg4 or agg8"))
}

/// Arguments of `kvfleet bench gen`.
#[derive(Args)]
pub struct GenArgs {
    /// Output file.
    #[arg(long)]
    out: PathBuf,
    /// Agent sessions.
    #[arg(long, default_value_t = 50)]
    sessions: usize,
    /// Tenants.
    #[arg(long, default_value_t = 1)]
    tenants: usize,
    /// Every session of a tenant shares the system prompt and tool definitions (the
    /// herd case).
    #[arg(long)]
    shared_prefix: bool,
    /// System prompt tokens.
    #[arg(long, default_value_t = 4096)]
    system_tokens: usize,
    /// Tool definition tokens.
    #[arg(long, default_value_t = 12288)]
    tools_tokens: usize,
    /// History tokens before the first turn.
    #[arg(long, default_value_t = 30720)]
    history_tokens: usize,
    /// Parent turns before the fork.
    #[arg(long, default_value_t = 3)]
    parent_turns: usize,
    /// Tokens each turn appends.
    #[arg(long, default_value_t = 1500)]
    turn_tokens: usize,
    /// Children per fork.
    #[arg(long, default_value_t = 5)]
    fork_k: usize,
    /// Tokens of the placeholder tool results the children share.
    #[arg(long, default_value_t = 300)]
    placeholder_tokens: usize,
    /// Tokens of each child's directive.
    #[arg(long, default_value_t = 200)]
    directive_tokens: usize,
    /// Turns of each child's loop.
    #[arg(long, default_value_t = 3)]
    child_turns: usize,
    /// Output tokens per answer.
    #[arg(long, default_value_t = 150)]
    output_tokens: usize,
    /// Sessions started per second.
    #[arg(long, default_value_t = 0.5)]
    session_rate: f64,
    /// Arrival process of sessions: poisson, uniform or bursty.
    #[arg(long, default_value = "poisson")]
    arrival: Arrival,
    /// Think time between turns, ms.
    #[arg(long, default_value_t = 3000)]
    turn_gap_ms: u64,
    /// Tokens per hash id.
    #[arg(long, default_value_t = 512)]
    block_size: usize,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl GenArgs {
    fn config(&self) -> GenConfig {
        GenConfig {
            sessions: self.sessions,
            tenants: self.tenants,
            shared_prefix: self.shared_prefix,
            system_tokens: self.system_tokens,
            tools_tokens: self.tools_tokens,
            history_tokens: self.history_tokens,
            parent_turns: self.parent_turns,
            turn_tokens: self.turn_tokens,
            fork_k: self.fork_k,
            placeholder_tokens: self.placeholder_tokens,
            directive_tokens: self.directive_tokens,
            child_turns: self.child_turns,
            output_tokens: self.output_tokens,
            session_rate: self.session_rate,
            arrival: self.arrival,
            turn_gap_ms: self.turn_gap_ms,
            block_size: self.block_size,
            seed: self.seed,
        }
    }
}

/// Arguments of `kvfleet bench replay`.
#[derive(Args)]
pub struct ReplayArgs {
    /// The trace (JSONL).
    #[arg(long)]
    trace: PathBuf,
    /// Base URL of the endpoint, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    target: String,
    /// Time compression of the open loop (2 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// Replay only the first N requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Closed loop with C requests in flight (default: open loop on timestamps).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Tokens per hash id (default: the trace's block size).
    #[arg(long)]
    tokens_per_id: Option<usize>,
    /// Model id (default: the endpoint's first model).
    #[arg(long)]
    model: Option<String>,
    /// Cap on output tokens per request.
    #[arg(long)]
    max_output_tokens: Option<usize>,
    /// Routing policy header (x-kvfleet-policy) for every request.
    #[arg(long)]
    policy: Option<String>,
    /// Token ids stay below this.
    #[arg(long, default_value_t = kvfleet_bench::token_blocks::DEFAULT_TOKEN_VOCAB)]
    vocab: u32,
    /// Per-request timeout, s.
    #[arg(long, default_value_t = 600)]
    timeout_s: u64,
    /// Write replay.json, replay.md and plots here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Print JSON (without per-request outcomes) instead of Markdown.
    #[arg(long)]
    json: bool,
}

/// Arguments of `kvfleet bench sweep`.
#[derive(Args)]
pub struct SweepArgs {
    /// Fleet sizes.
    #[arg(long, value_delimiter = ',', default_value = "8,16,64,256")]
    workers: Vec<usize>,
    /// Sessions per worker of each generated trace.
    #[arg(long, default_value_t = 4)]
    sessions_per_worker: usize,
    /// Fewest sessions of a generated trace.
    #[arg(long, default_value_t = 100)]
    min_sessions: usize,
    /// Seed of the trace family (another seed: a held-out family).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The shared Mooncake trace (skipped when the file is absent).
    #[arg(long, default_value = "traces/mooncake_synthetic_trace.jsonl")]
    mooncake: PathBuf,
    /// Only these traces (conversation, fork, herd, tenants, bursty, mooncake).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Policies (default: all).
    #[arg(long, value_delimiter = ',')]
    policy: Vec<SimPolicy>,
    /// `cache-aware`'s weights as a JSON object, inline or in a file, as `kvfleet
    /// router --cache-aware-config` takes them (`--cache-aware` is the old name).
    #[arg(long, alias = "cache-aware", value_parser = crate::cache_aware_args::parse_cache_aware_config)]
    cache_aware_config: Option<crate::cache_aware_args::CacheAwareOverrides>,
    /// When `cache-aware` moves a request to pull its prefix elsewhere: `idle-wait`
    /// (default) or `cost`, as `kvfleet router --peer-pull-trigger`.
    #[arg(long, default_value = "idle-wait", value_parser = crate::serve_args::parse_pull_trigger)]
    peer_pull_trigger: kvfleet_routing::policy::PullTrigger,
    /// Cost model file (default: the built-in H200 estimate).
    #[arg(long)]
    cost_model: Option<PathBuf>,
    /// `cache-aware` pulls a prefix from a peer when that gains it at least this many
    /// blocks (0: no pulls; default: as `kvfleet router` does, 16 tokens' worth in
    /// the trace's blocks); the baselines never pull.
    #[arg(long)]
    peer_pull_min_blocks: Option<usize>,
    /// The SGLang baselines' settings as a JSON object, inline or in a file, as
    /// `kvfleet sim --sglang-config` takes them.
    #[arg(long, value_parser = crate::sglang_args::parse_sglang_config)]
    sglang_config: Option<kvfleet_bench::sim::sglang_cache_aware::SglangConfig>,
    #[command(flatten)]
    pool: crate::sim_cmd::PoolModelArgs,
    /// Write the Markdown page here (default: print it).
    #[arg(long)]
    doc: Option<PathBuf>,
    /// Write every row as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Arguments of `kvfleet bench matrix`.
#[derive(Args)]
pub struct MatrixArgs {
    /// The Mooncake synthetic trace.
    #[arg(long, default_value = "traces/mooncake_synthetic_trace.jsonl")]
    mooncake: PathBuf,
    /// Sessions of each generated trace.
    #[arg(long, default_value_t = 300)]
    sessions: usize,
    /// Fleet sizes.
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    workers: Vec<usize>,
    /// Cache blocks per worker.
    #[arg(long, default_value_t = 1000)]
    cache_blocks: usize,
    /// Cost model file (default: the built-in H200 estimate).
    #[arg(long)]
    cost_model: Option<PathBuf>,
    /// `cache-aware` pulls a prefix from a peer when that gains it at least this many
    /// blocks (0: no pulls; default: as `kvfleet router` does, 16 tokens' worth in
    /// the trace's blocks); the baselines never pull.
    #[arg(long)]
    peer_pull_min_blocks: Option<usize>,
    /// Requests of the scale run (0: skip it).
    #[arg(long, default_value_t = 100_000)]
    scale_requests: usize,
    /// Workers of the scale run.
    #[arg(long, default_value_t = 1000)]
    scale_workers: usize,
    /// A replay report (JSON) to include, with the simulator's prediction beside it.
    #[arg(long)]
    replay_json: Option<PathBuf>,
    /// The trace that replay used.
    #[arg(long)]
    replay_trace: Option<PathBuf>,
    /// The replay's command line, for the document.
    #[arg(long)]
    replay_setup: Option<String>,
    /// Workers of the replayed cluster.
    #[arg(long, default_value_t = 4)]
    replay_workers: usize,
    /// KV blocks per worker of the replayed cluster (engine blocks).
    #[arg(long, default_value_t = 2048)]
    replay_cache_blocks: usize,
    /// Where the Markdown goes.
    #[arg(long, default_value = "docs/benchmarks.md")]
    doc: PathBuf,
    /// Where the plots go.
    #[arg(long, default_value = "docs/plots")]
    plots: PathBuf,
    /// A Markdown file appended to the page (the analysis).
    #[arg(long)]
    notes: Option<PathBuf>,
}

/// Runs `kvfleet bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    match args.command {
        BenchCommand::Gen(a) => {
            let trace = generate(&a.config())?;
            trace.write_path(&a.out)?;
            eprintln!(
                "wrote {} requests ({} blocks, {:.1} s) to {}",
                trace.records.len(),
                trace.total_blocks(),
                trace.span_ms() as f64 / 1000.0,
                a.out.display()
            );
            Ok(())
        }
        BenchCommand::Replay(a) => run_replay(a),
        BenchCommand::Matrix(a) => run_matrix_cmd(a),
        BenchCommand::Sweep(a) => run_sweep_cmd(a),
        BenchCommand::Tiers(a) => run_tiers_cmd(a),
        BenchCommand::Model(a) => run_model_bench(a),
        BenchCommand::RouterScale(a) => crate::router_scale::run(a),
    }
}

fn run_replay(a: ReplayArgs) -> Result<()> {
    let trace = Trace::read_path(&a.trace)?;
    let cfg = ReplayConfig {
        target: a.target.clone(),
        model: a.model.clone(),
        speed: a.speed,
        max_requests: a.max_requests,
        concurrency: a.concurrency,
        tokens_per_id: a.tokens_per_id,
        vocab: a.vocab,
        max_output_tokens: a.max_output_tokens,
        policy: a.policy.clone(),
        progress: !a.no_progress,
        timeout: Duration::from_secs(a.timeout_s),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let report = rt.block_on(replay(&trace, &cfg))?;
    if let Some(dir) = &a.out {
        write_replay_report(dir, &report)?;
    }
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(o) = v.as_object_mut() {
            o.remove("outcomes");
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", replay_markdown(&report));
    }
    Ok(())
}

fn run_matrix_cmd(a: MatrixArgs) -> Result<()> {
    let cost = match &a.cost_model {
        Some(p) => CostModel::read_path(p)?,
        None => CostModel::h200_llama8b(),
    };
    let mooncake = Trace::read_path(&a.mooncake)?;
    let gen = GenConfig {
        sessions: a.sessions,
        ..GenConfig::default()
    };
    let fork = generate(&gen)?;
    let herd = generate(&GenConfig {
        shared_prefix: true,
        seed: 2,
        ..gen.clone()
    })?;
    let traces = vec![
        MatrixTrace {
            name: "mooncake".into(),
            description: format!("Mooncake FAST'25 synthetic trace: {} requests, 512-token blocks.", mooncake.records.len()),
            trace: mooncake,
        },
        MatrixTrace {
            name: "fork".into(),
            description: format!("`kvfleet bench gen --sessions {}` (defaults: 4k system + 12k tools + 30k history, 3 parent turns of +1.5k, fork K=5 with 300 placeholder + 200 directive tokens, 3 child turns; each session its own system prompt and tools): {} requests.", a.sessions, fork.records.len()),
            trace: fork,
        },
        MatrixTrace {
            name: "herd".into(),
            description: format!("`kvfleet bench gen --sessions {} --shared-prefix --seed 2`: as `fork`, but every session shares the same system prompt and tool definitions (16k tokens): {} requests.", a.sessions, herd.records.len()),
            trace: herd,
        },
    ];
    let cfg = MatrixConfig {
        traces,
        workers: a.workers.clone(),
        cache_blocks: a.cache_blocks,
        loads: vec![
            ("light".into(), 0.5),
            ("near".into(), 0.9),
            ("overloaded".into(), 1.3),
        ],
        policies: SimPolicy::all(),
        cost: cost.clone(),
        peer_pull_min_blocks: a.peer_pull_min_blocks,
    };
    let wall = std::time::Instant::now();
    let rows = run_matrix(&cfg, |r| {
        eprintln!(
            "{} {}w {}: {} hit {:.3} p99 {:.0} ms ({:.2} s)",
            r.trace,
            r.result.workers,
            r.load,
            r.result.policy,
            r.result.hit_ratio,
            r.result.ttft_ms.p99,
            r.result.wall_s
        )
    })?;
    let matrix_wall = wall.elapsed().as_secs_f64();
    let mut doc = String::new();
    doc.push_str(include_str!("../docs/benchmarks.head.md"));
    let _ = writeln!(
        doc,
        "\nCost model: `{}` — {}\n",
        cost.name, cost.description
    );
    let _ = writeln!(
        doc,
        "Matrix: {} simulations in {:.0} s of wall time.\n",
        rows.len(),
        matrix_wall
    );

    // The Mooncake bound check of the issue.
    let m = &cfg.traces[0].trace;
    let b8 = kvfleet_bench::bounds::bounds(m, 8, 1000, &cost);
    let _ = writeln!(doc, "## Memory, not routing: Mooncake at 8 workers × 1,000 blocks\n\nOne pooled LRU cache of 8,000 blocks reaches a hit ratio of **{:.3}** against a ceiling of **{:.3}**: with this much memory, no routing policy can get near the ceiling; the best a router can do is approach the pooled bound. Every table below shows both bounds.\n", b8.pooled, b8.ceiling);

    if a.scale_requests > 0 {
        let sessions = a.scale_requests.div_ceil(gen.requests_per_session());
        let big = generate(&GenConfig {
            sessions,
            session_rate: 50.0,
            ..GenConfig::default()
        })?;
        let bb = kvfleet_bench::bounds::bounds(&big, a.scale_workers, a.cache_blocks, &cost);
        let ls = kvfleet_bench::matrix::load_scale(&big, &bb, a.scale_workers, &cost, 0.9);
        let (scaled, rate) = (big.scaled_time(ls.scale), ls.rate);
        let _ = writeln!(doc, "## Scale: {} requests over {} workers\n\nA generated fork trace of {} sessions ({} requests), 0.9 × capacity ({:.0} req/s), {} blocks per worker, one thread:\n\n| policy | hit ratio | pooled | ceiling | TTFT p99 ms | simulation wall time s |\n| --- | ---: | ---: | ---: | ---: | ---: |", big.records.len(), a.scale_workers, sessions, big.records.len(), rate, a.cache_blocks);
        for p in [
            SimPolicy::Kvfleet(kvfleet_router::PolicyKind::CacheAware),
            SimPolicy::SglangCacheAware,
            SimPolicy::DynamoKvCost,
        ] {
            let mut sc = SimConfig::new(a.scale_workers, a.cache_blocks, p);
            sc.cost = cost.clone();
            sc.peer_pull_min_blocks =
                comparison_pull_min_blocks(p, a.peer_pull_min_blocks, scaled.block_size());
            let r = simulate(&scaled, &sc)?;
            eprintln!("scale {}: {:.1} s", r.policy, r.wall_s);
            let _ = writeln!(
                doc,
                "| {} | {:.3} | {:.3} | {:.3} | {:.0} | {:.1} |",
                r.policy, r.hit_ratio, bb.pooled, bb.ceiling, r.ttft_ms.p99, r.wall_s
            );
        }
        doc.push('\n');
    }

    if let (Some(rj), Some(rt)) = (&a.replay_json, &a.replay_trace) {
        let text =
            std::fs::read_to_string(rj).with_context(|| format!("reading {}", rj.display()))?;
        let rep: serde_json::Value = serde_json::from_str(&text)?;
        let measured = rep["cached_token_ratio"].as_f64().unwrap_or(0.0);
        let k = rep["tokens_per_id"].as_u64().unwrap_or(16) as usize;
        let trace = Trace::read_path(rt)?.with_tokens_per_id(k);
        let mut sc = SimConfig::new(
            a.replay_workers,
            a.replay_cache_blocks,
            SimPolicy::Kvfleet(kvfleet_router::PolicyKind::CacheAware),
        );
        sc.cost = CostModel::cpu_small();
        // The live cluster routed with `kvfleet up`'s defaults, pulls included.
        sc.peer_pull_min_blocks =
            comparison_pull_min_blocks(sc.policy, a.peer_pull_min_blocks, trace.block_size());
        let r = simulate(&trace, &sc)?;
        let err = (measured - r.cached_token_ratio).abs() / r.cached_token_ratio.max(1e-12);
        let _ = writeln!(doc, "## Replay against a live cluster vs. the simulator\n\n{}\n\n| figure | replay (measured) | simulator (predicted) |\n| --- | ---: | ---: |\n| requests ok / failed | {} / {} | {} |\n| cached-token ratio | **{:.3}** | **{:.3}** |\n| TTFT p50 / p99 ms | {:.0} / {:.0} | {:.0} / {:.0} (cpu-small cost model) |\n\nRelative difference of the cached-token ratio: **{:.1}%** (target ≤ 10%).\n\n![replay TTFT CDF](plots/replay_ttft_cdf.svg)\n![replay cached ratio over time](plots/replay_hit_ratio.svg)\n![replay per-worker load](plots/replay_worker_load.svg)\n", a.replay_setup.clone().unwrap_or_default(), rep["ok"], rep["failed"], r.requests, measured, r.cached_token_ratio, rep["ttft_ms"]["p50"].as_f64().unwrap_or(0.0), rep["ttft_ms"]["p99"].as_f64().unwrap_or(0.0), r.ttft_ms.p50, r.ttft_ms.p99, err * 100.0);
    }

    if let Some(n) = &a.notes {
        let text =
            std::fs::read_to_string(n).with_context(|| format!("reading {}", n.display()))?;
        doc.push_str(&text);
        doc.push('\n');
    }
    doc.push_str("## The matrix\n\n");
    doc.push_str(&matrix_markdown(&cfg, &rows, &a.plots)?);
    let dir = a.doc.parent().map(PathBuf::from).unwrap_or_default();
    let name = a
        .doc
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("benchmarks.md")
        .to_string();
    write_file(&dir, &name, &doc)?;
    let json = serde_json::to_string_pretty(&serde_json::json!({ "rows": rows }))?;
    write_file(&a.plots, "matrix.json", &json)?;
    eprintln!("wrote {}", a.doc.display());
    Ok(())
}

fn run_sweep_cmd(a: SweepArgs) -> Result<()> {
    use kvfleet_bench::sweep::{run_sweep, sweep_checks, sweep_markdown, SweepConfig};
    let cost = match &a.cost_model {
        Some(p) => CostModel::read_path(p)?,
        None => CostModel::h200_llama8b(),
    };
    let router = kvfleet_router::RouterConfig {
        cache_aware: crate::cache_aware_args::with_overrides(
            kvfleet_routing::policy::CacheAwareConfig {
                pull_trigger: a.peer_pull_trigger,
                ..Default::default()
            },
            a.cache_aware_config.as_ref(),
        )?,
        ..kvfleet_router::RouterConfig::default()
    };
    let mooncake = if a.mooncake.exists() {
        Some(Trace::read_path(&a.mooncake)?)
    } else {
        eprintln!(
            "{} not found: the sweep runs without it",
            a.mooncake.display()
        );
        None
    };
    let cfg = SweepConfig {
        workers: a.workers.clone(),
        loads: vec![
            ("light".into(), 0.5),
            ("near".into(), 0.9),
            ("overloaded".into(), 1.3),
        ],
        policies: if a.policy.is_empty() {
            SimPolicy::all()
        } else {
            a.policy.clone()
        },
        cost: cost.clone(),
        router: router.clone(),
        sessions_per_worker: a.sessions_per_worker,
        min_sessions: a.min_sessions,
        seed: a.seed,
        mooncake,
        only: a.only.clone(),
        peer_pull_min_blocks: a.peer_pull_min_blocks,
        hold_blocks: a.pool.hold_blocks,
        hits_at_admission: a.pool.hits_at_admission,
        decode_reserve: a.pool.decode_reserve()?,
        mixed_steps: a.pool.mixed_steps,
        sglang: a.sglang_config.clone().unwrap_or_default(),
    };
    let wall = std::time::Instant::now();
    let rows = run_sweep(&cfg)?;
    let checks = sweep_checks(&rows, "cache-aware");
    let mut doc = String::new();
    doc.push_str(include_str!("../docs/policy-sweep.head.md"));
    let _ = writeln!(
        doc,
        "\nRun: `kvfleet bench sweep --workers {} --sessions-per-worker {} --min-sessions {} --seed {}{}`; {} simulations in {:.0} s of wall time. Cost model `{}`. `cache-aware` weights: `{}`.\n",
        a.workers.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(","),
        a.sessions_per_worker,
        a.min_sessions,
        a.seed,
        a.peer_pull_min_blocks
            .map(|n| format!(" --peer-pull-min-blocks {n}"))
            .unwrap_or_default()
            + &a.pool.flags()
            + &a
                .cost_model
                .as_ref()
                .map(|p| format!(" --cost-model {}", p.display()))
                .unwrap_or_default()
            + &a
                .sglang_config
                .as_ref()
                .and_then(|c| serde_json::to_string(c).ok())
                .map(|json| format!(" --sglang-config '{json}'"))
                .unwrap_or_default(),
        rows.len(),
        wall.elapsed().as_secs_f64(),
        cost.name,
        serde_json::to_string(&router.cache_aware)?
    );
    doc.push_str(&sweep_markdown(&checks));
    match &a.doc {
        Some(p) => {
            std::fs::write(p, &doc).with_context(|| format!("writing {}", p.display()))?;
            eprintln!("wrote {}", p.display());
        }
        None => print!("{doc}"),
    }
    if let Some(p) = &a.json {
        // Every row's headline figures (the full results, with per-worker arrays and
        // timelines, run to megabytes at 256 workers).
        let compact: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "trace": r.trace, "workers": r.result.workers, "load": r.load,
                    "policy": r.result.policy, "cache_blocks": r.result.cache_blocks,
                    "hit_ratio": r.result.hit_ratio, "ttft_ms": r.result.ttft_ms,
                    "floor_p99_ms": r.bounds.no_queue_floor_ms.p99, "pooled": r.bounds.pooled,
                    "ceiling": r.bounds.ceiling, "avoidable_waits": r.result.avoidable_waits,
                    "work_max_over_mean": r.result.work_max_over_mean,
                    "session_moves": r.result.session_moves,
                    "sessions_max_over_mean": r.result.sessions_max_over_mean,
                    "rate_rps": r.rate_rps, "load_pooled": r.load_pooled,
                })
            })
            .collect();
        let json = serde_json::to_string_pretty(
            &serde_json::json!({ "rows": compact, "checks": checks }),
        )?;
        std::fs::write(p, json).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

fn run_model_bench(args: ModelArgs) -> Result<()> {
    let loaded = kvfleet_engine::load_model(&args.model).context("loading the model")?;
    let r = kvfleet_engine::throughput::measure_throughput(
        &loaded.model,
        &loaded.id,
        args.repeats,
        &args.cases,
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "model {} (tokens/s, median of {})",
            loaded.id,
            args.repeats.max(1)
        );
        let cells: Vec<String> = r
            .measured()
            .into_iter()
            .map(|(c, v)| format!("{} {v:.1}", c.name()))
            .collect();
        println!("{}", cells.join("  "));
    }
    Ok(())
}
