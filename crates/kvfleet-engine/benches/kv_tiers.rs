//! KV tier throughput, side by side, on real block sizes:
//! - `demote_host`: copy a block out of the KV cache (`read_block`) into the host tier,
//!   what the engine's write-behind does per block;
//! - `promote_host`: take a block from the host tier and copy it into the KV cache
//!   (`write_block`), what a host-tier hit costs per block;
//! - `disk_write`: demote through a one-block host tier so every block goes on to the
//!   disk tier, then wait for the writer (`flush`): encode, write, rename;
//! - `disk_read`: request blocks from the disk tier, wait for the reader, copy them
//!   into the KV cache (the files are in the page cache: a warm read);
//! - `memcpy`: a plain copy of the same bytes, the physical limit (`memcpy_blocks`:
//!   the same, one block at a time).
//!
//! For three geometries: the seeded `tiny` and `small` models and SmolLM2-135M's real
//! one (30 layers × 3 KV heads × head_dim 64, f32: 737,280 bytes a block), built as a
//! bare [`KvCache`] of that shape (no weights are needed to move K/V).
//!
//! Then prefill vs. promote on the seeded `tiny` and `small` models: the time to first
//! token of a 32-block prompt recomputed, against the same prompt with its 32 blocks
//! promoted from the host tier.
//!
//! Then the write-behind's share of a serving engine's time: a stream of distinct
//! prompts (4 at a time, 16 blocks each, 16 tokens generated) on a pool that holds
//! about two batches of them, so every step's newly cached blocks are copied to host
//! before they can be evicted: on the engine thread between steps, or on the write-out
//! thread while it steps. It prints the engine's own counters (`demotion_ns`, the
//! engine thread's write-behind time, against `forward_ns`; blocks copied on and off
//! the engine thread) and the stream's wall time against no tiers, side by side.
//!
//! After criterion's groups a summary table prints blocks/s, GB/s and each operation's
//! share of memcpy speed (medians of its own runs).
//!
//! `cargo bench -p kvfleet-engine --no-default-features --bench kv_tiers`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvfleet_core::BlockHash;
use kvfleet_engine::kv_cache::KvCache;
use kvfleet_engine::kv_tiers::KvTiers;
use kvfleet_engine::{
    CpuBackend, DiskTierConfig, Engine, EngineConfig, KvBlockPayload, LlamaModel, ModelConfig,
    Request, SamplingParams, TierConfig,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BS: usize = 16;
/// Blocks moved per measured operation (below the disk writer's queue of 64, so no
/// demotion is dropped for backlog).
const N: usize = 32;
/// The host tier's bookkeeping charge per block (host_tier.rs's ENTRY_OVERHEAD).
const HOST_OVERHEAD: usize = 96;
/// The disk tier's size estimate per block file beyond the payload.
const FILE_OVERHEAD: usize = 64;
const FLUSH: Duration = Duration::from_secs(30);

/// A KV shape: layers, KV heads, head width.
#[derive(Clone, Copy)]
struct Geometry {
    name: &'static str,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

const GEOMETRIES: [Geometry; 3] = [
    Geometry {
        name: "tiny",
        layers: 2,
        kv_heads: 2,
        head_dim: 16,
    },
    Geometry {
        name: "small",
        layers: 8,
        kv_heads: 4,
        head_dim: 64,
    },
    Geometry {
        name: "smollm2_135m",
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
    },
];

impl Geometry {
    /// A KV cache of `blocks` blocks, every block filled with non-zero floats (zero
    /// pages would read faster than real K/V).
    fn cache(&self, blocks: usize) -> KvCache {
        let mut kv = KvCache::new(self.layers, blocks, BS, self.kv_heads, self.head_dim);
        let bytes = kv.bytes_per_block();
        for id in 0..blocks {
            let payload: Vec<u8> = (0..bytes / 4)
                .flat_map(|i| ((i as f32 + id as f32) * 1e-3).to_le_bytes())
                .collect();
            kv.write_block(id as u32, &payload).expect("fill block");
        }
        kv
    }
}

/// One measured operation on `N` blocks, with its state.
trait Op {
    fn run(&mut self) -> Duration;
}

struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
    /// Copy in pieces of this many bytes (one block), or all at once when 0.
    piece: usize,
}

impl Op for Memcpy {
    fn run(&mut self) -> Duration {
        let t = Instant::now();
        if self.piece == 0 {
            self.dst.copy_from_slice(std::hint::black_box(&self.src));
        } else {
            for (d, s) in self
                .dst
                .chunks_mut(self.piece)
                .zip(self.src.chunks(self.piece))
            {
                d.copy_from_slice(std::hint::black_box(s));
            }
        }
        std::hint::black_box(&self.dst);
        t.elapsed()
    }
}

/// Fresh block hashes, so the host tier never short-circuits an already held block.
struct Hashes(u64);

impl Hashes {
    fn next(&mut self) -> BlockHash {
        self.0 += 1;
        BlockHash(self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

struct DemoteHost {
    kv: KvCache,
    tiers: KvTiers,
    hashes: Hashes,
}

impl Op for DemoteHost {
    fn run(&mut self) -> Duration {
        let t = Instant::now();
        for id in 0..N {
            let bytes = self.kv.read_block(id as u32).expect("read block");
            self.tiers.demote(KvBlockPayload {
                hash: self.hashes.next(),
                parent: None,
                bytes: bytes.into(),
            });
        }
        let d = t.elapsed();
        self.tiers.drain_events();
        d
    }
}

struct PromoteHost {
    kv: KvCache,
    tiers: KvTiers,
    held: Vec<BlockHash>,
}

impl Op for PromoteHost {
    fn run(&mut self) -> Duration {
        let t = Instant::now();
        for (id, h) in self.held.iter().enumerate() {
            let b = self.tiers.take_now(*h).expect("held in host");
            self.kv
                .write_block(id as u32, &b.bytes)
                .expect("write block");
        }
        t.elapsed()
    }
}

struct DiskWrite {
    kv: KvCache,
    tiers: KvTiers,
    hashes: Hashes,
    _dir: tempfile::TempDir,
}

impl Op for DiskWrite {
    fn run(&mut self) -> Duration {
        let t = Instant::now();
        for id in 0..N {
            let bytes = self.kv.read_block(id as u32).expect("read block");
            self.tiers.demote(KvBlockPayload {
                hash: self.hashes.next(),
                parent: None,
                bytes: bytes.into(),
            });
        }
        assert!(self.tiers.flush(FLUSH), "disk writes did not land");
        let d = t.elapsed();
        self.tiers.drain_events();
        d
    }
}

struct DiskRead {
    kv: KvCache,
    tiers: KvTiers,
    on_disk: Vec<BlockHash>,
    _dir: tempfile::TempDir,
}

impl Op for DiskRead {
    fn run(&mut self) -> Duration {
        let t = Instant::now();
        for h in &self.on_disk {
            assert!(self.tiers.request_disk(*h), "block not on disk");
        }
        let mut landed = 0;
        while landed < N {
            for (_, r) in self.tiers.poll(Duration::from_millis(100)) {
                let b = r.expect("disk read");
                self.kv
                    .write_block(landed as u32, &b.bytes)
                    .expect("write block");
                landed += 1;
            }
        }
        let d = t.elapsed();
        self.tiers.drain_events();
        d
    }
}

fn tiers(host_bytes: usize, disk: Option<DiskTierConfig>, block_bytes: usize) -> KvTiers {
    KvTiers::new(&TierConfig { host_bytes, disk }, "f32le", block_bytes).expect("tiers")
}

fn disk_cfg(dir: &tempfile::TempDir, blocks: usize, block_bytes: usize) -> DiskTierConfig {
    DiskTierConfig {
        dir: dir.path().to_path_buf(),
        max_bytes: (blocks * (block_bytes + FILE_OVERHEAD)) as u64,
    }
}

/// The operations of one geometry, named, ready to run.
fn ops(g: &Geometry) -> Vec<(&'static str, Box<dyn Op>)> {
    let kv = g.cache(N);
    let bb = kv.bytes_per_block();
    let total = N * bb;

    let demote = DemoteHost {
        kv: g.cache(N),
        // Room for 4 batches: steady state, each demotion pushes an old block out.
        tiers: tiers(4 * N * (bb + HOST_OVERHEAD), None, bb),
        hashes: Hashes(0),
    };

    let mut promote_tiers = tiers(2 * N * (bb + HOST_OVERHEAD), None, bb);
    let mut hashes = Hashes(1 << 40);
    let mut held = Vec::new();
    for id in 0..N {
        let h = hashes.next();
        promote_tiers.demote(KvBlockPayload {
            hash: h,
            parent: None,
            bytes: kv.read_block(id as u32).expect("read").into(),
        });
        held.push(h);
    }
    let promote = PromoteHost {
        kv: g.cache(N),
        tiers: promote_tiers,
        held,
    };

    let wdir = tempfile::tempdir().expect("tempdir");
    let write = DiskWrite {
        kv: g.cache(N),
        // One block of host: every demotion pushes the one before it to disk. The
        // disk holds 4 batches, so in steady state each write also deletes a file.
        tiers: tiers(bb + HOST_OVERHEAD, Some(disk_cfg(&wdir, 4 * N, bb)), bb),
        hashes: Hashes(2 << 40),
        _dir: wdir,
    };

    let rdir = tempfile::tempdir().expect("tempdir");
    let mut read_tiers = tiers(bb + HOST_OVERHEAD, Some(disk_cfg(&rdir, 2 * N, bb)), bb);
    let mut hashes = Hashes(3 << 40);
    let mut on_disk = Vec::new();
    // N + 1 demotions: the last stays in the one-block host tier, the first N go to disk.
    for i in 0..=N {
        let h = hashes.next();
        read_tiers.demote(KvBlockPayload {
            hash: h,
            parent: None,
            bytes: kv.read_block((i % N) as u32).expect("read").into(),
        });
        if i < N {
            on_disk.push(h);
        }
    }
    assert!(read_tiers.flush(FLUSH), "disk writes did not land");
    let read = DiskRead {
        kv: g.cache(N),
        tiers: read_tiers,
        on_disk,
        _dir: rdir,
    };

    vec![
        (
            "memcpy",
            Box::new(Memcpy {
                // Real K/V bytes, and a destination already touched (no page faults).
                src: (0..N)
                    .flat_map(|id| kv.read_block(id as u32).expect("read"))
                    .collect(),
                dst: vec![1u8; total],
                piece: 0,
            }),
        ),
        (
            "memcpy_blocks",
            Box::new(Memcpy {
                src: (0..N)
                    .flat_map(|id| kv.read_block(id as u32).expect("read"))
                    .collect(),
                dst: vec![1u8; total],
                piece: bb,
            }),
        ),
        ("demote_host", Box::new(demote)),
        ("promote_host", Box::new(promote)),
        ("disk_write", Box::new(write)),
        ("disk_read", Box::new(read)),
    ]
}

fn block_bytes(g: &Geometry) -> usize {
    2 * g.layers * BS * g.kv_heads * g.head_dim * 4
}

/// Summary rows: (geometry, operation, block bytes, median seconds per N blocks).
type Rows = Mutex<Vec<(String, String, usize, f64)>>;

fn median(op: &mut dyn Op, runs: usize) -> f64 {
    let mut t: Vec<f64> = (0..runs).map(|_| op.run().as_secs_f64()).collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn bench_moves(c: &mut Criterion, rows: &Rows) {
    for g in &GEOMETRIES {
        let bb = block_bytes(g);
        let mut group = c.benchmark_group(format!("kv_tiers_{}_{}B", g.name, bb));
        group.sample_size(20);
        group.throughput(Throughput::Bytes((N * bb) as u64));
        for (name, mut op) in ops(g) {
            group.bench_function(name, |b| {
                b.iter_custom(|iters| (0..iters).map(|_| op.run()).sum())
            });
            let secs = median(op.as_mut(), 31);
            rows.lock()
                .expect("rows")
                .push((g.name.into(), name.into(), bb, secs));
        }
        group.finish();
    }
}

fn engine(model: &Arc<LlamaModel>, num_blocks: usize, host_blocks: usize) -> Engine {
    engine_with_steps(model, num_blocks, host_blocks, 1024)
}

/// [`engine`] with steps of `step_tokens`.
fn engine_with_steps(
    model: &Arc<LlamaModel>,
    num_blocks: usize,
    host_blocks: usize,
    step_tokens: usize,
) -> Engine {
    let mut e = Engine::new(
        EngineConfig {
            model_id: "bench".into(),
            block_size: BS,
            max_num_seqs: 4,
            max_batched_tokens: step_tokens,
            max_prefill_chunk: step_tokens,
            decode_reserve: Default::default(),
        },
        Box::new(CpuBackend::new(model.clone(), num_blocks, BS)),
        None,
    )
    .expect("engine");
    if host_blocks > 0 {
        let bytes = host_blocks * (e.block_format().1 + HOST_OVERHEAD);
        e.set_kv_tiers(&TierConfig {
            host_bytes: bytes,
            disk: None,
        })
        .expect("tiers");
    }
    e
}

fn prompt(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % vocab)
        .collect()
}

/// Runs `p` to its first token; returns the time and the tokens promoted from host.
fn ttft(e: &mut Engine, id: u64, p: &[u32]) -> (Duration, usize) {
    let params = SamplingParams {
        max_tokens: 1,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let t = Instant::now();
    e.add_request(Request::new(id, p.to_vec(), params))
        .expect("add");
    let mut host = 0;
    while e.has_unfinished() {
        for o in e.step().expect("step") {
            host = host.max(o.promoted.host);
        }
    }
    (t.elapsed(), host)
}

/// Two prompts of `blocks` full blocks (and one token more) take turns on a pool too
/// small for both: without tiers each run recomputes its prompt, with a host tier each
/// run promotes its `blocks` blocks (the host tier keeps both prompts).
struct Alternating {
    e: Engine,
    prompts: [Vec<u32>; 2],
    id: u64,
}

impl Op for Alternating {
    fn run(&mut self) -> Duration {
        self.id += 1;
        let p = &self.prompts[(self.id % 2) as usize];
        ttft(&mut self.e, self.id, p).0
    }
}

fn alternating(model: &Arc<LlamaModel>, blocks: usize, tiers: bool) -> Alternating {
    let vocab = model.config().vocab_size as u32;
    let len = blocks * BS + 1;
    let mut a = Alternating {
        // One request needs blocks + 1 (its last, partial block); one more spare, so at
        // most one block of the other prompt survives in the pool.
        e: engine(model, blocks + 2, if tiers { 4 * blocks } else { 0 }),
        prompts: [prompt(1, len, vocab), prompt(2, len, vocab)],
        id: 0,
    };
    // Warm up: both prompts computed once (and, with tiers, demoted once).
    for _ in 0..4 {
        a.run();
    }
    a.id += 1;
    let p = a.prompts[(a.id % 2) as usize].clone();
    let (_, host) = ttft(&mut a.e, a.id, &p);
    if tiers {
        assert!(
            host >= (blocks - 1) * BS,
            "{host} tokens promoted from host"
        );
    } else {
        assert_eq!(host, 0, "tokens promoted without tiers");
    }
    a
}

/// Blocks of the prompt in the prefill-vs-promote comparison.
const BLOCKS: usize = 32;

fn bench_prefill_vs_promote(c: &mut Criterion, rows: &Rows) {
    for (name, cfg) in [
        ("tiny", ModelConfig::tiny()),
        ("small", ModelConfig::small()),
    ] {
        let model = Arc::new(LlamaModel::seeded(cfg, 1).expect("model"));
        let bb = 2
            * model.config().num_hidden_layers
            * BS
            * model.config().num_kv_heads()
            * model.config().head_dim()
            * 4;
        let mut group = c.benchmark_group(format!("ttft_{name}_{BLOCKS}_blocks"));
        group.sample_size(10);
        for (op, tiers) in [("recompute", false), ("promote_host", true)] {
            let mut a = alternating(&model, BLOCKS, tiers);
            group.bench_function(op, |b| {
                b.iter_custom(|iters| (0..iters).map(|_| a.run()).sum())
            });
            let secs = median(&mut a, 11);
            rows.lock().expect("rows").push((
                format!("{name} ttft"),
                op.into(),
                bb,
                secs / BLOCKS as f64 * N as f64,
            ));
        }
        group.finish();
    }
}

fn print_summary(rows: &Rows) {
    let rows = rows.lock().expect("rows");
    println!("\nKV tier summary ({N} blocks per operation; medians)");
    println!(
        "{:<20} {:<14} {:>10} {:>12} {:>9} {:>9}",
        "geometry", "operation", "block B", "blocks/s", "GB/s", "vs memcpy"
    );
    let mut base = None;
    for (geo, op, bb, secs) in rows.iter() {
        let per_s = N as f64 / secs;
        let gbs = per_s * *bb as f64 / 1e9;
        if op == "memcpy" {
            base = Some(gbs);
        }
        let ratio = if geo.ends_with("ttft") {
            String::from("-")
        } else {
            base.map_or(String::from("-"), |b| format!("{:.2}", gbs / b))
        };
        println!("{geo:<20} {op:<14} {bb:>10} {per_s:>12.0} {gbs:>9.2} {ratio:>9}");
    }
    let ttft = |geo: &str, op: &str| {
        rows.iter()
            .find(|r| r.0 == geo && r.1 == op)
            .map(|r| r.3 / N as f64 * BLOCKS as f64)
    };
    let geos = rows
        .iter()
        .filter(|r| r.0.ends_with("ttft") && r.1 == "recompute")
        .map(|r| &r.0);
    for geo in geos {
        if let (Some(cold), Some(hot)) = (ttft(geo, "recompute"), ttft(geo, "promote_host")) {
            if cold > 0.0 && hot > 0.0 {
                println!(
                    "{geo} ({BLOCKS} blocks): recompute {:.2} ms, promote_host {:.2} ms: {:.1}x",
                    cold * 1e3,
                    hot * 1e3,
                    cold / hot
                );
            }
        }
    }
}

/// Serves 24 distinct prompts, 4 at a time, on `e`; returns the wall time.
fn stream(e: &mut Engine, vocab: u32, seed: u32) -> Duration {
    let params = SamplingParams {
        max_tokens: 16,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let t = Instant::now();
    for batch in 0..6u32 {
        for i in 0..4u32 {
            let id = u64::from(seed * 1_000 + batch * 4 + i);
            let p = prompt(seed * 1_000 + batch * 4 + i, 16 * BS + 1, vocab);
            e.add_request(Request::new(id, p, params.clone()))
                .expect("add");
        }
        e.run_to_completion().expect("run");
    }
    t.elapsed()
}

/// Where the stream's write-behind copies blocks down.
#[derive(Clone, Copy, PartialEq)]
enum WriteBehind {
    /// No tiers at all: the baseline wall time.
    None,
    /// On the engine thread, between steps (a backend without an off-thread reader).
    OnThread,
    /// On the write-out thread while the engine steps (the CPU backend's default).
    OffThread,
}

/// A serving engine with steps of 256 tokens (a horizon of 25 blocks) on a pool of
/// 140 blocks, about two batches of the stream, over a host tier of 400.
fn serving_engine(model: &Arc<LlamaModel>, how: WriteBehind) -> Engine {
    let host_blocks = if how == WriteBehind::None { 0 } else { 400 };
    let mut e = engine_with_steps(model, 140, host_blocks, 256);
    if how == WriteBehind::OnThread {
        e.set_write_out(None).expect("in-thread write-behind");
    }
    e
}

fn write_behind_share() {
    println!("\nWrite-behind on the engine thread vs off it (24 prompts of 16 blocks, 4 at a time, 256-token steps, pool of 140 blocks)");
    println!(
        "{:<8} {:<10} {:>12} {:>12} {:>8} {:>10} {:>10} {:>10} {:>8}",
        "model",
        "copies",
        "engine ms",
        "forward ms",
        "share",
        "on-thread",
        "off-thread",
        "wall ms",
        "vs none"
    );
    for (name, cfg) in [
        ("tiny", ModelConfig::tiny()),
        ("small", ModelConfig::small()),
    ] {
        let model = Arc::new(LlamaModel::seeded(cfg, 1).expect("model"));
        let vocab = model.config().vocab_size as u32;
        let kinds = [
            ("none", WriteBehind::None),
            ("on", WriteBehind::OnThread),
            ("off", WriteBehind::OffThread),
        ];
        let mut walls = vec![Vec::new(); kinds.len()];
        let mut totals = vec![(0u64, 0u64, 0u64, 0u64); kinds.len()];
        // Interleaved runs, so drift on a noisy machine hits all three alike.
        for run in 0..3u32 {
            for (k, &(_, how)) in kinds.iter().enumerate() {
                let mut e = serving_engine(&model, how);
                walls[k].push(stream(&mut e, vocab, run + 1).as_secs_f64());
                let s = e.stats();
                let t = &mut totals[k];
                t.0 += s.demotion_ns;
                t.1 += s.forward_ns;
                if let Some(tiers) = e.tier_stats() {
                    t.2 += tiers.demoted_blocks - tiers.demoted_off_thread;
                    t.3 += tiers.demoted_off_thread;
                    assert_eq!(tiers.demotion_misses, 0, "write-behind lost a block");
                }
            }
        }
        for w in &mut walls {
            w.sort_by(f64::total_cmp);
        }
        let none = walls[0][1];
        for (k, &(label, _)) in kinds.iter().enumerate() {
            let (demotion, forward, on, off) = totals[k];
            println!(
                "{name:<8} {label:<10} {:>12.2} {:>12.2} {:>7.2}% {:>10} {:>10} {:>10.1} {:>8.3}",
                demotion as f64 / 3e6,
                forward as f64 / 3e6,
                100.0 * demotion as f64 / forward.max(1) as f64,
                on / 3,
                off / 3,
                walls[k][1] * 1e3,
                walls[k][1] / none
            );
        }
    }
}

fn bench_all(c: &mut Criterion) {
    let rows = Rows::default();
    bench_moves(c, &rows);
    bench_prefill_vs_promote(c, &rows);
    print_summary(&rows);
    write_behind_share();
}

criterion_group!(benches, bench_all);
criterion_main!(benches);
