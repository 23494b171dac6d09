//! The CPU correctness tests, on the GPU (feature `gpu-tests`; run by
//! scripts/gpu-check.sh on a machine with CUDA): whole-model logits of the CUDA backend
//! against the CPU backend within bf16 tolerance (prefill, decode, split-K long
//! context, GQA, qk-norm, biases, sliding window), cached vs. cold logits, and fork
//! children made with `copy_block` against computing from scratch, and a pool sized
//! from device memory (`--gpu-memory-utilization`) with step buffers reused.

#![cfg(feature = "gpu-tests")]

use std::sync::Arc;

use kvfleet_engine::cuda::CudaBackend;
use kvfleet_engine::{
    CpuBackend, ForwardItem, LlamaModel, LogitsRequest, ModelBackend, ModelConfig,
};

const BS: usize = 16;

fn tokens(n: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97 + 5) >> 7) % vocab as u32)
        .collect()
}

fn backends(config: ModelConfig, blocks: usize) -> (CpuBackend, CudaBackend) {
    let model = Arc::new(LlamaModel::seeded(config, 11).expect("seeded model"));
    let cpu = CpuBackend::new(Arc::clone(&model), blocks, BS);
    let gpu = CudaBackend::new(model, blocks, BS, 0).expect("cuda:0");
    (cpu, gpu)
}

/// Largest absolute difference, and the fraction of rows whose argmax agrees.
fn compare(a: &[f32], b: &[f32], vocab: usize) -> (f32, f64) {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |m, (i, &v)| if v > m.1 { (i, v) } else { m },
            )
            .0
    };
    let rows = a.len() / vocab;
    let agree = a
        .chunks_exact(vocab)
        .zip(b.chunks_exact(vocab))
        .filter(|(x, y)| argmax(x) == argmax(y))
        .count();
    (diff, agree as f64 / rows.max(1) as f64)
}

/// bf16 activations and weights: logits of O(1) agree to a few hundredths.
fn assert_close(what: &str, cpu: &[f32], gpu: &[f32], vocab: usize) {
    let scale = cpu.iter().map(|x| x.abs()).fold(0.0, f32::max).max(1.0);
    let (diff, agree) = compare(cpu, gpu, vocab);
    assert!(
        diff <= 0.05 * scale,
        "{what}: max |cpu - gpu| = {diff} (logit scale {scale})"
    );
    assert!(
        agree >= 0.9,
        "{what}: argmax agrees on only {agree:.3} of rows"
    );
}

fn step(b: &mut dyn ModelBackend, items: &[ForwardItem<'_>]) -> Vec<Vec<f32>> {
    b.forward(items).expect("forward")
}

/// Prefill (All logits), then decode steps one token at a time, comparing each.
fn prefill_then_decode(config: ModelConfig, prompt: usize, decode: usize) {
    let vocab = config.vocab_size;
    let blocks = (prompt + decode).div_ceil(BS) + 2;
    let (mut cpu, mut gpu) = backends(config, blocks);
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let toks = tokens(prompt + decode, 1, vocab);
    let item = ForwardItem {
        tokens: &toks[..prompt],
        start_pos: 0,
        block_table: &table,
        logits: LogitsRequest::All,
    };
    let (c, g) = (step(&mut cpu, &[item]), step(&mut gpu, &[item]));
    assert_close("prefill", &c[0], &g[0], vocab);
    for p in prompt..prompt + decode {
        let item = ForwardItem {
            tokens: &toks[p..p + 1],
            start_pos: p,
            block_table: &table,
            logits: LogitsRequest::Last,
        };
        let (c, g) = (step(&mut cpu, &[item]), step(&mut gpu, &[item]));
        assert_close(&format!("decode at {p}"), &c[0], &g[0], vocab);
    }
}

#[test]
fn tiny_prefill_and_decode_match_cpu() {
    prefill_then_decode(ModelConfig::tiny(), 45, 20);
}

#[test]
fn small_prefill_and_decode_match_cpu() {
    prefill_then_decode(ModelConfig::small(), 100, 10);
}

#[test]
fn split_k_decode_over_a_long_context_matches_cpu() {
    // 1,700 keys: four split-K partitions of 512.
    prefill_then_decode(ModelConfig::small(), 1700, 3);
}

#[test]
fn qwen3_qk_norm_and_qwen2_bias_and_mistral_window_match_cpu() {
    let qwen3 = ModelConfig {
        model_type: "qwen3".into(),
        ..ModelConfig::tiny()
    };
    prefill_then_decode(qwen3, 40, 5);
    let qwen2 = ModelConfig {
        model_type: "qwen2".into(),
        ..ModelConfig::tiny()
    };
    prefill_then_decode(qwen2, 40, 5);
    let mistral = ModelConfig {
        model_type: "mistral".into(),
        sliding_window: Some(24),
        ..ModelConfig::tiny()
    };
    prefill_then_decode(mistral, 60, 8);
}

#[test]
fn a_mixed_batch_matches_cpu() {
    let config = ModelConfig::small();
    let vocab = config.vocab_size;
    let (mut cpu, mut gpu) = backends(config, 64);
    let (ta, tb, tc): (Vec<u32>, Vec<u32>, Vec<u32>) =
        ((0..20).collect(), (20..40).collect(), (40..64).collect());
    let (a, b, c) = (
        tokens(300, 2, vocab),
        tokens(200, 3, vocab),
        tokens(30, 4, vocab),
    );
    // a and b prefilled first; then one step with a decoding, b decoding 3 tokens, c
    // prefilling 30.
    for (t, table) in [(&a[..299], &ta), (&b[..197], &tb)] {
        let item = ForwardItem {
            tokens: t,
            start_pos: 0,
            block_table: table,
            logits: LogitsRequest::None,
        };
        step(&mut cpu, &[item]);
        step(&mut gpu, &[item]);
    }
    let items = [
        ForwardItem {
            tokens: &a[299..300],
            start_pos: 299,
            block_table: &ta,
            logits: LogitsRequest::Last,
        },
        ForwardItem {
            tokens: &b[197..200],
            start_pos: 197,
            block_table: &tb,
            logits: LogitsRequest::All,
        },
        ForwardItem {
            tokens: &c,
            start_pos: 0,
            block_table: &tc,
            logits: LogitsRequest::All,
        },
    ];
    let (co, go) = (step(&mut cpu, &items), step(&mut gpu, &items));
    assert_eq!(
        go.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![vocab, 3 * vocab, 30 * vocab]
    );
    for (i, (x, y)) in co.iter().zip(&go).enumerate() {
        assert_close(&format!("item {i}"), x, y, vocab);
    }
}

#[test]
fn cached_and_cold_logits_agree_on_gpu() {
    let config = ModelConfig::small();
    let vocab = config.vocab_size;
    let model = Arc::new(LlamaModel::seeded(config, 11).expect("model"));
    let mut gpu = CudaBackend::new(model, 128, BS, 0).expect("cuda:0");
    let toks = tokens(700, 5, vocab);
    let cold_table: Vec<u32> = (0..44).collect();
    let warm_table: Vec<u32> = (44..88).collect();
    let cold = step(
        &mut gpu,
        &[ForwardItem {
            tokens: &toks,
            start_pos: 0,
            block_table: &cold_table,
            logits: LogitsRequest::Last,
        }],
    );
    // Prefix first (as the cache would hold it), then only the rest.
    step(
        &mut gpu,
        &[ForwardItem {
            tokens: &toks[..640],
            start_pos: 0,
            block_table: &warm_table,
            logits: LogitsRequest::None,
        }],
    );
    let cached = step(
        &mut gpu,
        &[ForwardItem {
            tokens: &toks[640..],
            start_pos: 640,
            block_table: &warm_table,
            logits: LogitsRequest::Last,
        }],
    );
    let (diff, agree) = compare(&cold[0], &cached[0], vocab);
    assert!(diff < 5e-2, "cached vs cold: max diff {diff}");
    assert_eq!(agree, 1.0);
}

#[test]
fn fork_children_match_computing_from_scratch() {
    let config = ModelConfig::tiny();
    let vocab = config.vocab_size;
    let model = Arc::new(LlamaModel::seeded(config, 11).expect("model"));
    let mut gpu = CudaBackend::new(Arc::clone(&model), 32, BS, 0).expect("cuda:0");
    let mut cpu = CpuBackend::new(model, 32, BS);
    let toks = tokens(20, 6, vocab);
    // Parent: 20 tokens in blocks 0 and 1 (block 1 partly filled).
    let parent = [0u32, 1];
    for b in [&mut gpu as &mut dyn ModelBackend, &mut cpu] {
        step(
            b,
            &[ForwardItem {
                tokens: &toks,
                start_pos: 0,
                block_table: &parent,
                logits: LogitsRequest::None,
            }],
        );
        // Copy-on-write: each child gets its own copy of the partial block.
        b.copy_block(1, 2);
        b.copy_block(1, 3);
    }
    let (x, y) = ([7u32], [9u32]);
    let children = [
        ForwardItem {
            tokens: &x,
            start_pos: 20,
            block_table: &[0, 2],
            logits: LogitsRequest::Last,
        },
        ForwardItem {
            tokens: &y,
            start_pos: 20,
            block_table: &[0, 3],
            logits: LogitsRequest::Last,
        },
    ];
    let forked = step(&mut gpu, &children);
    let on_cpu = step(&mut cpu, &children);
    for (i, tok) in [7u32, 9].into_iter().enumerate() {
        let mut full = toks.clone();
        full.push(tok);
        let scratch = step(
            &mut gpu,
            &[ForwardItem {
                tokens: &full,
                start_pos: 0,
                block_table: &[10, 11],
                logits: LogitsRequest::Last,
            }],
        );
        let (diff, agree) = compare(&forked[i], &scratch[0], vocab);
        assert!(diff < 5e-2, "child {i} vs scratch: {diff}");
        assert_eq!(agree, 1.0);
        assert_close(&format!("child {i} vs cpu"), &on_cpu[i], &forked[i], vocab);
    }
    // The children differ (different tokens), and the parent's block was not touched:
    // continuing the parent still matches the CPU.
    assert_ne!(forked[0], forked[1]);
    let next = [ForwardItem {
        tokens: &[5],
        start_pos: 20,
        block_table: &parent,
        logits: LogitsRequest::Last,
    }];
    assert_close(
        "parent after fork",
        &step(&mut cpu, &next)[0],
        &step(&mut gpu, &next)[0],
        vocab,
    );
}

#[test]
fn bad_items_are_rejected_before_anything_runs() {
    let (_, mut gpu) = backends(ModelConfig::tiny(), 4);
    let err = gpu
        .forward(&[ForwardItem {
            tokens: &[1, 2, 3],
            start_pos: 0,
            block_table: &[9],
            logits: LogitsRequest::Last,
        }])
        .expect_err("block 9 is outside 4 blocks");
    assert!(err.to_string().contains("block id 9"), "{err}");
    assert_eq!(gpu.device_name(), "cuda:0");
}

#[test]
fn pool_sized_from_device_memory_and_step_buffers_are_reused() {
    use kvfleet_engine::kv_sizing::{kv_block_bytes_of, KvDtype};
    use kvfleet_engine::KvPool;
    let config = ModelConfig::small();
    let vocab = config.vocab_size;
    let block_bytes = kv_block_bytes_of(&config, BS, KvDtype::Bf16).expect("block bytes");
    let model = Arc::new(LlamaModel::seeded(config, 11).expect("model"));
    // A small fraction, so a busy GPU still has room and the test does not hold it all.
    let pool = KvPool::MemoryFraction {
        utilization: 0.2,
        max_step_tokens: 512,
    };
    let mut gpu = CudaBackend::new(Arc::clone(&model), pool, BS, 0).expect("cuda:0");
    let sizing = gpu.kv_sizing().expect("sized from memory");
    println!("{sizing}");
    assert_eq!(gpu.num_blocks(), sizing.num_blocks);
    assert_eq!(sizing.block_bytes, block_bytes);
    assert_eq!(gpu.kv_bytes(), sizing.num_blocks * block_bytes);
    let allowed = (sizing.memory.total as f64 * 0.2) as usize;
    let in_use = sizing.memory.total - sizing.memory.free;
    assert!(in_use + sizing.reserve + gpu.kv_bytes() <= allowed);
    assert!(allowed - in_use - sizing.reserve - gpu.kv_bytes() < block_bytes);
    // Same-shape steps allocate nothing after the first, and the logits still match
    // a pool of an explicit size.
    let mut fixed = CudaBackend::new(model, 64, BS, 0).expect("cuda:0");
    let toks = tokens(300, 9, vocab);
    let table: Vec<u32> = (0..19).collect();
    let item = [ForwardItem {
        tokens: &toks,
        start_pos: 0,
        block_table: &table,
        logits: LogitsRequest::Last,
    }];
    let first = step(&mut gpu, &item);
    let held = gpu.step_buffer_bytes();
    assert!(held > 0);
    let again = step(&mut gpu, &item);
    assert_eq!(
        gpu.step_buffer_bytes(),
        held,
        "a same-shape step grew the buffers"
    );
    let (rerun, _) = compare(&first[0], &again[0], vocab);
    assert!(
        rerun < 1e-5,
        "a rerun over reused buffers moved the logits by {rerun}"
    );
    let (diff, agree) = compare(&first[0], &step(&mut fixed, &item)[0], vocab);
    assert!(diff < 1e-3, "sized vs fixed pool: max diff {diff}");
    assert_eq!(agree, 1.0);
}
