//! Structured outputs (constrained decoding with llguidance), side by side with
//! unconstrained decoding in one run:
//! - `sample_per_token`: picking one token from a vocabulary-sized logits row, plain
//!   (`free_*`) vs under a JSON-schema grammar (`json_schema_*`: llguidance's mask,
//!   applied to a copy of the row, then the same sampler, then the matcher advanced),
//!   at temperature 1 and greedy. The difference is the per-token overhead a
//!   constrained request adds (at temperature 1 the mask can make sampling cheaper:
//!   masked ids leave the candidate list).
//! - `<model>_decode_batch_8`: decode throughput of 8 sequences, all unconstrained vs
//!   4 constrained + 4 unconstrained (every sequence runs its full 32 tokens).
//!
//! On SmolLM2-135M-Instruct (49,152-token vocabulary, from the model cache) when it is
//! there, and on the seeded `small` model (byte vocabulary) always.
//!
//! `cargo bench --bench structured_output`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvfleet_core::structured_output::{GrammarCompiler, OutputGrammar};
use kvfleet_core::tokenizer::{ByteTokenizer, Tokenizer};
use kvfleet_engine::constrained::SeqConstraint;
use kvfleet_engine::{
    load_model, CpuBackend, Engine, EngineConfig, LlamaModel, ModelConfig, Request, Sampler,
    SamplingParams,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A long JSON array of small objects: the grammar never ends within the measured
/// tokens, so every constrained sequence runs as long as an unconstrained one.
fn long_grammar() -> OutputGrammar {
    OutputGrammar::JsonSchema(
        serde_json::json!({
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 8},
                    "ok": {"type": "boolean"}
                },
                "required": ["id", "name", "ok"],
                "additionalProperties": false
            }
        })
        .to_string(),
    )
}

fn sampling(seed: u64, max_tokens: usize, grammar: Option<OutputGrammar>) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens,
        ignore_eos: true,
        grammar,
        ..SamplingParams::default()
    }
}

/// Pseudo-random logits over `vocab` ids, different per `step`.
fn logits(vocab: usize, step: u64) -> Vec<f32> {
    (0..vocab as u64)
        .map(|i| {
            ((i.wrapping_mul(2_654_435_761) ^ step.wrapping_mul(40_503)) % 1000) as f32 / 100.0
        })
        .collect()
}

fn bench_per_token(c: &mut Criterion, name: &str, tokenizer: &dyn Tokenizer, vocab: usize) {
    let compiler = GrammarCompiler::new(tokenizer, vocab).expect("token trie");
    let rows: Vec<Vec<f32>> = (0..64).map(|s| logits(vocab, s)).collect();
    let grammar = long_grammar();
    let mut g = c.benchmark_group(format!("{name}_sample_per_token"));
    g.throughput(Throughput::Elements(1));
    // Temperature 1 (the sampler weighs every allowed id) and greedy (argmax only, so
    // the mask's own cost shows).
    for (mode, temperature) in [("t1", 1.0f32), ("greedy", 0.0)] {
        let params = SamplingParams {
            temperature,
            ..sampling(1, 1, None)
        };
        g.bench_function(format!("free_{mode}"), |b| {
            let mut s = Sampler::new(&params, 0);
            let mut i = 0;
            b.iter(|| {
                i += 1;
                s.sample(&rows[i % rows.len()])
            })
        });
        g.bench_function(format!("json_schema_{mode}"), |b| {
            let mut s = Sampler::new(&params, 0);
            let mut k = SeqConstraint::new(&compiler, &grammar).expect("grammar");
            let mut i = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    i += 1;
                    // A fresh matcher now and then (not timed) keeps the state realistic.
                    if i % 512 == 0 {
                        k = SeqConstraint::new(&compiler, &grammar).expect("grammar");
                    }
                    let t = Instant::now();
                    let tok = k.sample(&mut s, &rows[i % rows.len()]).expect("mask");
                    let done = k.commit(tok).expect("commit");
                    total += t.elapsed();
                    assert!(!done, "the grammar ended early");
                }
                total
            })
        });
    }
    g.finish();
}

fn engine(model: &Arc<LlamaModel>, tokenizer: Arc<dyn Tokenizer>) -> Engine {
    Engine::new(
        EngineConfig {
            model_id: "bench".into(),
            block_size: 16,
            max_num_seqs: 64,
            max_batched_tokens: 4096,
            max_prefill_chunk: 4096,
            decode_reserve: Default::default(),
        },
        Box::new(CpuBackend::new(model.clone(), 256, 16)),
        Some(tokenizer),
    )
    .expect("engine")
}

/// Decode throughput of a batch of 8: `mixed` has 4 constrained sequences among them.
fn bench_mixed_batch(
    c: &mut Criterion,
    name: &str,
    model: &Arc<LlamaModel>,
    tokenizer: Arc<dyn Tokenizer>,
) {
    let steps = 32;
    let batch = 8;
    let vocab = model.config().vocab_size as u32;
    let mut g = c.benchmark_group(format!("{name}_decode_batch_{batch}"));
    g.sample_size(10);
    g.throughput(Throughput::Elements((batch * steps) as u64));
    for constrained in [0usize, 4] {
        let label = if constrained == 0 {
            "all_free"
        } else {
            "4_constrained_4_free"
        };
        g.bench_function(label, |b| {
            let mut e = engine(model, tokenizer.clone());
            let mut id = 0;
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    for i in 0..batch {
                        id += 1;
                        let prompt = (0..32u32)
                            .map(|t| {
                                (t.wrapping_mul(2_654_435_761) ^ (i as u32 + 7)) % vocab.min(256)
                            })
                            .collect();
                        let grammar = (i < constrained).then(long_grammar);
                        e.add_request(Request::new(id, prompt, sampling(id, steps + 1, grammar)))
                            .expect("add");
                    }
                    // Prefill (and the first token) outside the timed region.
                    e.step().expect("prefill step");
                    let t = Instant::now();
                    let mut produced = 0;
                    while e.has_unfinished() {
                        produced += e
                            .step()
                            .expect("step")
                            .iter()
                            .filter(|o| o.token.is_some())
                            .count();
                    }
                    total += t.elapsed();
                    assert_eq!(
                        produced,
                        batch * steps,
                        "every sequence ran its full length"
                    );
                }
                total
            })
        });
    }
    g.finish();
}

/// The real GGUF model's path in the model cache (see `KVFLEET_MODEL_CACHE`).
fn gguf_path() -> PathBuf {
    let cache = std::env::var_os("KVFLEET_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/kvfleet/models"))
        })
        .unwrap_or_default();
    cache.join("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn bench_all(c: &mut Criterion) {
    let path = gguf_path();
    match load_model(&path.to_string_lossy()) {
        Ok(m) => {
            let vocab = m.model.config().vocab_size;
            bench_per_token(c, "smollm2", m.tokenizer.as_ref(), vocab);
            bench_mixed_batch(c, "smollm2", &m.model, m.tokenizer.clone());
        }
        Err(e) => eprintln!(
            "smollm2 structured-output benches not run: {} ({e}); `bash scripts/fetch-model.sh` fetches it",
            path.display()
        ),
    }
    let small = Arc::new(LlamaModel::seeded(ModelConfig::small(), 1).expect("model"));
    let bytes = ByteTokenizer::new();
    bench_per_token(c, "small", &bytes, small.config().vocab_size);
    bench_mixed_batch(c, "small", &small, Arc::new(bytes));
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5));
    targets = bench_all
}
criterion_main!(benches);
