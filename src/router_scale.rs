//! `kvfleet bench router-scale`: the serving router's routing core under load, the way a
//! router process runs it.
//!
//! One [`RoutingState`] with `--workers` registered workers, on a tokio runtime of
//! `--threads` threads (a router process's runtime):
//!
//! - **KV events.** Feeder tasks send wire batches through [`apply_wire_batch`], the
//!   path both event followers (the gRPC stream and the Kafka consumer) use, at
//!   `--event-blocks-per-s`. Each batch is one worker evicting a cached prompt
//!   (`Removed`, 96 blocks) and storing another (six `Stored` events of 16 blocks), so
//!   the index stays at its preloaded size (about 1M worker-blocks at 256 workers).
//! - **Load.** Every worker's load is reported about every 250 ms, as supervisors poll
//!   it, and pushed `--load-pushes-per-worker-s` times a second through
//!   [`apply_wire_batch`], as a worker pushes it with its KV events. Both carry the
//!   admission headroom an engine reports (room for every prompt here), so the router
//!   tracks the chains running on each worker as it does in a real fleet.
//! - **Requests.** An open-loop generator starts `--rate` requests per second. Each
//!   routes a prompt of 132 blocks (a 32-block system prompt every worker holds, a
//!   96-block body some worker holds, a 4-block tail of its own) with `cache-aware`,
//!   then stays in flight for 0–100 ms. When it ends, its reservation is cancelled in
//!   place of the `Stored` event that would confirm it and its outcome recorded.
//!
//! The decision latency is what a request handler waits for `RoutingState::route`:
//! the routing lock (held meanwhile by other decisions, request ends and KV events,
//! at most 16 blocks of an event at a time) and the decision itself. The decision
//! alone (index lookup, scoring, reservation) is reported beside it.

use anyhow::{bail, Result};
use clap::Args;
use kvfleet_bench::synthetic_load::polled_load;
use kvfleet_bench::token_blocks::synthetic_chain;
use kvfleet_core::BlockHash;
use kvfleet_proto::v1 as pb;
use kvfleet_router::routing_state::{RouteRequest, RoutingState};
use kvfleet_router::supervision::apply_wire_batch;
use kvfleet_router::{PolicyKind, RouterConfig};
use kvfleet_routing::policy::mix64;
use kvfleet_routing::KvRouter;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Blocks of the system prompt every worker holds.
const SYSTEM_BLOCKS: usize = 32;
/// Blocks of a prompt body (one cached "family").
const BODY_BLOCKS: usize = 96;
/// Blocks of each request's own tail.
const TAIL_BLOCKS: usize = 4;
/// Blocks per `Stored` event (a 256-token prefill chunk at 16 tokens a block).
const STORED_EVENT_BLOCKS: usize = 16;
/// Histogram bucket width, ns.
const BUCKET_NS: u64 = 250;
/// Buckets (up to 25 ms; anything longer lands in the last).
const BUCKETS: usize = 100_000;

/// Open-loop pacing on the runtime's 1 ms timer: how many of `per_s` events a second
/// are due at each tick, the fraction carried to the next (a missed tick is made up).
struct Pacer {
    tick: tokio::time::Interval,
    per_ms: f64,
    owed: f64,
}

impl Pacer {
    fn new(per_s: f64) -> Self {
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        Pacer {
            tick,
            per_ms: per_s / 1000.0,
            owed: 0.0,
        }
    }

    /// Waits for the next tick; the events due at it.
    async fn due(&mut self) -> u64 {
        self.tick.tick().await;
        self.owed += self.per_ms;
        let due = self.owed.floor();
        self.owed -= due;
        due as u64
    }
}

/// Arguments of `kvfleet bench router-scale`.
#[derive(Args, Clone, Debug)]
pub struct RouterScaleArgs {
    /// Registered workers.
    #[arg(long, default_value_t = 256)]
    workers: usize,
    /// Prompt bodies each worker holds (index size: workers × this × 96 blocks).
    #[arg(long, default_value_t = 40)]
    bodies_per_worker: usize,
    /// Requests started per second (open loop).
    #[arg(long, default_value_t = 25_000)]
    rate: u64,
    /// KV event blocks per second (stored plus removed).
    #[arg(long, default_value_t = 1_200_000)]
    event_blocks_per_s: u64,
    /// Loads each worker pushes per second with its KV events (a worker pushes its
    /// load when it changed, at most every 10 ms; an engine stepping every 20 ms
    /// pushes about 50 a second).
    #[arg(long, default_value_t = 50)]
    load_pushes_per_worker_s: u64,
    /// Event feeder tasks (each owns a share of the workers).
    #[arg(long, default_value_t = 8)]
    feeders: usize,
    /// Measured seconds (after one second of warm-up).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Write the result (every run's, with `--doc`) as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Runs of each configuration with `--doc` (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Run the standard set of fleet sizes, request rates and event rates (the other
    /// sizes and rates are ignored) and write the table here (docs/router-scale.md).
    #[arg(long)]
    doc: Option<std::path::PathBuf>,
    /// Price every worker for each decision instead of walking the load order (the
    /// reference the walk is compared with).
    #[arg(long)]
    full_scan: bool,
    /// Workers say nothing of their admission headroom (as before 2026-12-07): the
    /// router then neither orders by it nor tracks the chains running on each worker.
    #[arg(long)]
    no_headroom: bool,
}

/// What one run measured.
#[derive(Debug, serde::Serialize)]
pub struct RouterScaleReport {
    /// Registered workers.
    pub workers: usize,
    /// Worker-blocks in the index after preloading.
    pub indexed_worker_blocks: u64,
    /// Requests routed per second, measured.
    pub routed_per_s: f64,
    /// Requests asked for per second.
    pub target_rate: u64,
    /// Event blocks applied per second, measured.
    pub event_blocks_per_s: f64,
    /// Decision latency as a handler waits for it, µs: p50, p90, p99, p99.9, max.
    pub wait_us: [f64; 5],
    /// The decision alone (index, scoring, reservation), µs: p50, p90, p99, p99.9, max.
    pub decide_us: [f64; 5],
    /// Of the wait, the routing lock, µs.
    pub lock_us: [f64; 5],
    /// Of it, the index and reservation lookup, µs.
    pub lookup_us: [f64; 5],
    /// Of it, scoring the candidates and the policy's choice, µs.
    pub scoring_us: [f64; 5],
    /// Requests whose route failed.
    pub errors: u64,
    /// Every worker was priced for each decision (the reference), not the load
    /// order's heads.
    pub full_scan: bool,
}

/// A lock-free latency histogram (250 ns buckets).
struct Histogram {
    buckets: Vec<AtomicU64>,
    max_ns: AtomicU64,
}

impl Histogram {
    fn new() -> Self {
        Histogram {
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            max_ns: AtomicU64::new(0),
        }
    }

    fn record(&self, ns: u64) {
        let b = ((ns / BUCKET_NS) as usize).min(BUCKETS - 1);
        self.buckets[b].fetch_add(1, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    /// p50, p90, p99, p99.9 (bucket upper bounds) and max, in µs.
    fn summary_us(&self) -> [f64; 5] {
        let total = self.count();
        let mut out = [0.0; 5];
        for (slot, q) in [0.5, 0.9, 0.99, 0.999].into_iter().enumerate() {
            let want = ((total as f64) * q).ceil() as u64;
            let mut seen = 0;
            for (i, b) in self.buckets.iter().enumerate() {
                seen += b.load(Ordering::Relaxed);
                if seen >= want.max(1) {
                    out[slot] = ((i as u64 + 1) * BUCKET_NS) as f64 / 1000.0;
                    break;
                }
            }
        }
        out[4] = self.max_ns.load(Ordering::Relaxed) as f64 / 1000.0;
        out
    }
}

/// The prompts: a system prompt and the bodies after it.
struct Prompts {
    system: Vec<BlockHash>,
    /// Each body's whole chain (system prompt included), shared with requests.
    chains: Vec<Arc<[BlockHash]>>,
}

impl Prompts {
    fn new(bodies: usize) -> Self {
        let system = synthetic_chain(&[], 1, SYSTEM_BLOCKS);
        let chains = (0..bodies)
            .map(|b| synthetic_chain(&system, 1_000 + b as u64, BODY_BLOCKS).into())
            .collect();
        Prompts { system, chains }
    }
}

/// One worker's side of the event stream: the bodies it holds, its next seq.
struct WorkerFeed {
    id: String,
    seq: u64,
    held: std::collections::VecDeque<usize>,
}

impl WorkerFeed {
    fn stored(&mut self, parent: Option<BlockHash>, blocks: &[BlockHash]) -> pb::KvEvent {
        self.seq += 1;
        pb::KvEvent {
            seq: self.seq,
            kind: Some(pb::kv_event::Kind::Stored(pb::kv_event::Stored {
                parent_hash: parent.map(|h| h.0),
                block_hashes: blocks.iter().map(|h| h.0).collect(),
                medium: 0,
            })),
        }
    }

    fn removed(&mut self, blocks: &[BlockHash]) -> pb::KvEvent {
        self.seq += 1;
        pb::KvEvent {
            seq: self.seq,
            kind: Some(pb::kv_event::Kind::Removed(pb::kv_event::Removed {
                block_hashes: blocks.iter().map(|h| h.0).collect(),
                medium: 0,
            })),
        }
    }

    /// `Stored` events for `chain`'s body, in chunks.
    fn store_body(&mut self, chain: &[BlockHash], events: &mut Vec<pb::KvEvent>) {
        for start in (SYSTEM_BLOCKS..chain.len()).step_by(STORED_EVENT_BLOCKS) {
            let end = (start + STORED_EVENT_BLOCKS).min(chain.len());
            events.push(self.stored(Some(chain[start - 1]), &chain[start..end]));
        }
    }

    fn batch(&self, events: Vec<pb::KvEvent>) -> pb::KvEventBatch {
        pb::KvEventBatch {
            worker_id: self.id.clone(),
            events,
            load: None,
        }
    }
}

/// The runs of `--doc`: (workers, bodies per worker, requests/s, event blocks/s,
/// every worker priced).
const DOC_RUNS: [(usize, usize, u64, u64, bool); 8] = [
    (256, 40, 20_000, 0, false),
    (256, 40, 20_000, 1_000_000, false),
    (256, 40, 20_000, 1_000_000, true),
    (256, 40, 30_000, 1_000_000, false),
    (256, 40, 20_000, 2_000_000, false),
    (1_024, 10, 20_000, 1_000_000, false),
    (1_024, 10, 20_000, 1_000_000, true),
    (64, 160, 20_000, 1_000_000, false),
];

/// Runs `kvfleet bench router-scale`.
pub fn run(args: RouterScaleArgs) -> Result<()> {
    if args.workers == 0 || args.feeders == 0 || args.threads == 0 {
        bail!("--workers, --feeders and --threads must be positive");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()?;
    let runs: Vec<RouterScaleArgs> = match &args.doc {
        None => vec![args.clone()],
        Some(_) => DOC_RUNS
            .iter()
            .map(
                |&(workers, bodies_per_worker, rate, event_blocks_per_s, full_scan)| {
                    RouterScaleArgs {
                        workers,
                        bodies_per_worker,
                        rate,
                        event_blocks_per_s,
                        full_scan,
                        ..args.clone()
                    }
                },
            )
            .collect(),
    };
    // Each configuration runs `repeat` times (this machine is noisy); the one with the
    // median p99 wait stands for it, with the range of p99 beside it.
    let mut reports = Vec::new();
    let mut p99_ranges = Vec::new();
    for run in runs {
        let mut tries = Vec::new();
        let repeat = if args.doc.is_some() {
            args.repeat.max(1)
        } else {
            1
        };
        for _ in 0..repeat {
            let report = runtime.block_on(measure(run.clone()))?;
            print_report(&report, args.threads);
            tries.push(report);
        }
        tries.sort_by(|a, b| a.wait_us[2].total_cmp(&b.wait_us[2]));
        let range = (tries[0].wait_us[2], tries[tries.len() - 1].wait_us[2]);
        let mid = tries.swap_remove(tries.len() / 2);
        reports.push(mid);
        p99_ranges.push(range);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?)?;
    }
    if let Some(path) = &args.doc {
        std::fs::write(path, doc(&reports, &p99_ranges, &args))?;
    }
    Ok(())
}

fn print_report(report: &RouterScaleReport, threads: usize) {
    let [w50, w90, w99, w999, wmax] = report.wait_us;
    let [d50, d90, d99, d999, dmax] = report.decide_us;
    println!(
        "router-scale: {} workers, {} worker-blocks indexed, {threads} runtime threads, {}",
        report.workers,
        report.indexed_worker_blocks,
        if report.full_scan {
            "every worker priced"
        } else {
            "load-order scoring"
        }
    );
    println!(
        "  routed {:.0} req/s (asked {}), events applied {:.0} blocks/s, {} errors",
        report.routed_per_s, report.target_rate, report.event_blocks_per_s, report.errors
    );
    println!(
        "  decision as a handler waits for it, µs: p50 {w50:.1}  p90 {w90:.1}  p99 {w99:.1}  p99.9 {w999:.1}  max {wmax:.1}"
    );
    println!(
        "  the decision alone, µs:                 p50 {d50:.1}  p90 {d90:.1}  p99 {d99:.1}  p99.9 {d999:.1}  max {dmax:.1}"
    );
    for (name, h) in [
        ("lock wait", report.lock_us),
        ("index lookup", report.lookup_us),
        ("scoring", report.scoring_us),
    ] {
        let [p50, p90, p99, p999, max] = h;
        println!(
            "    {name:<13} µs: p50 {p50:.1}  p90 {p90:.1}  p99 {p99:.1}  p99.9 {p999:.1}  max {max:.1}"
        );
    }
}

/// docs/router-scale.md: what was run, and one row per run.
fn doc(reports: &[RouterScaleReport], p99_ranges: &[(f64, f64)], args: &RouterScaleArgs) -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut s = String::from(
        "# Router scale: routing decisions under a concurrent KV event stream\n\n\
         Generated by `kvfleet bench router-scale --doc docs/router-scale.md` \
         (`scripts/benchmarks.sh` step 4). The serving router's routing core \
         (`RoutingState`, the code a `kvfleet router` process runs) on a tokio runtime, \
         with every worker registered and its KV events fed through the path the gRPC \
         event follower and the Kafka consumer use (`apply_wire_batch`). Each event batch \
         is one worker evicting a cached prompt body (`Removed`, 96 blocks) and storing \
         another (six `Stored` of 16 blocks), so the index stays at its preloaded size. \
         Requests arrive open-loop; each routes a 132-block prompt (a 32-block system \
         prompt every worker holds, a 96-block body two workers hold, a 4-block tail of \
         its own) with `cache-aware` and stays in flight 0-100 ms. Every worker reports \
         its load about every 250 ms, as supervisors poll it: a third of the prefill \
         lanes busy, KV pools from empty to full (all 17 usage levels of the memory \
         price). Each worker also pushes its load 50 times a second through the event \
         path, as an engine stepping every 20 ms does. Arrivals come from the \
         runtime's 1 ms timer: each tick starts that millisecond's requests together, \
         burstier than Poisson arrivals.\n\n\
         *wait* is what a request handler waits for a decision: the routing lock \
         (*lock wait*: held meanwhile by other decisions, request ends and KV events, \
         at most 16 blocks of an event at a time) and the decision. *decide* is the \
         decision alone (index lookup, scoring, reservation). *scoring*: `load order` \
         is the default, where \
         `cache-aware` prices the workers matching the prompt unlike the rest and only \
         the heads of the load order of each large group of equally matched workers \
         (here: the system prompt every worker holds); `every worker` prices the whole \
         fleet, the reference it chooses identically to (`--full-scan`). The index \
         lookup stays linear in the workers holding the prompt's first block. The \
         worker processes are not run: the bench measures the router, and the events \
         they would send are sent at the stated rate.\n\n",
    );
    use std::fmt::Write as _;
    let _ = writeln!(
        s,
        "Machine: {cores} cores; build: {}; runtime threads: {}; {} s measured per run \
         after 1 s of warm-up; each row is the median (by p99 wait) of {} runs, with the \
         range of their p99 waits.\n",
        if cfg!(debug_assertions) {
            "dev"
        } else {
            "release"
        },
        args.threads,
        args.seconds,
        args.repeat.max(1)
    );
    s.push_str(
        "| workers | scoring | indexed worker-blocks | asked req/s | routed req/s | event blocks/s | wait p50 µs | p90 | p99 | p99 range | p99.9 | max | lock wait p50 µs | p99 | decide p50 µs | p99 | lookup p50 µs | scoring p50 µs |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (r, (lo, hi)) in reports.iter().zip(p99_ranges) {
        let w = r.wait_us;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {lo:.0}–{hi:.0} | {:.1} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.workers,
            if r.full_scan { "every worker" } else { "load order" },
            r.indexed_worker_blocks,
            r.target_rate,
            r.routed_per_s,
            r.event_blocks_per_s,
            w[0],
            w[1],
            w[2],
            w[3],
            w[4],
            r.lock_us[0],
            r.lock_us[2],
            r.decide_us[0],
            r.decide_us[2],
            r.lookup_us[0],
            r.scoring_us[0],
        );
    }
    s
}

async fn measure(args: RouterScaleArgs) -> Result<RouterScaleReport> {
    let mut kv = KvRouter::new(RouterConfig::default());
    kv.set_full_scan(args.full_scan);
    let routing = Arc::new(RoutingState::from_router(kv));
    let bs = routing.block_size();
    let half = args.bodies_per_worker.div_ceil(2);
    let bodies = (args.workers * half).max(1);
    let prompts = Arc::new(Prompts::new(bodies));

    // Preload: every worker holds the system prompt and `bodies_per_worker` bodies
    // (each body on two workers).
    let mut feeds: Vec<WorkerFeed> = Vec::with_capacity(args.workers);
    for w in 0..args.workers {
        let id = format!("w{w}");
        routing.add_worker(&id, bs)?;
        let mut feed = WorkerFeed {
            id,
            seq: 0,
            held: Default::default(),
        };
        let mut events = vec![feed.stored(None, &prompts.system)];
        for k in 0..args.bodies_per_worker {
            // Each body on two workers, half the fleet apart.
            let (round, owner) = if k < half {
                (k, w)
            } else {
                (k - half, (w + args.workers / 2) % args.workers)
            };
            let body = (round * args.workers + owner) % bodies;
            feed.store_body(&prompts.chains[body], &mut events);
            feed.held.push_back(body);
        }
        if let Err(e) = apply_wire_batch(&routing, &feed.id, &feed.batch(events)).await {
            bail!("preloading {}: {e}", feed.id);
        }
        feeds.push(feed);
    }
    let indexed = routing.snapshot();
    let indexed_worker_blocks: u64 = indexed.workers.iter().map(|w| w.cached_blocks as u64).sum();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let event_blocks = Arc::new(AtomicU64::new(0));

    // Event feeders, each owning every `feeders`-th worker.
    let per_batch = (BODY_BLOCKS * 2) as u64;
    let batches_per_s = args.event_blocks_per_s.div_ceil(per_batch);
    let mut owned: Vec<Vec<WorkerFeed>> = (0..args.feeders).map(|_| Vec::new()).collect();
    for (i, f) in feeds.into_iter().enumerate() {
        owned[i % args.feeders].push(f);
    }
    let mut feeder_tasks = Vec::new();
    for (k, mut mine) in owned.into_iter().enumerate() {
        if mine.is_empty() || batches_per_s == 0 {
            continue;
        }
        let (routing, prompts, stop, measuring, event_blocks) = (
            routing.clone(),
            prompts.clone(),
            stop.clone(),
            measuring.clone(),
            event_blocks.clone(),
        );
        let share = batches_per_s as f64 / args.feeders as f64;
        feeder_tasks.push(tokio::spawn(async move {
            let mut pacer = Pacer::new(share);
            let (mut next, mut rng) = (0usize, mix64(k as u64 + 77));
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..pacer.due().await {
                    let n = mine.len();
                    let feed = &mut mine[next % n];
                    next += 1;
                    // Evict the oldest body, store one this worker does not hold.
                    let Some(old) = feed.held.pop_front() else {
                        continue;
                    };
                    let mut events = vec![feed.removed(&prompts.chains[old][SYSTEM_BLOCKS..])];
                    let new = loop {
                        rng = mix64(rng);
                        let b = (rng % prompts.chains.len() as u64) as usize;
                        if !feed.held.contains(&b) {
                            break b;
                        }
                    };
                    feed.store_body(&prompts.chains[new], &mut events);
                    feed.held.push_back(new);
                    if let Err(e) = apply_wire_batch(&routing, &feed.id, &feed.batch(events)).await
                    {
                        return Err(anyhow::anyhow!("feeding {}: {e}", feed.id));
                    }
                    if measuring.load(Ordering::Relaxed) {
                        event_blocks.fetch_add(per_batch, Ordering::Relaxed);
                    }
                }
            }
            Ok(())
        }));
    }

    // Load reports, as the supervisors poll them: each worker every ~250 ms, with a
    // third of the prefill lanes busy and KV pools from empty to full, so that the
    // load order holds both lanes at every usage level.
    let reporter = {
        let (routing, stop) = (routing.clone(), stop.clone());
        let ids: Vec<String> = (0..args.workers).map(|w| format!("w{w}")).collect();
        let per_ms = ids.len().div_ceil(250);
        let headroom = !args.no_headroom;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for _ in 0..per_ms {
                    n += 1;
                    let r = mix64(n ^ 0x10ad);
                    let id = &ids[(n % ids.len() as u64) as usize];
                    // As an engine reports it, with its headroom: the router then
                    // tracks the chains running on each worker, part of what it costs.
                    let report = polled_load(r, headroom);
                    if let Err(e) = routing.update_load(id, report) {
                        return Err(anyhow::anyhow!("reporting {id}'s load: {e}"));
                    }
                }
            }
            Ok(())
        })
    };

    // Loads pushed with the KV events, through the same path (`apply_wire_batch`): the
    // worker's queue has just shrunk, so each lowers its last report (a pushed load
    // never raises one), and the load order moves the worker.
    let pusher = {
        let (routing, stop) = (routing.clone(), stop.clone());
        let ids: Vec<String> = (0..args.workers).map(|w| format!("w{w}")).collect();
        let per_s = args.load_pushes_per_worker_s * args.workers as u64;
        let headroom = !args.no_headroom;
        tokio::spawn(async move {
            let (mut pacer, mut n) = (Pacer::new(per_s as f64), 0u64);
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..pacer.due().await {
                    n += 1;
                    let r = mix64(n ^ 0x9054);
                    let id = &ids[(n % ids.len() as u64) as usize];
                    let batch = pb::KvEventBatch {
                        worker_id: id.clone(),
                        events: Vec::new(),
                        load: Some(pb::LoadResponse {
                            running: (r % 4) as u32,
                            queued_prefill_tokens: (r >> 8) % 2 * 256,
                            total_blocks: 4_096,
                            free_blocks: 4_096 - ((r >> 16) % 9) as u32 * 256,
                            admit_blocks: headroom.then(|| {
                                (4_096 - ((r >> 16) % 9) as u32 * 256)
                                    .saturating_sub(((r >> 24) % 8) as u32 * 64)
                            }),
                            load_seq: n,
                            ..pb::LoadResponse::default()
                        }),
                    };
                    if let Err(e) = apply_wire_batch(&routing, id, &batch).await {
                        return Err(anyhow::anyhow!("pushing {id}'s load: {e}"));
                    }
                }
            }
            Ok(())
        })
    };

    // Requests, open loop.
    let wait = Arc::new(Histogram::new());
    let decide = Arc::new(Histogram::new());
    let lookup = Arc::new(Histogram::new());
    let lock_wait = Arc::new(Histogram::new());
    let scoring = Arc::new(Histogram::new());
    let routed = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let generator = {
        let (routing, prompts, stop, measuring) = (
            routing.clone(),
            prompts.clone(),
            stop.clone(),
            measuring.clone(),
        );
        let (wait, decide, routed, errors) =
            (wait.clone(), decide.clone(), routed.clone(), errors.clone());
        let (lookup, scoring, lock_wait) = (lookup.clone(), scoring.clone(), lock_wait.clone());
        let rate = args.rate;
        tokio::spawn(async move {
            // The runtime's timer fires at most once a millisecond: each tick starts
            // that millisecond's requests together, a burstier arrival than Poisson's.
            // (A generator thread of its own, spreading arrivals, was tried: a third
            // busy thread on 2 cores preempts decisions holding the lock, which the
            // router process, whose requests arrive on its runtime threads, does not.)
            let (mut pacer, mut n) = (Pacer::new(rate as f64), 0u64);
            while !stop.load(Ordering::Relaxed) {
                for _ in 0..pacer.due().await {
                    n += 1;
                    let r = mix64(n ^ 0x5eed);
                    let body = &prompts.chains[(r % prompts.chains.len() as u64) as usize];
                    let mut chain = body.to_vec();
                    chain.extend(
                        synthetic_chain(&body[body.len() - 1..], n, TAIL_BLOCKS)
                            .into_iter()
                            .skip(1),
                    );
                    let hashes = chain;
                    let hold = Duration::from_micros(mix64(r) % 100_000);
                    let (lookup, scoring, lock_wait) =
                        (lookup.clone(), scoring.clone(), lock_wait.clone());
                    let (routing, wait, decide, routed, errors, measuring) = (
                        routing.clone(),
                        wait.clone(),
                        decide.clone(),
                        routed.clone(),
                        errors.clone(),
                        measuring.clone(),
                    );
                    tokio::spawn(async move {
                        let prompt_tokens = hashes.len() * bs + 7;
                        let t = Instant::now();
                        let routed_req = routing.route(&RouteRequest {
                            hashes: &hashes,
                            prompt_tokens,
                            pin: None,
                            policy: PolicyKind::CacheAware,
                            exclude: &[],
                        });
                        let waited = t.elapsed().as_nanos() as u64;
                        let Ok(r) = routed_req else {
                            errors.fetch_add(1, Ordering::Relaxed);
                            return;
                        };
                        if measuring.load(Ordering::Relaxed) {
                            wait.record(waited);
                            let d = &r.decision.timings;
                            decide.record(d.index_lookup_ns + d.scoring_ns + d.reserve_ns);
                            lookup.record(d.index_lookup_ns);
                            lock_wait.record(r.lock_wait_ns);
                            scoring.record(d.scoring_ns);
                            routed.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(hold).await;
                        if let Some(res) = r.decision.reservation {
                            routing.cancel_reservation(res);
                        }
                        r.in_flight
                            .record_outcome(r.decision.predicted_cached_tokens);
                    });
                }
            }
        })
    };

    tokio::time::sleep(Duration::from_secs(1)).await;
    measuring.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let elapsed = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    generator.await?;
    reporter.await??;
    pusher.await??;
    for t in feeder_tasks {
        t.await??;
    }
    Ok(RouterScaleReport {
        workers: args.workers,
        indexed_worker_blocks,
        routed_per_s: routed.load(Ordering::Relaxed) as f64 / elapsed,
        target_rate: args.rate,
        event_blocks_per_s: event_blocks.load(Ordering::Relaxed) as f64 / elapsed,
        wait_us: wait.summary_us(),
        decide_us: decide.summary_us(),
        lookup_us: lookup.summary_us(),
        lock_us: lock_wait.summary_us(),
        scoring_us: scoring.summary_us(),
        errors: errors.load(Ordering::Relaxed),
        full_scan: args.full_scan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histogram_reports_bucket_upper_bounds_and_the_exact_max() {
        let h = Histogram::new();
        // 1,000 samples: 0.1 µs … 100 µs.
        for i in 1..=1_000u64 {
            h.record(i * 100);
        }
        h.record(u64::MAX / 2);
        assert_eq!(h.count(), 1_001);
        let [p50, p90, p99, p999, max] = h.summary_us();
        // The 501st sample is 50.1 µs, in the bucket ending at 50.25 µs.
        assert_eq!(p50, 50.25);
        assert_eq!(p90, 90.25);
        assert_eq!(p99, 99.25);
        assert_eq!(p999, 100.25);
        assert_eq!(max, (u64::MAX / 2) as f64 / 1000.0);
    }

    #[test]
    fn request_chains_extend_a_body_and_differ_only_in_their_tail() {
        let p = Prompts::new(3);
        let body = &p.chains[1];
        assert_eq!(body.len(), SYSTEM_BLOCKS + BODY_BLOCKS);
        assert_eq!(&body[..SYSTEM_BLOCKS], &p.chains[2][..SYSTEM_BLOCKS]);
        let tail = |n| synthetic_chain(&body[body.len() - 1..], n, TAIL_BLOCKS);
        let (a, b) = (tail(1), tail(2));
        assert_eq!(a[0], body[body.len() - 1]);
        assert_eq!(a.len(), TAIL_BLOCKS + 1);
        assert_ne!(a[1..], b[1..]);
    }
}
