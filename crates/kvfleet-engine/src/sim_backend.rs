//! A simulated backend: the worker's real scheduler, block pool, prefix cache and KV
//! events, with a cost model standing in for the model's compute (like NVIDIA Dynamo's
//! "mocker"). It exists so a real router can be load-tested against many real worker
//! processes on one small machine: a step costs no CPU, only the time the cost model
//! gives it, spent asleep on the engine's own thread (the engine never runs on the
//! async runtime, so sleeping there blocks nothing else).
//!
//! A step of the engine takes
//!
//! ```text
//! prefill tokens ÷ prefill_tokens_per_s + prefill_overhead_ms × prompts finished
//!     + decode_step_base_ms + decode_step_per_seq_ms × decode rows   (when any decode)
//! ```
//!
//! the per-request figures of [`CostModel`] spread over the steps that do the work: a
//! request's whole prefill costs `prefill_overhead_ms + uncached tokens ÷ rate`, as in
//! the fleet simulator (`kvfleet sim`), and each decode step costs what the simulator's
//! does at that batch size.
//!
//! Logits are deterministic: every row puts all its weight on one lowercase ASCII byte
//! chosen by the position it predicts, so generation never samples an end-of-sequence
//! token and `max_tokens` ends it. There is no KV memory: copy-on-write copies are
//! no-ops, and host/disk tiers and peer pulls refuse to start (the trait's defaults).

use crate::backend::{ModelBackend, StepShape};
use crate::error::{EngineError, Result};
use crate::model::{ForwardItem, LogitsRequest};
use crate::model_config::ModelConfig;
use kvfleet_core::cost_model::CostModel;
use std::time::{Duration, Instant};

/// The logit of the token a row predicts; every other token's is 0. Large enough that
/// sampling at any usual temperature still picks it.
const CHOSEN_LOGIT: f32 = 100.0;

/// A backend that prices each step with a [`CostModel`] and sleeps that long.
pub struct SimBackend {
    config: ModelConfig,
    num_blocks: usize,
    cost: CostModel,
    /// Whether [`ModelBackend::forward_step`] sleeps (off in tests of the engine logic,
    /// which must not depend on time).
    sleep: bool,
    /// Simulated time of every step so far.
    simulated: Duration,
}

impl SimBackend {
    /// A simulated `config` model with `num_blocks` KV blocks, timed by `cost`.
    pub fn new(config: ModelConfig, num_blocks: usize, cost: CostModel) -> Self {
        SimBackend {
            config,
            num_blocks,
            cost,
            sleep: true,
            simulated: Duration::ZERO,
        }
    }

    /// The same backend without sleeping: steps only add to [`SimBackend::simulated`].
    pub fn without_sleeping(mut self) -> Self {
        self.sleep = false;
        self
    }

    /// The cost model timing the steps.
    pub fn cost(&self) -> &CostModel {
        &self.cost
    }

    /// Simulated time of every step so far.
    pub fn simulated(&self) -> Duration {
        self.simulated
    }

    /// How long a step of `shape` takes under the cost model.
    pub fn step_time(&self, shape: StepShape) -> Duration {
        let c = &self.cost;
        let mut ms = shape.prefill_tokens as f64 * 1000.0 / c.prefill_tokens_per_s
            + c.prefill_overhead_ms * shape.prompts_finished as f64;
        if shape.decode_rows > 0 {
            ms += c.decode_step_ms(shape.decode_rows);
        }
        // Finite and >= 0 by the cost model's validation; max() also maps NaN to 0.
        Duration::from_secs_f64(ms.max(0.0) / 1000.0)
    }

    /// The token a row at `pos` predicts (the one at `pos + 1`): a lowercase ASCII byte,
    /// which the byte-level tokenizer decodes as itself and which is no stop token.
    fn predicted(&self, pos: usize) -> usize {
        let vocab = self.config.vocab_size.max(1);
        let t = usize::from(b'a') + (pos + 1) % 26;
        if t < vocab {
            t
        } else {
            (pos + 1) % vocab
        }
    }

    fn row(&self, pos: usize, out: &mut Vec<f32>) {
        let start = out.len();
        out.resize(start + self.config.vocab_size, 0.0);
        out[start + self.predicted(pos)] = CHOSEN_LOGIT;
    }

    fn logits(&self, items: &[ForwardItem]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.config.vocab_size;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            if let Some(&bad) = item.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {bad} is outside the vocabulary ({vocab})"
                )));
            }
            let mut rows = Vec::new();
            match item.logits {
                LogitsRequest::None => {}
                LogitsRequest::Last => {
                    if !item.tokens.is_empty() {
                        self.row(item.start_pos + item.tokens.len() - 1, &mut rows);
                    }
                }
                LogitsRequest::All => {
                    for i in 0..item.tokens.len() {
                        self.row(item.start_pos + i, &mut rows);
                    }
                }
            }
            out.push(rows);
        }
        Ok(out)
    }
}

impl ModelBackend for SimBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    fn forward(&mut self, items: &[ForwardItem]) -> Result<Vec<Vec<f32>>> {
        // Called without the engine's shape: one-token rows that want logits count as
        // decode rows, everything else as prefill.
        let mut shape = StepShape::default();
        for item in items {
            if item.tokens.len() == 1 && item.logits == LogitsRequest::Last {
                shape.decode_rows += 1;
            } else {
                shape.prefill_tokens += item.tokens.len();
                shape.prompts_finished += usize::from(item.logits != LogitsRequest::None);
            }
        }
        self.forward_step(items, shape)
    }
    fn forward_step(&mut self, items: &[ForwardItem], shape: StepShape) -> Result<Vec<Vec<f32>>> {
        let started = Instant::now();
        let logits = self.logits(items)?;
        let step = self.step_time(shape);
        self.simulated += step;
        if self.sleep {
            // Less what building the logits took, so the step lasts what it costs.
            std::thread::sleep(step.saturating_sub(started.elapsed()));
        }
        Ok(logits)
    }
    fn copy_block(&mut self, _src: u32, _dst: u32) {
        // No KV memory to copy: the block pool's bookkeeping is all there is.
    }
    fn device_name(&self) -> String {
        "sim".to_string()
    }
}

#[cfg(test)]
mod tests;
