//! Engine throughput, measured in process on one model: prompt processing of 512 and 2,048
//! tokens, decode at batch 1, and aggregate decode over 4 and 8 concurrent sequences.
//! `kvfleet bench model` prints it; scripts/bench/vs-llamacpp.sh sets it beside llama.cpp's
//! `llama-bench` (pp512, pp2048, tg128) on the same GGUF.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::backend::CpuBackend;
use crate::engine::{Engine, EngineConfig, Request};
use crate::error::Result;
use crate::model::LlamaModel;
use crate::sampling::SamplingParams;

/// One measured case of [`measure_throughput`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// Prompt processing, 512 tokens.
    Pp512,
    /// Prompt processing, 2,048 tokens.
    Pp2048,
    /// Decode at batch 1.
    Tg128,
    /// Aggregate decode over 4 sequences.
    Agg4,
    /// Aggregate decode over 8 sequences.
    Agg8,
}

impl Case {
    /// Every case, in report order.
    pub const ALL: [Case; 5] = [
        Case::Pp512,
        Case::Pp2048,
        Case::Tg128,
        Case::Agg4,
        Case::Agg8,
    ];

    /// The case's name in reports and on the command line (`pp512`, `tg128`...).
    pub fn name(self) -> &'static str {
        match self {
            Case::Pp512 => "pp512",
            Case::Pp2048 => "pp2048",
            Case::Tg128 => "tg128",
            Case::Agg4 => "agg4",
            Case::Agg8 => "agg8",
        }
    }

    /// The case named `name`, if there is one.
    pub fn parse(name: &str) -> Option<Case> {
        Case::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Tokens per second for each measured case (medians over `repeats`); a case not asked
/// for is `None` and left out of the JSON.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ThroughputReport {
    /// Prompt processing, 512 tokens, nothing cached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pp512: Option<f64>,
    /// Prompt processing, 2,048 tokens, nothing cached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pp2048: Option<f64>,
    /// Decode at batch 1 (128 tokens after a 32-token prompt).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tg128: Option<f64>,
    /// Aggregate decode tokens/s over 4 concurrent sequences.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agg4: Option<f64>,
    /// Aggregate decode tokens/s over 8 concurrent sequences.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agg8: Option<f64>,
}

impl ThroughputReport {
    /// The measured cases with their rates, in report order.
    pub fn measured(&self) -> Vec<(Case, f64)> {
        [self.pp512, self.pp2048, self.tg128, self.agg4, self.agg8]
            .into_iter()
            .zip(Case::ALL)
            .filter_map(|(v, c)| v.map(|v| (c, v)))
            .collect()
    }
}

const BLOCK_SIZE: usize = 16;
const DECODE_TOKENS: usize = 128;

fn engine(model: &Arc<LlamaModel>, id: &str) -> Result<Engine> {
    let config = EngineConfig {
        model_id: id.to_string(),
        block_size: BLOCK_SIZE,
        max_num_seqs: 16,
        max_batched_tokens: 2048,
        max_prefill_chunk: 2048,
        decode_reserve: Default::default(),
    };
    // Room for the 2,048-token prompt, or 8 sequences of 32 + 128 tokens, with slack.
    let blocks = 2048 / BLOCK_SIZE + 8 * (160 / BLOCK_SIZE + 2) + 16;
    Engine::new(
        config,
        Box::new(CpuBackend::new(model.clone(), blocks, BLOCK_SIZE)),
        None,
    )
}

/// Deterministic prompt ids, distinct per `seed`, inside the vocabulary.
fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let lo = 300.min(vocab / 2) as u64;
    let span = (vocab as u64).saturating_sub(lo).max(1);
    (0..len as u64)
        .map(|i| {
            let x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (lo + (x >> 17) % span) as u32
        })
        .collect()
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        // Greedy, as llama-bench (which samples nothing) and the HTTP benchmark run.
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures `cases` of `model` (served as `id`) `repeats` times each; returns the medians.
pub fn measure_throughput(
    model: &Arc<LlamaModel>,
    id: &str,
    repeats: usize,
    cases: &[Case],
) -> Result<ThroughputReport> {
    let vocab = model.config().vocab_size;
    let repeats = repeats.max(1);
    let mut e = engine(model, id)?;
    let mut next_id = 0u64;
    let pp = |e: &mut Engine, next_id: &mut u64, len: usize| -> Result<f64> {
        let mut rates = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            e.clear_cache();
            *next_id += 1;
            let t = Instant::now();
            e.add_request(Request::new(
                *next_id,
                prompt(*next_id, len, vocab),
                params(1),
            ))?;
            while e.has_unfinished() {
                e.step()?;
            }
            rates.push(len as f64 / t.elapsed().as_secs_f64());
        }
        Ok(median(rates))
    };
    let decode = |e: &mut Engine, next_id: &mut u64, batch: usize| -> Result<f64> {
        let mut rates = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            e.clear_cache();
            for _ in 0..batch {
                *next_id += 1;
                e.add_request(Request::new(
                    *next_id,
                    prompt(*next_id, 32, vocab),
                    params(DECODE_TOKENS + 1),
                ))?;
            }
            // The prefill step (and each sequence's first token) is not decode.
            e.step()?;
            let t = Instant::now();
            while e.has_unfinished() {
                e.step()?;
            }
            rates.push((batch * DECODE_TOKENS) as f64 / t.elapsed().as_secs_f64());
        }
        Ok(median(rates))
    };
    let mut report = ThroughputReport::default();
    for case in Case::ALL.into_iter().filter(|c| cases.contains(c)) {
        match case {
            Case::Pp512 => report.pp512 = Some(pp(&mut e, &mut next_id, 512)?),
            Case::Pp2048 => report.pp2048 = Some(pp(&mut e, &mut next_id, 2048)?),
            Case::Tg128 => report.tg128 = Some(decode(&mut e, &mut next_id, 1)?),
            Case::Agg4 => report.agg4 = Some(decode(&mut e, &mut next_id, 4)?),
            Case::Agg8 => report.agg8 = Some(decode(&mut e, &mut next_id, 8)?),
        }
    }
    Ok(report)
}
