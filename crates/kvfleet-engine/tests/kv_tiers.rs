//! The host and disk tiers below the block pool, end to end on the seeded `tiny`
//! model: a prefix evicted from the pool comes back from host memory or disk as cached
//! tokens with the logits of a cold run; a corrupt or missing block file, or a full
//! disk, means recompute (and a counter), never wrong K/V.

use kvfleet_engine::kv_tiers::disk_tier::STAGING_FILE;
use kvfleet_engine::{
    CpuBackend, DiskTierConfig, Engine, EngineConfig, KvBlockReader, KvEventKind, LlamaModel,
    Medium, ModelBackend, ModelConfig, RecordingSink, Request, SamplingParams, TierConfig,
};
mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use support::{max_diff, prompt};

const BS: usize = 16;

fn model() -> Arc<LlamaModel> {
    Arc::new(LlamaModel::seeded(ModelConfig::tiny(), 7).expect("seeded model"))
}

fn engine(model: &Arc<LlamaModel>, num_blocks: usize) -> Engine {
    engine_on(CpuBackend::new(model.clone(), num_blocks, BS))
}

fn engine_on(backend: CpuBackend) -> Engine {
    engine_with_steps(backend, 4, 256)
}

/// An engine of `seqs` sequences and steps of `step_tokens` on `backend`.
fn engine_with_steps(backend: CpuBackend, seqs: usize, step_tokens: usize) -> Engine {
    Engine::new(
        EngineConfig {
            model_id: "tiny".into(),
            block_size: BS,
            max_num_seqs: seqs,
            max_batched_tokens: step_tokens,
            max_prefill_chunk: step_tokens,
            decode_reserve: Default::default(),
        },
        Box::new(backend),
        None,
    )
    .expect("engine")
}

/// An engine whose steps are small (one sequence, 32 tokens): the next step can evict
/// at most 5 blocks, so a pool of 10 has blocks beyond that horizon, which the
/// write-out thread copies while the engine steps.
fn small_step_engine(backend: CpuBackend) -> Engine {
    engine_with_steps(backend, 1, 2 * BS)
}

/// A reader that copies through `inner` only once the gate opens: a write-out that is
/// as slow as the test wants.
struct GatedReader {
    inner: Arc<dyn KvBlockReader>,
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

impl GatedReader {
    fn closed(inner: Arc<dyn KvBlockReader>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            open: std::sync::Mutex::new(false),
            opened: std::sync::Condvar::new(),
        })
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl KvBlockReader for GatedReader {
    fn read_blocks(&self, ids: &[u32]) -> kvfleet_engine::Result<Vec<Vec<u8>>> {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        self.inner.read_blocks(ids)
    }
}

/// A small-step engine of 10 blocks over a host tier of 32, whose write-out copies
/// through a closed [`GatedReader`].
fn gated_engine(m: &Arc<LlamaModel>) -> (Engine, Arc<GatedReader>) {
    let backend = CpuBackend::new(m.clone(), 10, BS);
    let gate = GatedReader::closed(backend.block_reader().expect("an off-thread reader"));
    let mut e = small_step_engine(backend);
    let cfg = TierConfig {
        host_bytes: host_bytes(&e, 32),
        disk: None,
    };
    e.set_kv_tiers(&cfg).expect("tiers");
    e.set_write_out(Some(gate.clone() as Arc<dyn KvBlockReader>))
        .expect("write-out");
    (e, gate)
}

#[test]
fn blocks_beyond_the_next_step_are_copied_down_off_the_engine_thread() {
    let m = model();
    let a = prompt(61, 4 * BS + 3);
    let want = cold(&m, &a);
    let (mut e, gate) = gated_engine(&m);
    run(&mut e, 1, &a);
    // A's four cached blocks now sit behind six uncached ones in the free list: beyond
    // the next step's horizon of five. The next step asks the write-out thread for them.
    run(&mut e, 2, &prompt(62, BS + 3));
    let demoted = |e: &Engine| {
        let t = e.tier_stats().expect("tiers on");
        (t.demoted_blocks, t.demoted_off_thread)
    };
    assert_eq!(demoted(&e), (0, 0), "nothing was near eviction");
    gate.open();
    assert!(e.flush_tiers(Duration::from_secs(10)), "the copies land");
    assert_eq!(demoted(&e), (4, 4), "A's blocks, copied off-thread");
    // A long prompt takes the whole pool; A's blocks are in the host tier already.
    run(&mut e, 3, &prompt(63, 8 * BS + 3));
    let again = run(&mut e, 4, &a);
    assert_eq!((again.cached, again.host), (4 * BS, 4 * BS));
    let d = max_diff(&again.logits, &want);
    assert!(
        d <= 1e-5,
        "a prefix copied off-thread changes the logits by {d}"
    );
    let stats = e.tier_stats().expect("tiers on");
    assert_eq!(stats.demotion_misses, 0, "{stats:?}");
}

#[test]
fn a_write_out_that_never_finishes_holds_up_no_step_and_loses_no_block() {
    let m = model();
    let a = prompt(71, 4 * BS + 3);
    let want = cold(&m, &a);
    let (mut e, gate) = gated_engine(&m);
    // The write-out thread blocks on its first copy for the whole test: every step
    // below completes regardless, and what reaches the horizon is copied in-thread.
    run(&mut e, 1, &a);
    for (i, seed) in (72..76).enumerate() {
        run(&mut e, 2 + i as u64, &prompt(seed, 6 * BS + 3));
    }
    let again = run(&mut e, 9, &a);
    assert_eq!((again.cached, again.host), (4 * BS, 4 * BS));
    let d = max_diff(&again.logits, &want);
    assert!(d <= 1e-5, "promoted prefix changes the logits by {d}");
    let stats = e.tier_stats().expect("tiers on");
    assert_eq!(stats.demoted_off_thread, 0, "the gate never opened");
    assert!(stats.demoted_blocks >= 4, "{stats:?}");
    assert_eq!(stats.demotion_misses, 0);
    // Let the thread finish, so the engine's drop can join it.
    gate.open();
}

/// Room for `blocks` blocks in the host tier (payload plus bookkeeping).
fn host_bytes(e: &Engine, blocks: usize) -> usize {
    blocks * (e.block_format().1 + 96)
}

struct Run {
    logits: Vec<f32>,
    cached: usize,
    host: usize,
    disk: usize,
}

fn run(e: &mut Engine, id: u64, tokens: &[u32]) -> Run {
    e.set_logits_capture(true);
    let params = SamplingParams {
        max_tokens: 1,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    e.add_request(Request::new(id, tokens.to_vec(), params))
        .expect("add");
    let mut out = None;
    let mut steps = 0;
    while e.has_unfinished() {
        steps += 1;
        assert!(steps < 10_000, "engine made no progress");
        for o in e.step().expect("step") {
            if o.id == id && o.logits.is_some() {
                out = Some(Run {
                    logits: o.logits.unwrap_or_default(),
                    cached: o.cached_tokens,
                    host: o.promoted.host,
                    disk: o.promoted.disk,
                });
            }
        }
        e.check_invariants().expect("pool invariants");
    }
    out.expect("a sampled token")
}

/// The same prompt on a fresh engine without tiers.
fn cold(model: &Arc<LlamaModel>, tokens: &[u32]) -> Vec<f32> {
    run(&mut engine(model, 64), 1, tokens).logits
}

#[test]
fn a_prefix_evicted_to_host_memory_comes_back_cached_with_cold_logits() {
    let m = model();
    let a = prompt(1, 5 * BS + 3);
    let b = prompt(2, 7 * BS + 3);
    let want = cold(&m, &a);

    let mut e = engine(&m, 8);
    let sink = RecordingSink::new();
    e.set_event_sink(Arc::new(sink.clone()));
    let cfg = TierConfig {
        host_bytes: host_bytes(&e, 32),
        disk: None,
    };
    e.set_kv_tiers(&cfg).expect("tiers");
    assert_eq!(run(&mut e, 1, &a).cached, 0);
    // B needs the whole pool: A's blocks leave it, into the host tier.
    assert_eq!(run(&mut e, 2, &b).cached, 0);
    let again = run(&mut e, 3, &a);
    assert_eq!(
        again.cached,
        5 * BS,
        "A's five full blocks are cached again"
    );
    assert_eq!(again.host, 5 * BS, "all of them promoted from host memory");
    let d = max_diff(&again.logits, &want);
    assert!(d <= 1e-5, "promoted prefix changes the logits by {d}");

    let stats = e.tier_stats().expect("tiers on");
    assert!(stats.demoted_blocks >= 5, "{stats:?}");
    assert_eq!(stats.promoted_host, 5);
    assert_eq!(
        stats.demotion_misses, 0,
        "write-behind copied every evicted block"
    );
    let events = sink.events();
    let host_stored: usize = events
        .iter()
        .filter_map(|ev| match &ev.kind {
            KvEventKind::Stored {
                block_hashes,
                medium: Medium::Host,
                ..
            } => Some(block_hashes.len()),
            _ => None,
        })
        .sum();
    assert!(host_stored >= 5, "host-tier Stored events: {host_stored}");
    let dump = e.cache_dump();
    assert!(dump.iter().any(|d| d.medium == Medium::Host));
}

/// An engine whose host tier holds one block, over a disk tier in `dir`.
fn disk_engine(m: &Arc<LlamaModel>, dir: &Path) -> Engine {
    let mut e = engine(m, 8);
    let cfg = TierConfig {
        host_bytes: host_bytes(&e, 1),
        disk: Some(DiskTierConfig {
            dir: dir.to_path_buf(),
            max_bytes: 1 << 30,
        }),
    };
    e.set_kv_tiers(&cfg).expect("tiers");
    e
}

/// Runs A, then enough other prompts to push A's blocks through host memory onto
/// disk, and waits for the writes.
fn push_to_disk(e: &mut Engine, a: &[u32]) {
    assert_eq!(run(e, 1, a).cached, 0);
    for (i, seed) in [2u32, 3, 4].iter().enumerate() {
        run(e, 10 + i as u64, &prompt(*seed, 7 * BS + 3));
    }
    assert!(e.flush_tiers(Duration::from_secs(10)), "disk writes landed");
}

#[test]
fn a_prefix_pushed_to_disk_comes_back_cached_with_cold_logits() {
    let m = model();
    let dir = tempfile::tempdir().expect("tempdir");
    let a = prompt(1, 5 * BS + 3);
    let want = cold(&m, &a);
    let mut e = disk_engine(&m, dir.path());
    push_to_disk(&mut e, &a);
    let files = std::fs::read_dir(dir.path()).expect("dir").count();
    assert!(files >= 5, "block files written: {files}");
    let again = run(&mut e, 3, &a);
    assert_eq!(again.cached, 5 * BS);
    assert!(again.disk >= 4 * BS, "promoted from disk: {}", again.disk);
    let d = max_diff(&again.logits, &want);
    assert!(d <= 1e-5, "disk-promoted prefix changes the logits by {d}");
    let s = e.tier_stats().expect("tiers");
    assert!(s.promoted_disk >= 4, "{s:?}");
    assert!(s.disk.written_blocks >= 5, "{s:?}");
}

#[test]
fn a_corrupt_or_missing_block_file_is_recomputed_not_served() {
    let m = model();
    let dir = tempfile::tempdir().expect("tempdir");
    let a = prompt(1, 5 * BS + 3);
    let want = cold(&m, &a);
    let mut e = disk_engine(&m, dir.path());
    push_to_disk(&mut e, &a);
    // Damage every block file: flip a byte in the middle of each, delete one.
    let mut files: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .flatten()
        .map(|f| f.path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvb"))
        .collect();
    files.sort();
    let gone = files.pop().expect("a block file");
    std::fs::remove_file(gone).expect("rm");
    for f in &files {
        let mut bytes = std::fs::read(f).expect("read");
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(f, bytes).expect("write");
    }
    let again = run(&mut e, 3, &a);
    assert_eq!(again.disk, 0, "nothing promoted from damaged files");
    let d = max_diff(&again.logits, &want);
    assert!(d <= 1e-5, "logits after corrupt files differ by {d}");
    let s = e.tier_stats().expect("tiers");
    assert!(s.disk.corrupt >= 1, "corrupt reads counted: {s:?}");
    // A fourth run finds A in the pool again (recomputed, cached normally).
    assert_eq!(run(&mut e, 4, &a).cached, 5 * BS);
}

#[test]
fn a_full_disk_stops_demotion_and_is_counted() {
    let m = model();
    let dir = tempfile::tempdir().expect("tempdir");
    // Every write goes through the staging file: pointing it at /dev/full makes each
    // one fail with ENOSPC from the kernel, as on a full disk.
    std::os::unix::fs::symlink("/dev/full", dir.path().join(STAGING_FILE)).expect("symlink");
    let a = prompt(1, 5 * BS + 3);
    let want = cold(&m, &a);
    let mut e = disk_engine(&m, dir.path());
    push_to_disk(&mut e, &a);
    let s = e.tier_stats().expect("tiers");
    assert!(s.disk.full >= 1, "full disk counted: {s:?}");
    assert_eq!(s.disk.written_blocks, 0);
    assert_eq!(s.disk_blocks, 0, "nothing is believed on disk");
    assert!(e.cache_dump().iter().all(|d| d.medium != Medium::Disk));
    let again = run(&mut e, 3, &a);
    assert_eq!(again.disk, 0);
    assert!(max_diff(&again.logits, &want) <= 1e-5);
}

mod props {
    use super::*;
    use kvfleet_engine::{DumpedBlock, KvEvent};
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};

    /// Prompts from four shared prefixes with short distinct tails, so requests hit,
    /// miss and evict each other's blocks in every tier.
    fn prompt_of(family: u32, tail: u32, blocks: usize) -> Vec<u32> {
        let mut p = prompt(100 + family, blocks * BS);
        p.extend(prompt(1000 + tail, 3));
        p
    }

    /// What the events say each tier holds.
    fn replay(events: &[KvEvent]) -> BTreeSet<(u64, Medium)> {
        let mut held = BTreeSet::new();
        for e in events {
            match &e.kind {
                KvEventKind::Stored {
                    block_hashes,
                    medium,
                    ..
                } => {
                    for h in block_hashes {
                        held.insert((h.0, *medium));
                    }
                }
                KvEventKind::Removed {
                    block_hashes,
                    medium,
                } => {
                    for h in block_hashes {
                        held.remove(&(h.0, *medium));
                    }
                }
                KvEventKind::Cleared => held.clear(),
            }
        }
        held
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Whatever the order of requests and however blocks move between the pool,
        /// host memory and disk, copied down on the engine thread or off it: every
        /// request's logits equal a cold run's (no block is served after it left every
        /// tier, none is torn), the pool's invariants
        /// hold after every step, and the events describe exactly what the cache
        /// dump lists, tier by tier.
        #[test]
        fn tiers_never_serve_a_wrong_block(
            reqs in proptest::collection::vec((0u32..4, 0u32..3, 1usize..6), 1..8),
            pool in 8usize..12,
            host_blocks in 0usize..4,
            small_steps in any::<bool>(),
        ) {
            let m = model();
            let dir = tempfile::tempdir().expect("tempdir");
            // Small steps leave blocks beyond the next step's horizon: the write-out
            // thread copies those while the engine steps.
            let mut e = if small_steps {
                small_step_engine(CpuBackend::new(m.clone(), pool, BS))
            } else {
                engine(&m, pool)
            };
            let sink = RecordingSink::new();
            e.set_event_sink(Arc::new(sink.clone()));
            let cfg = TierConfig {
                host_bytes: host_bytes(&e, host_blocks.max(1)),
                disk: Some(DiskTierConfig { dir: dir.path().to_path_buf(), max_bytes: 6 * (e.block_format().1 as u64 + 64) }),
            };
            e.set_kv_tiers(&cfg).expect("tiers");
            let mut reference: HashMap<(u32, u32, usize), Vec<f32>> = HashMap::new();
            for (i, &(family, tail, blocks)) in reqs.iter().enumerate() {
                let p = prompt_of(family, tail, blocks);
                let want = reference
                    .entry((family, tail, blocks))
                    .or_insert_with(|| cold(&m, &p))
                    .clone();
                let got = run(&mut e, 100 + i as u64, &p);
                prop_assert!(max_diff(&got.logits, &want) <= 1e-5, "request {i} logits differ");
                prop_assert!(got.cached <= blocks * BS);
                prop_assert!(got.host + got.disk <= got.cached);
            }
            prop_assert!(e.flush_tiers(Duration::from_secs(10)));
            let dumped: BTreeSet<(u64, Medium)> = e
                .cache_dump()
                .into_iter()
                .map(|d: DumpedBlock| (d.hash.0, d.medium))
                .collect();
            prop_assert_eq!(replay(&sink.events()), dumped);
        }
    }
}

#[test]
fn blocks_exported_by_one_engine_and_imported_by_another_give_the_cold_logits() {
    let m = model();
    let a = prompt(1, 5 * BS + 3);
    let want = cold(&m, &a);
    let mut holder = engine(&m, 16);
    run(&mut holder, 1, &a);
    let hashes = kvfleet_core::hash_blocks(holder.namespace_seed(""), &a, BS);
    let blocks = holder.export_blocks(&hashes).expect("export");
    assert_eq!(blocks.len(), 5, "every full block of A is exported");
    assert_eq!(blocks[1].parent, Some(hashes[0]));

    let mut puller = engine(&m, 16);
    puller.set_logits_capture(true);
    let params = SamplingParams {
        max_tokens: 1,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    puller
        .add_request(Request::new(7, a.clone(), params))
        .expect("add");
    assert_eq!(puller.stage_peer_blocks(7, &blocks), 5);
    let mut got = None;
    while puller.has_unfinished() {
        for o in puller.step().expect("step") {
            if o.logits.is_some() {
                got = Some(o);
            }
        }
    }
    let o = got.expect("a sampled token");
    assert_eq!(o.cached_tokens, 5 * BS);
    assert_eq!(o.promoted.peer, 5 * BS);
    let d = max_diff(o.logits.as_deref().unwrap_or_default(), &want);
    assert!(d <= 1e-5, "peer-imported prefix changes the logits by {d}");
    // A block of the wrong size is refused, not imported.
    let mut bad = blocks[0].clone();
    bad.bytes = std::sync::Arc::from(&bad.bytes[1..]);
    let mut other = engine(&m, 16);
    other
        .add_request(Request::new(8, a.clone(), SamplingParams::default()))
        .expect("add");
    assert_eq!(other.stage_peer_blocks(8, &[bad]), 0);
}

#[test]
fn blocks_copied_from_another_thread_while_the_engine_evicts_them_are_never_torn() {
    // Four prompts of five blocks take turns in a 12-block pool, so every run evicts
    // blocks another thread may be copying; every block it is handed must hold its
    // own prompt's K/V, never some of another's.
    let m = model();
    let prompts: Vec<Vec<u32>> = (0..4).map(|s| prompt(40 + s, 5 * BS + 3)).collect();
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let mut reference = std::collections::HashMap::new();
    let mut all_hashes = Vec::new();
    for p in &prompts {
        let mut alone = engine(&m, 16);
        run(&mut alone, 1, p);
        let hashes = kvfleet_core::hash_blocks(alone.namespace_seed(""), p, BS);
        for b in alone.export_blocks(&hashes).expect("export") {
            reference.insert(b.hash, floats(&b.bytes));
        }
        all_hashes.push(hashes);
    }
    assert_eq!(reference.len(), 20, "the prompts share no block");

    let backend = CpuBackend::new(m.clone(), 12, BS);
    let memory = backend
        .block_reader()
        .expect("the CPU backend reads off-thread");
    let mut e = engine_on(backend);
    // Each copy starts a moment after its lookup, so that the engine often evicts and
    // rewrites a block between the two: what the exporter must notice.
    let exporter = e
        .block_exporter()
        .expect("an exporter")
        .with_reader(Arc::new(SlowReader(memory)));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let copier = {
        let stop = Arc::clone(&stop);
        let reference = reference.clone();
        std::thread::spawn(move || {
            let (mut served, mut torn) = (0usize, 0usize);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for hashes in &all_hashes {
                    for b in exporter.export(hashes).expect("copy") {
                        served += 1;
                        let want = &reference[&b.hash];
                        if max_diff(&floats(&b.bytes), want) > 1e-3 {
                            torn += 1;
                        }
                    }
                }
            }
            (served, torn)
        })
    };
    let mut id = 10;
    for _ in 0..25 {
        for p in &prompts {
            id += 1;
            run(&mut e, id, p);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (served, torn) = copier.join().expect("copier");
    assert_eq!(torn, 0, "{torn} of {served} copied blocks held other K/V");
    assert!(
        served > 0,
        "the copier was served blocks while the engine ran"
    );
}

/// Copies through `.0` after a pause.
struct SlowReader(Arc<dyn KvBlockReader>);

impl KvBlockReader for SlowReader {
    fn read_blocks(&self, ids: &[u32]) -> kvfleet_engine::Result<Vec<Vec<u8>>> {
        std::thread::sleep(Duration::from_micros(300));
        self.0.read_blocks(ids)
    }
}
