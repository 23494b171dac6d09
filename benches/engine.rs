//! Engine benchmarks on the seeded `small` model (8 layers, hidden 512):
//! - time to first token for a 2,048-token prompt, cold vs. its first 2,032 tokens cached;
//! - prompt processing of 512 and 2,048 tokens (tokens/s);
//! - decode throughput at batch 1, 4, 8 and 32 (continuous batching).
//!
//! The same prefill and decode figures on SmolLM2-135M-Instruct (Q4_1 GGUF) when it is
//! in the model cache (`bash scripts/fetch-model.sh` puts it there); otherwise that
//! group says why it did not run.
//!
//! `cargo bench --bench engine`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvfleet_engine::{
    load_model, CpuBackend, Engine, EngineConfig, LlamaModel, ModelConfig, Request, SamplingParams,
};
use std::path::PathBuf;
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
            decode_reserve: Default::default(),
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
    prompt_in(seed, len, 256)
}

/// Token ids below `vocab`, different per `seed`.
fn prompt_in(seed: u32, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % vocab)
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

/// Prompt processing: a cold prompt of `len` tokens run to its first token.
fn prefill_group(c: &mut Criterion, name: &str, model: &Arc<LlamaModel>) {
    let vocab = model.config().vocab_size as u32;
    let mut g = c.benchmark_group(format!("{name}_prefill"));
    g.sample_size(10);
    for len in [512usize, 2048] {
        g.throughput(Throughput::Elements(len as u64));
        g.bench_function(format!("pp{len}"), |b| {
            let mut e = engine(model, 160);
            let mut id = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    e.clear_cache();
                    id += 1;
                    total += ttft(&mut e, id, &prompt_in(id as u32, len, vocab));
                }
                total
            })
        });
    }
    g.finish();
}

/// Decode throughput of `batch` sequences generating 32 tokens each after 32-token prompts.
fn decode_group(c: &mut Criterion, name: &str, model: &Arc<LlamaModel>, batches: &[usize]) {
    let vocab = model.config().vocab_size as u32;
    let steps = 32;
    let mut g = c.benchmark_group(format!("{name}_decode"));
    g.sample_size(10);
    for &batch in batches {
        g.throughput(Throughput::Elements((batch * steps) as u64));
        g.bench_function(format!("batch_{batch}"), |b| {
            // 32 sequences of 65 tokens need 160 blocks; more would only cost memory.
            let mut e = engine(model, 256);
            let mut id = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    for i in 0..batch {
                        id += 1;
                        e.add_request(Request::new(
                            id,
                            prompt_in(i as u32 + 7, 32, vocab),
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

fn bench_small(c: &mut Criterion) {
    let model = Arc::new(LlamaModel::seeded(ModelConfig::small(), 1).expect("model"));
    prefill_group(c, "small", &model);
    decode_group(c, "small", &model, &[1, 4, 8, 32]);
}

/// The real GGUF model's path in the model cache (see `KVFLEET_MODEL_CACHE`).
fn gguf_path() -> PathBuf {
    let cache = std::env::var_os("KVFLEET_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kvfleet/models"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/kvfleet/models"))
        })
        .unwrap_or_default();
    cache.join("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn bench_gguf(c: &mut Criterion) {
    let path = gguf_path();
    let model = match load_model(&path.to_string_lossy()) {
        Ok(m) => m.model,
        Err(e) => {
            eprintln!(
                "smollm2 benches not run: {} ({e}); `bash scripts/fetch-model.sh` fetches it",
                path.display()
            );
            return;
        }
    };
    prefill_group(c, "smollm2_q4_1", &model);
    decode_group(c, "smollm2_q4_1", &model, &[1, 4, 8]);
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(10));
    targets = bench_ttft, bench_small, bench_gguf
}
criterion_main!(benches);
