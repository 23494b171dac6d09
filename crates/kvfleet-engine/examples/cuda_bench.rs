//! GPU benchmarks, printed as one JSON object (run by scripts/gpu-check.sh):
//!
//! - `d2d_copy`: device-to-device copy bandwidth of a 1 GiB buffer (read + write bytes);
//! - `paged_decode`: split-K paged decode attention at batch 64 × 4096 keys with
//!   Llama-3-8B attention geometry (32 query heads, 8 KV heads, head_dim 128, block 16,
//!   bf16), K/V read through shuffled block tables; GB/s of K/V read and its fraction
//!   of the copy bandwidth;
//! - `ttft`: time to first token of a 32,768-token prompt, cold (prefilled in chunks of
//!   4,096 like the engine's chunked prefill) and with the 32,768-token prefix already
//!   in the KV cache (only the last 64 tokens computed), on a seeded 16-layer model with
//!   Llama geometry (hidden 1024, 8 heads × 128, 4 KV heads, ~220M parameters).
//!
//! Usage: `cuda_bench [--device cuda:N] [--skip-ttft]`.

use std::sync::Arc;
use std::time::Instant;

use kvfleet_engine::cuda::bench::{d2d_copy, paged_decode, DecodeShape};
use kvfleet_engine::cuda::CudaBackend;
use kvfleet_engine::{Device, ForwardItem, LlamaModel, LogitsRequest, ModelBackend, ModelConfig};
use serde_json::json;

fn ttft_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 32_000,
        hidden_size: 1024,
        intermediate_size: 2816,
        num_hidden_layers: 16,
        num_attention_heads: 8,
        num_key_value_heads: Some(4),
        head_dim: Some(128),
        max_position_embeddings: 65_536,
        ..ModelConfig::small()
    }
}

/// Runs `tokens` from `start` through the backend in chunks of `chunk`, the last one
/// asking for the last token's logits; returns seconds until those logits are back.
fn prefill(
    backend: &mut CudaBackend,
    tokens: &[u32],
    start: usize,
    table: &[u32],
    chunk: usize,
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut p = start;
    while p < tokens.len() {
        let end = (p + chunk).min(tokens.len());
        let logits = if end == tokens.len() {
            LogitsRequest::Last
        } else {
            LogitsRequest::None
        };
        backend
            .forward(&[ForwardItem {
                tokens: &tokens[p..end],
                start_pos: p,
                block_table: table,
                logits,
            }])
            .map_err(|e| e.to_string())?;
        p = end;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn run() -> Result<serde_json::Value, String> {
    let args: Vec<String> = std::env::args().collect();
    let device = match args.iter().position(|a| a == "--device") {
        Some(i) => args
            .get(i + 1)
            .ok_or("--device needs a value")?
            .parse::<Device>()?,
        None => Device::Cuda(0),
    };
    let Device::Cuda(ordinal) = device else {
        return Err("cuda_bench needs a CUDA device".into());
    };
    let err = |e: kvfleet_engine::EngineError| e.to_string();
    let copy = d2d_copy(ordinal, 1 << 30, 20).map_err(err)?;
    let shape = DecodeShape {
        batch: 64,
        context: 4096,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        block_size: 16,
    };
    let decode = paged_decode(ordinal, shape, 50).map_err(err)?;
    let mut out = json!({
        "d2d_copy": {"bytes_per_iter": copy.bytes, "ms": copy.ms, "gbps": copy.gbps()},
        "paged_decode": {
            "batch": shape.batch, "context": shape.context, "n_heads": shape.n_heads,
            "n_kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim,
            "block_size": shape.block_size, "dtype": "bf16",
            "kv_bytes_per_iter": decode.bytes, "ms": decode.ms, "gbps": decode.gbps(),
            "fraction_of_copy_bandwidth": decode.gbps() / copy.gbps(),
        },
    });
    if !args.iter().any(|a| a == "--skip-ttft") {
        let config = ttft_config();
        let params = config.num_parameters();
        let model = Arc::new(LlamaModel::seeded(config, 7).map_err(err)?);
        let prompt_len: usize = 32_768;
        let suffix: usize = 64;
        let bs: usize = 16;
        let blocks = (prompt_len + suffix).div_ceil(bs) + 8;
        let mut backend = CudaBackend::new(model, blocks, bs, ordinal).map_err(err)?;
        let table: Vec<u32> = (0..blocks as u32).collect();
        let tokens: Vec<u32> = (0..(prompt_len + suffix) as u32)
            .map(|i| (i * 7919 + 13) % 32_000)
            .collect();
        // Warm-up (kernel JIT, cuBLAS heuristics) on a short prompt.
        prefill(&mut backend, &tokens[..4096], 0, &table, 4096)?;
        // Cold: the whole 32k-token prompt (+ suffix) computed.
        let cold = prefill(&mut backend, &tokens, 0, &table, 4096)?;
        // Cached: the 32k prefix is in the cache; only the suffix is computed.
        let cached = prefill(&mut backend, &tokens, prompt_len, &table, 4096)?;
        out["ttft"] = json!({
            "model": "seeded: 16 layers, hidden 1024, 8 heads x 128, 4 KV heads, inter 2816, vocab 32000",
            "parameters": params,
            "prompt_tokens": prompt_len + suffix,
            "cached_prefix_tokens": prompt_len,
            "prefill_chunk": 4096,
            "cold_s": cold,
            "cached_s": cached,
            "speedup": cold / cached,
        });
    }
    Ok(out)
}

fn main() {
    match run() {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
