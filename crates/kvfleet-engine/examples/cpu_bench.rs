//! CPU engine throughput, one JSON line per figure (medians of `--reps` runs):
//!
//! - `pp512`, `pp2048`: prompt processing, tokens/s of a cold prompt run to its first token;
//! - `tg_b1`, `tg_b4`, `tg_b8`: decode tokens/s (aggregate over the batch) generating
//!   `--gen` tokens per sequence after a 32-token prompt.
//!
//! Made to be run alternately with an older build of itself, on a noisy machine:
//! `cpu_bench MODEL [--reps N] [--gen N] [--only pp512,tg_b1,...]`, where MODEL is
//! `small`, `smollm2-shape` (seeded f32 weights with SmolLM2-135M's shape) or anything
//! `load_model` accepts.

use std::sync::Arc;
use std::time::Instant;

use kvfleet_engine::{
    load_model, CpuBackend, Engine, EngineConfig, LlamaModel, ModelConfig, Request, SamplingParams,
};

const BS: usize = 16;

fn smollm2_shape() -> ModelConfig {
    ModelConfig {
        vocab_size: 49_152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: Some(3),
        head_dim: Some(64),
        max_position_embeddings: 8192,
        rope_theta: 100_000.0,
        rope_scaling: None,
        ..ModelConfig::small()
    }
}

fn engine(model: &Arc<LlamaModel>) -> Engine {
    Engine::new(
        EngineConfig {
            model_id: "bench".into(),
            block_size: BS,
            max_num_seqs: 64,
            max_batched_tokens: 2048,
            max_prefill_chunk: 2048,
            decode_reserve: Default::default(),
        },
        Box::new(CpuBackend::new(model.clone(), 2048 / BS * 4 + 64, BS)),
        None,
    )
    .unwrap_or_else(|e| panic!("engine: {e}"))
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn prompt(seed: u32, len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % vocab as u32)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let spec = args.get(1).cloned().unwrap_or_else(|| "small".into());
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let reps: usize = flag("--reps").and_then(|s| s.parse().ok()).unwrap_or(3);
    let gen: usize = flag("--gen").and_then(|s| s.parse().ok()).unwrap_or(64);
    let only = flag("--only");
    let wanted = |name: &str| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|x| x == name))
    };
    let model = match spec.as_str() {
        "smollm2-shape" => Arc::new(LlamaModel::seeded(smollm2_shape(), 1).unwrap()),
        s => load_model(s).unwrap_or_else(|e| panic!("{s}: {e}")).model,
    };
    let vocab = model.config().vocab_size;
    let mut e = engine(&model);
    let mut id = 0u64;
    for len in [512usize, 2048] {
        let name = format!("pp{len}");
        if !wanted(&name) {
            continue;
        }
        let mut runs = Vec::new();
        for r in 0..reps + 1 {
            e.clear_cache();
            id += 1;
            let t = Instant::now();
            e.add_request(Request::new(id, prompt(id as u32, len, vocab), params(1)))
                .unwrap();
            while e.has_unfinished() {
                e.step().unwrap();
            }
            // The first run warms allocator and caches.
            if r > 0 {
                runs.push(len as f64 / t.elapsed().as_secs_f64());
            }
        }
        println!(
            "{{\"model\":\"{spec}\",\"bench\":\"{name}\",\"tok_s\":{:.1}}}",
            median(runs)
        );
    }
    for batch in [1usize, 4, 8] {
        let name = format!("tg_b{batch}");
        if !wanted(&name) {
            continue;
        }
        let mut runs = Vec::new();
        for r in 0..reps + 1 {
            e.clear_cache();
            for i in 0..batch {
                id += 1;
                e.add_request(Request::new(
                    id,
                    prompt(id as u32 + i as u32, 32, vocab),
                    params(gen + 1),
                ))
                .unwrap();
            }
            // Prefill and the first token outside the timed region.
            e.step().unwrap();
            let t = Instant::now();
            while e.has_unfinished() {
                e.step().unwrap();
            }
            if r > 0 {
                runs.push((batch * gen) as f64 / t.elapsed().as_secs_f64());
            }
        }
        println!(
            "{{\"model\":\"{spec}\",\"bench\":\"{name}\",\"tok_s\":{:.1}}}",
            median(runs)
        );
    }
}
