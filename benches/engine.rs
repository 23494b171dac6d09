//! Engine benchmarks on the seeded `small` model (8 layers, hidden 512):
//! - time to first token for a 2,048-token prompt, cold vs. its first 2,032 tokens cached;
//! - decode throughput at batch 1, 8 and 32 (continuous batching).
//!
//! `cargo bench --bench engine`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvfleet_engine::{
    CpuBackend, Engine, EngineConfig, LlamaModel, ModelConfig, Request, SamplingParams,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: usize = 16;

fn engine(model: &Arc<LlamaModel>, num_blocks: usize) -> Engine {
    Engine::new(
        EngineConfig {
            model_id: "small".into(),
            block_size: BS,
            max_num_seqs: 64,
            max_batched_tokens: 4096,
            max_prefill_chunk: 4096,
        },
        Box::new(CpuBackend::new(model.clone(), num_blocks, BS)),
        None,
    )
    .expect("engine")
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 256)
        .collect()
}

/// Runs one request with max_tokens 1 and returns its time to first token.
fn ttft(e: &mut Engine, id: u64, p: &[u32]) -> Duration {
    let t = Instant::now();
    e.add_request(Request::new(id, p.to_vec(), params(1)))
        .expect("add");
    while e.has_unfinished() {
        e.step().expect("step");
    }
    t.elapsed()
}

fn bench_ttft(c: &mut Criterion) {
    let model = Arc::new(LlamaModel::seeded(ModelConfig::small(), 1).expect("model"));
    let p = prompt(1, 2048);
    let mut g = c.benchmark_group("ttft_2048");
    g.sample_size(10);
    g.bench_function("cold", |b| {
        let mut e = engine(&model, 160);
        let mut id = 0;
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                e.clear_cache();
                id += 1;
                total += ttft(&mut e, id, &p);
            }
            total
        })
    });
    g.bench_function("cached_2032", |b| {
        let mut e = engine(&model, 160);
        ttft(&mut e, 0, &p);
        let mut id = 0;
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                id += 1;
                total += ttft(&mut e, id, &p);
            }
            total
        })
    });
    g.finish();
}

fn bench_decode(c: &mut Criterion) {
    let model = Arc::new(LlamaModel::seeded(ModelConfig::small(), 1).expect("model"));
    let steps = 32;
    let mut g = c.benchmark_group("decode");
    g.sample_size(10);
    for batch in [1usize, 8, 32] {
        g.throughput(Throughput::Elements((batch * steps) as u64));
        g.bench_function(format!("batch_{batch}"), |b| {
            let mut e = engine(&model, 64 * 40);
            let mut id = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    for i in 0..batch {
                        id += 1;
                        e.add_request(Request::new(
                            id,
                            prompt(i as u32 + 7, 32),
                            params(steps + 1),
                        ))
                        .expect("add");
                    }
                    // Prefill (and the first token) outside the timed region.
                    e.step().expect("prefill step");
                    let t = Instant::now();
                    while e.has_unfinished() {
                        e.step().expect("step");
                    }
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(10));
    targets = bench_ttft, bench_decode
}
criterion_main!(benches);
