//! The constrained-decoding hook: a per-sequence token mask from llguidance, applied to
//! the logits before sampling. Sequences without a grammar never reach this module, so
//! unconstrained decoding pays nothing for it.

use crate::sampling::Sampler;
use kvfleet_core::structured_output::{GrammarCompiler, OutputGrammar, SimpleVob};
use kvfleet_core::TokenId;

/// One sequence's grammar state: the llguidance matcher, advanced by every token the
/// sequence generates.
pub struct SeqConstraint {
    matcher: llguidance::Matcher,
    eos: TokenId,
    /// The masked copy of the logits row (the backend's row stays untouched).
    scratch: Vec<f32>,
}

impl std::fmt::Debug for SeqConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqConstraint")
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl SeqConstraint {
    /// A constraint at the start of `grammar`; `Err` is llguidance's message.
    pub fn new(compiler: &GrammarCompiler, grammar: &OutputGrammar) -> Result<Self, String> {
        Ok(SeqConstraint {
            matcher: compiler.matcher(grammar)?,
            eos: compiler.eos(),
            scratch: Vec::new(),
        })
    }

    /// Draws the next token among those the grammar allows (the end-of-sequence id
    /// once it accepts). `Err`: the matcher failed; the sequence should end.
    pub fn sample(&mut self, sampler: &mut Sampler, logits: &[f32]) -> Result<TokenId, String> {
        // A stopped matcher (grammar complete) allows only end-of-sequence.
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        if mask.is_zero() {
            return Ok(self.eos);
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(logits);
        apply_mask(&mask, &mut self.scratch);
        Ok(sampler.sample(&self.scratch))
    }

    /// Advances the grammar past `token`; `true` when the output is complete (the
    /// token was end-of-sequence, or the grammar allows nothing more).
    pub fn commit(&mut self, token: TokenId) -> Result<bool, String> {
        if token == self.eos {
            return Ok(true);
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| e.to_string())?;
        Ok(self.matcher.is_stopped())
    }

    /// The end-of-sequence id this grammar ends with.
    pub fn eos(&self) -> TokenId {
        self.eos
    }
}

/// Sets every logit the mask disallows to minus infinity; ids past the mask's end
/// (padding of the model's vocabulary) are disallowed too.
pub fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) {
    let words = mask.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = words.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (i, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << i) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;
    use kvfleet_core::tokenizer::{ByteTokenizer, BYTE_IM_END_ID, BYTE_VOCAB_SIZE};

    #[test]
    fn masked_logits_keep_only_allowed_ids() {
        let mut mask = SimpleVob::alloc(40);
        mask.allow_token(3);
        mask.allow_token(33);
        let mut logits = vec![1.0f32; 70];
        apply_mask(&mask, &mut logits);
        let kept: Vec<usize> = (0..70).filter(|&i| logits[i] == 1.0).collect();
        assert_eq!(kept, vec![3, 33]);
    }

    #[test]
    fn random_logits_still_produce_the_schema() {
        let compiler = GrammarCompiler::new(&ByteTokenizer::new(), BYTE_VOCAB_SIZE).unwrap();
        let grammar = OutputGrammar::JsonSchema(
            serde_json::json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": false})
            .to_string(),
        );
        for seed in 0..20u64 {
            let mut c = SeqConstraint::new(&compiler, &grammar).unwrap();
            let params = SamplingParams {
                temperature: 1.0,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let mut sampler = Sampler::new(&params, 0);
            let mut out = Vec::new();
            for step in 0..64u64 {
                // Arbitrary logits that favour no particular token.
                let logits: Vec<f32> = (0..BYTE_VOCAB_SIZE as u64)
                    .map(|i| ((i * 2_654_435_761 + step * 40_503 + seed) % 1000) as f32 / 100.0)
                    .collect();
                let t = c.sample(&mut sampler, &logits).unwrap();
                if c.commit(t).unwrap() {
                    if t != BYTE_IM_END_ID {
                        out.push(t as u8);
                    }
                    break;
                }
                out.push(t as u8);
            }
            let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert!(v["ok"].is_boolean(), "{v}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(1));
        }
    }
}
