//! Router core costs at fleet scale: 1M cached blocks over 256 workers.
//!
//! - `find_matches` for a 2,048-block prompt, fully cached (the worst case for a walk)
//!   and half cached, against the exact linear walk for comparison; and
//!   `find_tiered_matches` once every chain's holders also keep 1,024 blocks of another
//!   chain in a host tier;
//! - KV event apply throughput (blocks/s), `Stored` then `Removed` of 1,024 blocks;
//! - `KvRouter::route` end to end: a fully cached prompt, and a fork child whose
//!   2,000-block prefix is cached and whose 48-block tail gets reserved; then the same
//!   on a loaded fleet (`route_loaded_1M_256w`: as `kvfleet bench router-scale` loads
//!   it, a third of the prefill lanes busy, KV pools at every usage level, admission
//!   headroom reported, so that `cache-aware` walks the load order of every level),
//!   and that over 1,024 workers (`route_loaded_1M_1024w`);
//! - each policy's choice among 256 candidates.
//!
//! Criterion reports means and medians; before it runs, the binary times 10,000 single
//! calls with `Instant` and prints p50/p90/p99/max to stderr (Dynamo's published
//! figure is a p99): on 256 rotating queries, and "spread" over the whole index
//! (random chain, random length or divergence depth) so probes are not cache-hot.
//!
//! `cargo bench --bench router` (about 40 s)

use criterion::{BenchmarkId, Criterion, Throughput};
use kvfleet_bench::synthetic_load::polled_load;
use kvfleet_bench::token_blocks::synthetic_chain;
use kvfleet_core::BlockHash;
use kvfleet_routing::policy::mix64;
use kvfleet_routing::{KvRouter, PolicyKind, PrefixIndex, RouterConfig, RouterKvEvent, WorkerIdx};
use std::hint::black_box;
use std::time::{Duration, Instant};

const WORKERS: usize = 256;
const PROMPT_BLOCKS: usize = 2_048;
/// A system prompt every worker holds.
const SHARED_BLOCKS: usize = 64;
/// Chains of 2,048 blocks (64 shared + 1,984 unique) give ~1M distinct blocks.
const CHAINS: usize = 504;
/// Each chain is cached on this many workers.
const REPLICAS: usize = 2;

struct Fleet {
    chains: Vec<Vec<BlockHash>>,
    /// Events per worker, in order, to build either an index or a router.
    events: Vec<Vec<RouterKvEvent>>,
}

fn fleet(workers: usize) -> Fleet {
    let shared = synthetic_chain(&[], 1, SHARED_BLOCKS);
    let chains: Vec<Vec<BlockHash>> = (0..CHAINS)
        .map(|c| synthetic_chain(&shared, 1_000 + c as u64, PROMPT_BLOCKS - SHARED_BLOCKS))
        .collect();
    let mut events: Vec<Vec<RouterKvEvent>> = vec![Vec::new(); workers];
    for evs in events.iter_mut() {
        evs.push(RouterKvEvent::stored(1, None, shared.clone()));
    }
    for (c, chain) in chains.iter().enumerate() {
        for r in 0..REPLICAS {
            let w = (c + r * workers / REPLICAS) % workers;
            let seq = events[w].len() as u64 + 1;
            events[w].push(RouterKvEvent::stored(
                seq,
                Some(chain[SHARED_BLOCKS - 1]),
                chain[SHARED_BLOCKS..].to_vec(),
            ));
        }
    }
    Fleet { chains, events }
}

fn build_index(f: &Fleet) -> PrefixIndex {
    let mut idx = PrefixIndex::with_capacity(1 << 20, WORKERS);
    for (w, evs) in f.events.iter().enumerate() {
        for e in evs {
            if let Err(err) = idx.apply(WorkerIdx(w as u32), e) {
                panic!("building the index: {err}");
            }
        }
    }
    idx
}

fn build_router(f: &Fleet) -> KvRouter {
    let mut r = KvRouter::new(RouterConfig::default());
    for (w, evs) in f.events.iter().enumerate() {
        let id = format!("worker-{w}");
        if let Err(err) = r.add_worker(&id, 16) {
            panic!("adding a worker: {err}");
        }
        for e in evs {
            if let Err(err) = r.apply_event(&id, e) {
                panic!("building the router: {err}");
            }
        }
    }
    r
}

/// Query sets, rotated so repeated lookups do not always hit the same cache lines.
struct Queries {
    full: Vec<Vec<BlockHash>>,
    half: Vec<Vec<BlockHash>>,
    fork_child: Vec<Vec<BlockHash>>,
}

fn queries(f: &Fleet) -> Queries {
    let n = 256.min(f.chains.len());
    Queries {
        full: f.chains[..n].to_vec(),
        half: (0..n)
            .map(|c| {
                synthetic_chain(
                    &f.chains[c][..PROMPT_BLOCKS / 2],
                    77_000 + c as u64,
                    PROMPT_BLOCKS / 2,
                )
            })
            .collect(),
        fork_child: (0..n)
            .map(|c| synthetic_chain(&f.chains[c][..2_000], 99_000 + c as u64, 48))
            .collect(),
    }
}

fn percentiles(label: &str, mut samples: Vec<u64>) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    eprintln!(
        "{label:<44} n={} p50={:>6} ns  p90={:>6} ns  p99={:>6} ns  p99.9={:>6} ns  max={:>7} ns",
        samples.len(),
        at(0.50),
        at(0.90),
        at(0.99),
        at(0.999),
        samples[samples.len() - 1],
    );
}

fn time_each(n: usize, mut f: impl FnMut(usize)) -> Vec<u64> {
    // Warm up caches and branch predictors first.
    for i in 0..n / 10 {
        f(i);
    }
    (0..n)
        .map(|i| {
            let t = Instant::now();
            f(i);
            t.elapsed().as_nanos() as u64
        })
        .collect()
}

fn report_percentiles(f: &Fleet, idx: &PrefixIndex, router: &mut KvRouter, q: &Queries) {
    const N: usize = 10_000;
    eprintln!(
        "\nrouter percentiles: {} blocks indexed, {WORKERS} workers, {PROMPT_BLOCKS}-block prompts",
        idx.num_blocks()
    );
    let mut m = kvfleet_routing::Matches::new();
    percentiles(
        "find_matches  fully cached, 256 hot queries",
        time_each(N, |i| {
            idx.find_matches_into(black_box(&q.full[i % q.full.len()]), &mut m);
            black_box(&m);
        }),
    );
    percentiles(
        "find_matches  half cached, 256 hot queries",
        time_each(N, |i| {
            idx.find_matches_into(black_box(&q.half[i % q.half.len()]), &mut m);
            black_box(&m);
        }),
    );
    percentiles(
        "find_matches_exact  fully cached (linear)",
        time_each(N / 10, |i| {
            black_box(idx.find_matches_exact(black_box(&q.full[i % q.full.len()])));
        }),
    );
    // Tiers: worker c+1 also holds the first half of chain c's own blocks in host
    // memory (and the shared prefix on its device, like everyone).
    let mut tiered = idx.clone();
    for (c, chain) in f.chains.iter().enumerate() {
        let w = WorkerIdx(((c + 1) % WORKERS) as u32);
        let ev = RouterKvEvent {
            seq: tiered.last_seq(w) + 1,
            kind: kvfleet_routing::RouterKvEventKind::Stored {
                parent_hash: Some(chain[SHARED_BLOCKS - 1]),
                block_hashes: chain[SHARED_BLOCKS..PROMPT_BLOCKS / 2].to_vec(),
                medium: kvfleet_routing::Medium::Host,
            },
        };
        if let Err(err) = tiered.apply(w, &ev) {
            panic!("building the tiered index: {err}");
        }
    }
    let mut tm = kvfleet_routing::TieredMatches::new();
    percentiles(
        "find_tiered_matches  fully cached, one host holder each",
        time_each(N, |i| {
            tiered.find_tiered_matches_into(black_box(&q.full[i % q.full.len()]), &mut tm);
            black_box(&tm);
        }),
    );
    percentiles(
        "find_tiered_matches  no lower tier (= find_matches)",
        time_each(N, |i| {
            idx.find_tiered_matches_into(black_box(&q.full[i % q.full.len()]), &mut tm);
            black_box(&tm);
        }),
    );
    drop(tiered);
    // Spread: every lookup takes a random chain cut at a random length (or diverging
    // at a random depth), so probes land all over the 1M-block index instead of on a
    // few hundred hot entries. The prompt's own hashes are in cache, as in the router
    // (it has just computed them).
    let pool = synthetic_chain(&[], 31_337, PROMPT_BLOCKS);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng as usize
    };
    let mut buf: Vec<BlockHash> = Vec::with_capacity(PROMPT_BLOCKS);
    let mut spread = |half: bool| {
        (0..N)
            .map(|_| {
                let chain = &f.chains[next() % f.chains.len()];
                buf.clear();
                if half {
                    let split = SHARED_BLOCKS + next() % (PROMPT_BLOCKS - SHARED_BLOCKS);
                    buf.extend_from_slice(&chain[..split]);
                    buf.extend_from_slice(&pool[split..]);
                } else {
                    buf.extend_from_slice(
                        &chain[..PROMPT_BLOCKS / 2 + next() % (PROMPT_BLOCKS / 2)],
                    );
                }
                let t = Instant::now();
                idx.find_matches_into(black_box(&buf), &mut m);
                let ns = t.elapsed().as_nanos() as u64;
                black_box(&m);
                ns
            })
            .collect::<Vec<u64>>()
    };
    percentiles(
        "find_matches  fully cached, spread over index",
        spread(false),
    );
    percentiles(
        "find_matches  diverging at random depth, spread",
        spread(true),
    );
    let mut lookup = Vec::with_capacity(N);
    let mut scoring = Vec::with_capacity(N);
    percentiles(
        "route  fork child (2,000 cached + 48 new)",
        time_each(N, |i| {
            let h = &q.fork_child[i % q.fork_child.len()];
            match router.route(black_box(h), h.len() * 16, PolicyKind::CacheAware, 0) {
                Ok(d) => {
                    lookup.push(d.timings.index_lookup_ns);
                    scoring.push(d.timings.scoring_ns);
                    if let Some(r) = d.reservation {
                        router.cancel_reservation(r);
                    }
                    let _ = router.request_finished(&d.worker, d.prefill_tokens);
                }
                Err(e) => panic!("route: {e}"),
            }
        }),
    );
    percentiles("  of which index + reservation lookup", lookup);
    percentiles("  of which scoring (256 candidates)", scoring);
    eprintln!();
}

/// Loads as `kvfleet bench router-scale` reports them, on `workers` workers.
fn load_fleet(router: &mut KvRouter, workers: usize) {
    for w in 0..workers {
        let load = polled_load(mix64(w as u64 ^ 0x10ad), true);
        if let Err(err) = router.update_load(&format!("worker-{w}"), load) {
            panic!("loading the fleet: {err}");
        }
    }
}

/// `KvRouter::route` of the fully cached queries and the fork children, each decision
/// undone (reservation, running chain, in-flight count) so that every iteration sees
/// the same state.
fn route_group(c: &mut Criterion, name: &str, router: &mut KvRouter, q: &Queries) {
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(1));
    for (name, set) in [("fully_cached", &q.full), ("fork_child", &q.fork_child)] {
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % set.len();
                let h = &set[i];
                let d = router.route(black_box(h), h.len() * 16 + 5, PolicyKind::CacheAware, 0);
                if let Ok(d) = &d {
                    if let Some(r) = d.reservation {
                        router.cancel_reservation(r);
                    }
                    if let Some(r) = d.running {
                        router.request_done(r);
                    }
                    let _ = router.request_finished(&d.worker, d.prefill_tokens);
                }
                black_box(d.is_ok())
            })
        });
    }
    g.finish();
}

fn main() {
    let t = Instant::now();
    let f = fleet(WORKERS);
    let idx = build_index(&f);
    let mut router = build_router(&f);
    let q = queries(&f);
    eprintln!(
        "built index ({} blocks) and router in {:.2?}",
        idx.num_blocks(),
        t.elapsed()
    );
    report_percentiles(&f, &idx, &mut router, &q);

    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();

    {
        let mut g = c.benchmark_group("find_matches_2048_vs_1M_256w");
        g.throughput(Throughput::Elements(1));
        let mut m = kvfleet_routing::Matches::new();
        for (name, set) in [("fully_cached", &q.full), ("half_cached", &q.half)] {
            let mut i = 0;
            g.bench_function(BenchmarkId::new("bisection", name), |b| {
                b.iter(|| {
                    i = (i + 1) % set.len();
                    idx.find_matches_into(black_box(&set[i]), &mut m);
                    black_box(m.deepest())
                })
            });
        }
        let mut i = 0;
        g.bench_function(BenchmarkId::new("exact_linear", "fully_cached"), |b| {
            b.iter(|| {
                i = (i + 1) % q.full.len();
                black_box(idx.find_matches_exact(black_box(&q.full[i])).deepest())
            })
        });
        g.finish();
    }

    {
        // Churn on a full index: store 1,024 new blocks, then remove them.
        let mut idx = idx;
        let chain = synthetic_chain(&[], 424_242, 1_024);
        let worker = WorkerIdx(7);
        let mut seq = idx.last_seq(worker);
        let mut g = c.benchmark_group("apply_events_1M_256w");
        g.throughput(Throughput::Elements(2 * chain.len() as u64));
        g.bench_function("stored_then_removed_1024", |b| {
            b.iter(|| {
                seq += 1;
                let stored = RouterKvEvent::stored(seq, None, chain.clone());
                seq += 1;
                let removed = RouterKvEvent::removed(seq, chain.clone());
                let ok = idx.apply(worker, &stored).is_ok() && idx.apply(worker, &removed).is_ok();
                black_box(ok)
            })
        });
        g.finish();
    }

    route_group(&mut c, "route_1M_256w", &mut router, &q);

    load_fleet(&mut router, WORKERS);
    route_group(&mut c, "route_loaded_1M_256w", &mut router, &q);
    drop(router);

    // The same chains over 1,024 workers (most hold one chain, every one the system
    // prompt): the decision grows with the workers holding the prompt's first block.
    let mut router = build_router(&fleet(1_024));
    load_fleet(&mut router, 1_024);
    route_group(&mut c, "route_loaded_1M_1024w", &mut router, &q);

    {
        // Policy choice alone over 256 candidates, half of them matching 1,000 blocks.
        use kvfleet_routing::policy::{
            CacheAware, Candidate, ConsistentHash, FleetLoad, LeastLoaded, RandomPolicy,
            RouteContext, RoutingPolicy,
        };
        use kvfleet_routing::CandidateLoad;
        let candidates: Vec<Candidate> = (0..WORKERS)
            .map(|w| Candidate {
                worker: WorkerIdx(w as u32),
                id_hash: mix64(w as u64),
                load: CandidateLoad::new(w % 17, (w * 7_919) % 20_000),
                matched_blocks: if w % 2 == 0 { 1_000 } else { 64 },
                running_blocks: 0,
                host_blocks: 0,
                disk_blocks: 0,
                kv_movable: true,
            })
            .collect();
        let ctx = RouteContext {
            hashes: &q.full[0],
            prompt_tokens: PROMPT_BLOCKS * 16,
            block_size: 16,
            candidates: &candidates,
            fleet: FleetLoad::of(&candidates),
            peer_source: None,
            // The even candidates' match, all of it reported computed.
            deepest_blocks: 1_000,
            holder_wait_tokens: 0,
        };
        let mut policies: Vec<Box<dyn RoutingPolicy>> = vec![
            Box::new(CacheAware::default()),
            Box::new(LeastLoaded),
            Box::new(ConsistentHash::default()),
            Box::new(RandomPolicy::new(1)),
        ];
        let mut g = c.benchmark_group("policy_select_256_candidates");
        for p in policies.iter_mut() {
            let name = p.name();
            g.bench_function(name, |b| b.iter(|| black_box(p.select(black_box(&ctx)))));
        }
        g.finish();
    }

    c.final_summary();
}
