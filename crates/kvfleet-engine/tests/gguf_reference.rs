//! SmolLM2-135M-Instruct (Q4_1 GGUF) against Hugging Face transformers' logits and
//! greedy continuations, stored in `tests/fixtures/smollm2_reference.json` by the
//! hand-run reference script (transformers dequantizes the GGUF to f32).
//!
//! - Weights dequantized to f32: logits within 1e-3 relative (max |diff| / max |ref|).
//! - Quantized matmul: cosine ≥ 0.999, and the same argmax wherever the reference's
//!   top-2 margin exceeds 0.5.
//! - On the prompt whose margins are widest, 32 greedy tokens equal the reference.
//!
//! Prompt ids come from the fixture (tokenizer equality is tested with the tokenizer).

mod support;
use std::path::PathBuf;
use support::cosine;

use kvfleet_engine::model::{ForwardItem, LlamaModel, LogitsRequest};
use kvfleet_engine::GgufLoadOptions;
use serde::Deserialize;

#[derive(Deserialize)]
struct Fixture {
    gguf: String,
    generator: String,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    text: String,
    ids: Vec<u32>,
    logit_positions: Vec<usize>,
    logits_f32le_b64: Vec<String>,
    greedy_ids: Vec<u32>,
    top2_margin: Vec<f32>,
    /// The smallest top-2 margin along the reference's greedy continuation, when the
    /// script records it (it picks the prompt for the greedy test).
    #[serde(default)]
    greedy_min_margin: Option<f32>,
}

fn model_path(file: &str) -> PathBuf {
    let path = kvfleet_engine::model_cache::default_model_file().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        path.file_name().and_then(|n| n.to_str()),
        Some(file),
        "the fixture was made from {file}, the default model is {}",
        path.display()
    );
    path
}

fn fixture() -> Fixture {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (it is written by the reference script and committed)",
            path.display()
        )
    });
    let f: Fixture =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(!f.prompts.is_empty(), "fixture without prompts");
    eprintln!("reference: {} by {}", f.gguf, f.generator);
    f
}

/// Standard base64 (with or without padding).
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("bad base64 byte {c}"),
        }
    };
    let bytes: Vec<u8> = s
        .bytes()
        .filter(|&c| c != b'=' && !c.is_ascii_whitespace())
        .collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    out
}

fn ref_logits(b64: &str) -> Vec<f32> {
    base64_decode(b64)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .unwrap_or(0)
}

/// Logits at every position of `ids`, through the paged path the engine serves with.
fn all_logits(model: &LlamaModel, ids: &[u32]) -> Vec<Vec<f32>> {
    let bs = 16;
    let blocks = ids.len().div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut kv = model.new_kv_cache(blocks, bs);
    let out = model
        .forward(
            &[ForwardItem {
                tokens: ids,
                start_pos: 0,
                block_table: &table,
                logits: LogitsRequest::All,
            }],
            &mut kv,
        )
        .unwrap();
    let vocab = model.config().vocab_size;
    out[0].chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

/// `n` greedy tokens after `ids`, decoding one token per step over the KV cache.
fn greedy(model: &LlamaModel, ids: &[u32], n: usize) -> Vec<u32> {
    let bs = 16;
    let blocks = (ids.len() + n).div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut kv = model.new_kv_cache(blocks, bs);
    let mut out = Vec::with_capacity(n);
    let mut step: Vec<u32> = ids.to_vec();
    let mut pos = 0;
    while out.len() < n {
        let l = model
            .forward(
                &[ForwardItem {
                    tokens: &step,
                    start_pos: pos,
                    block_table: &table,
                    logits: LogitsRequest::Last,
                }],
                &mut kv,
            )
            .unwrap();
        pos += step.len();
        let next = argmax(&l[0]) as u32;
        out.push(next);
        step = vec![next];
    }
    out
}

#[test]
fn dequantized_logits_match_transformers() {
    let f = fixture();
    let (model, _) =
        LlamaModel::load_gguf(&model_path(&f.gguf), GgufLoadOptions { dequantize: true }).unwrap();
    for p in &f.prompts {
        let ours = all_logits(&model, &p.ids);
        for (&pos, b64) in p.logit_positions.iter().zip(&p.logits_f32le_b64) {
            let want = ref_logits(b64);
            let got = &ours[pos];
            assert_eq!(got.len(), want.len());
            let max_ref = want.iter().map(|x| x.abs()).fold(0.0, f32::max);
            let max_diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let rel = max_diff / max_ref;
            eprintln!("{:?} @{pos}: relative max diff {rel:.2e}", p.text);
            assert!(
                rel <= 1e-3,
                "{:?} at position {pos}: relative max diff {rel}",
                p.text
            );
        }
    }
}

#[test]
fn quantized_logits_stay_close_to_transformers() {
    let f = fixture();
    let (model, _) =
        LlamaModel::load_gguf(&model_path(&f.gguf), GgufLoadOptions::default()).unwrap();
    let mut checked_argmax = 0;
    for p in &f.prompts {
        let ours = all_logits(&model, &p.ids);
        for ((&pos, b64), &margin) in p
            .logit_positions
            .iter()
            .zip(&p.logits_f32le_b64)
            .zip(&p.top2_margin)
        {
            let want = ref_logits(b64);
            let got = &ours[pos];
            let cos = cosine(got, &want);
            eprintln!("{:?} @{pos}: cosine {cos:.6}, margin {margin:.2}", p.text);
            assert!(cos >= 0.999, "{:?} at position {pos}: cosine {cos}", p.text);
            if margin > 0.5 {
                assert_eq!(
                    argmax(got),
                    argmax(&want),
                    "{:?} at position {pos} (reference margin {margin})",
                    p.text
                );
                checked_argmax += 1;
            }
        }
    }
    assert!(
        checked_argmax > 0,
        "no position with a margin over 0.5 in the fixture"
    );
}

#[test]
fn greedy_continuation_matches_transformers_on_the_widest_margin_prompt() {
    let f = fixture();
    let path = model_path(&f.gguf);
    let p = f
        .prompts
        .iter()
        .filter(|p| p.greedy_ids.len() >= 32)
        .max_by(|a, b| {
            let min = |p: &Prompt| {
                p.greedy_min_margin
                    .unwrap_or_else(|| p.top2_margin.iter().copied().fold(f32::INFINITY, f32::min))
            };
            min(a).total_cmp(&min(b))
        })
        .expect("no prompt with 32 greedy ids");
    for opts in [
        GgufLoadOptions::default(),
        GgufLoadOptions { dequantize: true },
    ] {
        let (model, _) = LlamaModel::load_gguf(&path, opts).unwrap();
        let got = greedy(&model, &p.ids, 32);
        assert_eq!(got, p.greedy_ids[..32], "{:?} ({opts:?})", p.text);
    }
}

/// The logits after `ids`, prefilled `split` tokens at a time over one KV cache (as the
/// engine does for a prompt whose first blocks are cached, or for chunked prefill).
fn last_logits_in_steps(model: &LlamaModel, ids: &[u32], split: &[usize]) -> Vec<f32> {
    let bs = 16;
    let blocks = ids.len().div_ceil(bs);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut kv = model.new_kv_cache(blocks, bs);
    let mut pos = 0usize;
    let mut last = Vec::new();
    for &n in split.iter().chain(std::iter::once(&usize::MAX)) {
        let end = pos.saturating_add(n).min(ids.len());
        if end == pos {
            break;
        }
        let mut out = model
            .forward(
                &[ForwardItem {
                    tokens: &ids[pos..end],
                    start_pos: pos,
                    block_table: &table,
                    logits: LogitsRequest::Last,
                }],
                &mut kv,
            )
            .unwrap();
        last = out.swap_remove(0);
        pos = end;
    }
    last
}

/// A prompt prefilled cold in one step, the same prompt as a short tail after a
/// cached prefix, and the prompt beside another sequence give the same logits, bit for
/// bit: otherwise a repeated greedy request can answer differently once its prefix is
/// cached (a near-tie flips).
#[test]
fn a_prompt_gets_the_same_logits_cold_and_after_a_cached_prefix() {
    let f = fixture();
    let (model, _) =
        LlamaModel::load_gguf(&model_path(&f.gguf), GgufLoadOptions::default()).unwrap();
    // Over 300 tokens, so the cold prefill is a many-row product.
    let ids: Vec<u32> = f
        .prompts
        .iter()
        .flat_map(|p| p.ids.iter().copied())
        .cycle()
        .take(333)
        .collect();
    let cold = last_logits_in_steps(&model, &ids, &[]);
    for split in [&[320][..], &[16, 300, 16], &[329, 1, 1, 1]] {
        let cached = last_logits_in_steps(&model, &ids, split);
        let differing = cold
            .iter()
            .zip(&cached)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing, 0,
            "prefilled as {split:?} then the rest: {differing} logits differ"
        );
    }
    // The same prompt sharing its step with another sequence.
    let other: Vec<u32> = ids.iter().rev().take(70).copied().collect();
    let bs = 16;
    let (na, nb) = (ids.len().div_ceil(bs), other.len().div_ceil(bs));
    let table_a: Vec<u32> = (0..na as u32).collect();
    let table_b: Vec<u32> = (na as u32..(na + nb) as u32).collect();
    let mut kv = model.new_kv_cache(na + nb, bs);
    let both = model
        .forward(
            &[
                ForwardItem {
                    tokens: &other,
                    start_pos: 0,
                    block_table: &table_b,
                    logits: LogitsRequest::Last,
                },
                ForwardItem {
                    tokens: &ids,
                    start_pos: 0,
                    block_table: &table_a,
                    logits: LogitsRequest::Last,
                },
            ],
            &mut kv,
        )
        .unwrap();
    let differing = cold
        .iter()
        .zip(&both[1])
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(
        differing, 0,
        "beside another sequence: {differing} logits differ"
    );
}
