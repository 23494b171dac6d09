//! Loads a GGUF model and reports what it costs: resident memory against the file's
//! size (the bound is RSS ≤ GGUF size + KV pool + 150 MiB), load time, and
//! the speed of a prefill and of batch-1 decode steps.
//!
//! `cargo run --release -p kvfleet-engine --example gguf_load -- FILE.gguf [--dequantize]`

use std::time::Instant;

use kvfleet_engine::model::{ForwardItem, LlamaModel, LogitsRequest};
use kvfleet_engine::GgufLoadOptions;

/// A field of /proc/self/status in KiB (Linux).
fn status_kib(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: gguf_load FILE.gguf [--dequantize]")?;
    let opts = GgufLoadOptions {
        dequantize: args.iter().any(|a| a == "--dequantize"),
    };
    let size = std::fs::metadata(path)?.len();
    let before = status_kib("VmRSS:");
    let t = Instant::now();
    let (model, _file) = LlamaModel::load_gguf(path.as_ref(), opts)?;
    let load_s = t.elapsed().as_secs_f64();
    let (rss, hwm) = (status_kib("VmRSS:"), status_kib("VmHWM:"));
    println!(
        "file {:.1} MiB; load {load_s:.2} s; RSS before {:.1} MiB, after {:.1} MiB (peak {:.1} MiB); RSS - file = {:.1} MiB",
        size as f64 / 1048576.0,
        before as f64 / 1024.0,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0,
        (rss as f64 * 1024.0 - size as f64) / 1048576.0
    );
    let bs = 16usize;
    let n_prompt = 128usize;
    let n_decode = 32usize;
    let blocks = (n_prompt + n_decode).div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut kv = model.new_kv_cache(blocks, bs);
    let vocab = model.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..n_prompt as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let t = Instant::now();
    let item = ForwardItem {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table,
        logits: LogitsRequest::Last,
    };
    let mut last = model.forward(&[item], &mut kv)?.remove(0);
    let prefill_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for step in 0..n_decode {
        let next = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap_or(0) as u32;
        let tokens = [next];
        let item = ForwardItem {
            tokens: &tokens,
            start_pos: n_prompt + step,
            block_table: &table,
            logits: LogitsRequest::Last,
        };
        last = model.forward(&[item], &mut kv)?.remove(0);
    }
    let decode_s = t.elapsed().as_secs_f64();
    println!(
        "prefill {n_prompt} tokens: {:.1} tok/s; decode batch 1: {:.1} tok/s; RSS now {:.1} MiB (KV pool {:.1} MiB)",
        n_prompt as f64 / prefill_s,
        n_decode as f64 / decode_s,
        status_kib("VmRSS:") as f64 / 1024.0,
        (blocks * bs * 2 * model.config().num_hidden_layers * model.config().num_kv_heads() * model.config().head_dim() * 4) as f64 / 1048576.0
    );
    Ok(())
}
