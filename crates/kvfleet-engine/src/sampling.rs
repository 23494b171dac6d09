//! Turning logits into the next token: greedy, temperature, top-k and top-p sampling,
//! reproducible from a seed; OpenAI's `logit_bias`, `presence_penalty` and
//! `frequency_penalty` applied first when a request asks for them; and the
//! log-probabilities of what was sampled ([`token_logprobs`]), computed only on request.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// How to pick tokens and when to stop, per request (OpenAI-style parameters).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1.0 disables.
    pub top_p: f32,
    /// Seed of the request's random stream; `None` lets the engine choose one.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Stop when the generated text contains one of these strings.
    pub stop: Vec<String>,
    /// Stop when one of these tokens is generated.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// The grammar the output must follow (structured outputs); `None` decodes freely.
    pub grammar: Option<kvfleet_core::structured_output::OutputGrammar>,
    /// Report each generated token's log-probability and this many most likely
    /// alternatives (at most [`MAX_TOP_LOGPROBS`]); `None`: no log-probabilities.
    pub logprobs: Option<usize>,
    /// Subtracted once from the logit of every token generated so far (-2..=2).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (-2..=2).
    pub frequency_penalty: f32,
    /// Added to a token's logit before sampling: (token id, -100..=100), at most
    /// [`MAX_LOGIT_BIAS`] entries.
    pub logit_bias: Vec<(u32, f32)>,
}

/// Most alternatives one token's log-probabilities may list (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most `logit_bias` entries one request may give (OpenAI's bound).
pub const MAX_LOGIT_BIAS: usize = 300;
/// Largest magnitude of a presence or frequency penalty (OpenAI's bound).
pub const MAX_PENALTY: f32 = 2.0;
/// Largest magnitude of a logit bias (OpenAI's bound).
pub const MAX_BIAS: f32 = 100.0;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            grammar: None,
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Rejects parameters no sampler can honour, with [`EngineError::InvalidRequest`].
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature must be finite and >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        kvfleet_core::openai::check_stop_strings(&self.stop)
            .map_err(EngineError::InvalidRequest)?;
        kvfleet_core::openai::check_stop_token_ids(&self.stop_token_ids)
            .map_err(EngineError::InvalidRequest)?;
        if self.stop.iter().any(String::is_empty) {
            // An empty stop string would match before the first token.
            return bad("stop strings must not be empty".into());
        }
        if self.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return bad(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {:?}",
                self.logprobs
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(v.is_finite() && v.abs() <= MAX_PENALTY) {
                return bad(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return bad(format!(
                "logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {}",
                self.logit_bias.len()
            ));
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(b.is_finite() && b.abs() <= MAX_BIAS))
        {
            return bad(format!(
                "logit_bias of token {t} must be between -100 and 100, got {b}"
            ));
        }
        Ok(())
    }

    /// Whether these parameters pick the argmax (no randomness involved).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and identical on every platform,
/// so a seeded request reproduces its tokens anywhere.
#[derive(Debug, Clone)]
struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    fn new(seed: u64) -> Self {
        let mut sm = seed;
        Self {
            s: [
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
                splitmix64(&mut sm),
            ],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Picks tokens from logits according to one request's [`SamplingParams`]; owns the
/// request's random stream, so one `Sampler` should live as long as its sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    rng: Rng,
    /// Scratch for candidate (id, weight) pairs, kept to avoid an allocation per token.
    scratch: Vec<(u32, f64)>,
    /// Bias and penalties, only for requests that ask for them: others sample the
    /// model's logits as they are, with no copy.
    adjust: Option<Box<Adjust>>,
}

/// `logit_bias` and the presence and frequency penalties of one request, with the
/// counts of the tokens it generated.
#[derive(Debug, Clone)]
struct Adjust {
    bias: Vec<(u32, f32)>,
    presence: f32,
    frequency: f32,
    /// How often each token was sampled so far (only kept with a penalty).
    counts: std::collections::HashMap<u32, u32>,
    /// The adjusted row, reused from token to token.
    row: Vec<f32>,
}

impl Adjust {
    fn new(params: &SamplingParams) -> Option<Box<Self>> {
        let on = !params.logit_bias.is_empty()
            || params.presence_penalty != 0.0
            || params.frequency_penalty != 0.0;
        on.then(|| {
            Box::new(Adjust {
                bias: params.logit_bias.clone(),
                presence: params.presence_penalty,
                frequency: params.frequency_penalty,
                counts: Default::default(),
                row: Vec::new(),
            })
        })
    }

    /// Copies `logits` into `row` with bias and penalties applied (OpenAI's definition:
    /// `logit - count * frequency - (count > 0) * presence + bias`). Ids outside the
    /// row are ignored.
    fn apply(&mut self, logits: &[f32]) {
        self.row.clear();
        self.row.extend_from_slice(logits);
        for &(t, b) in &self.bias {
            if let Some(l) = self.row.get_mut(t as usize) {
                *l += b;
            }
        }
        for (&t, &c) in &self.counts {
            if let Some(l) = self.row.get_mut(t as usize) {
                *l -= c as f32 * self.frequency + self.presence;
            }
        }
    }

    fn record(&mut self, token: u32) {
        if self.presence != 0.0 || self.frequency != 0.0 {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from `fallback_seed` when the request has
    /// none (the engine derives that from the request id so runs stay reproducible).
    pub fn new(params: &SamplingParams, fallback_seed: u64) -> Self {
        Self {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            rng: Rng::new(params.seed.unwrap_or(fallback_seed)),
            scratch: Vec::new(),
            adjust: Adjust::new(params),
        }
    }

    /// Draws the next token from one row of logits (length = vocabulary size), after
    /// the request's bias and penalties if it has any. NaN logits are treated as minus
    /// infinity. An empty row yields token 0.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let Some(mut adjust) = self.adjust.take() else {
            return self.draw(logits);
        };
        adjust.apply(logits);
        let token = self.draw(&adjust.row);
        adjust.record(token);
        self.adjust = Some(adjust);
        token
    }

    /// Draws from `logits` as they are.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.temperature == 0.0 || self.top_k == 1 || logits.len() <= 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / f64::from(self.temperature);
        let cands = &mut self.scratch;
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan() && **l > f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, f64::from(l))),
        );
        if cands.is_empty() {
            return argmax(logits);
        }
        // Most likely first, lower id first among equals: a total order, so the
        // candidate list (and thus the draw) is reproducible.
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if self.top_k > 0 && self.top_k < cands.len() {
            cands.select_nth_unstable_by(self.top_k - 1, order);
            cands.truncate(self.top_k);
        }
        let max = cands.iter().map(|c| c.1).fold(f64::NEG_INFINITY, f64::max);
        let weight = |logit: f64| ((logit - max) * inv_t).exp();
        let total = if self.top_p < 1.0 {
            nucleus(cands, f64::from(self.top_p), weight, order)
        } else {
            let mut total = 0.0;
            for c in cands.iter_mut() {
                c.1 = weight(c.1);
                total += c.1;
            }
            total
        };
        let mut u = self.rng.next_f64() * total;
        for c in cands.iter() {
            if u < c.1 {
                return c.0;
            }
            u -= c.1;
        }
        // Rounding left a sliver of mass past the last candidate.
        cands.last().map_or(0, |c| c.0)
    }
}

/// One generated token's log-probability and the most likely alternatives at its
/// step: the log-softmax of the model's raw logits (before temperature, bias and
/// penalties, as vLLM reports by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The sampled token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens, most likely first (lower id first among equals).
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of `logits` at `token`, with the `top` most likely tokens. NaN
/// logits count as minus infinity. Sums in f64.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let finite = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = logits
        .iter()
        .map(|&l| finite(l))
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = if max == f32::NEG_INFINITY {
        0.0
    } else {
        let m = f64::from(max);
        let sum: f64 = logits
            .iter()
            .map(|&l| (f64::from(finite(l)) - m).exp())
            .sum();
        m + sum.ln()
    };
    let lp = |l: f32| (f64::from(finite(l)) - lse) as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| lp(l));
    let mut ids: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, finite(l)))
        .collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = top.min(ids.len());
    if k > 0 && k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
    }
    ids.truncate(k);
    ids.sort_unstable_by(order);
    TokenLogprobs {
        token,
        logprob,
        top: ids.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

/// Candidates a nucleus search sorts first; it grows fourfold while the mass falls short.
const NUCLEUS_FIRST: usize = 64;

/// Top-p without sorting the vocabulary: leaves in `cands` the smallest most-likely-first
/// prefix whose weight reaches `top_p` of the total (at least one token), in that order,
/// each logit replaced by its weight, and returns the prefix's weight. Sorted lazily:
/// select the next `k` best, sort only those, accumulate, repeat on the rest. The prefix,
/// its order and its running sum are exactly what sorting everything would give; only
/// the total the threshold is taken of is summed in candidate order rather than sorted
/// order (they differ in the last bits, which matters only when the running sum lands
/// within rounding of the threshold).
fn nucleus(
    cands: &mut Vec<(u32, f64)>,
    top_p: f64,
    weight: impl Fn(f64) -> f64,
    order: impl Fn(&(u32, f64), &(u32, f64)) -> std::cmp::Ordering + Copy,
) -> f64 {
    let total: f64 = cands.iter().map(|c| weight(c.1)).sum();
    let target = top_p * total;
    let mut acc = 0.0;
    let mut done = 0;
    let mut step = NUCLEUS_FIRST;
    while done < cands.len() {
        let rest = &mut cands[done..];
        let k = step.min(rest.len());
        if k < rest.len() {
            rest.select_nth_unstable_by(k - 1, order);
        }
        rest[..k].sort_unstable_by(order);
        for i in done..done + k {
            let w = weight(cands[i].1);
            cands[i].1 = w;
            acc += w;
            if acc >= target {
                cands.truncate(i + 1);
                return acc;
            }
        }
        done += k;
        step = step.saturating_mul(4);
    }
    acc
}

/// Index of the largest logit; the lowest index wins ties, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !found || v > best_v {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.3)
            .collect()
    }

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: Option<u64>) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn defaults_are_greedy_and_valid() {
        let p = SamplingParams::default();
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.max_tokens, 16);
        assert!(p.is_greedy());
        p.validate().unwrap();
    }

    #[test]
    fn greedy_is_argmax_lowest_id_on_ties() {
        let mut s = Sampler::new(&SamplingParams::default(), 1);
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0, -6.0]), 1);
        assert_eq!(s.sample(&[2.0; 8]), 0);
        assert_eq!(argmax(&[]), 0);
        let l = logits();
        let expect = argmax(&l);
        assert_eq!(
            l[expect as usize],
            l.iter().cloned().fold(f32::MIN, f32::max)
        );
    }

    #[test]
    fn seeded_sampling_is_reproducible() {
        let l = logits();
        let draw = |seed: Option<u64>, fallback: u64| {
            let mut s = Sampler::new(&params(1.0, 0, 1.0, seed), fallback);
            (0..64).map(|_| s.sample(&l)).collect::<Vec<_>>()
        };
        assert_eq!(draw(Some(7), 1), draw(Some(7), 2));
        assert_eq!(draw(None, 5), draw(None, 5));
        assert_ne!(draw(Some(7), 1), draw(Some(8), 1));
        // A real distribution: more than one distinct token shows up.
        let mut toks = draw(Some(7), 1);
        toks.sort_unstable();
        toks.dedup();
        assert!(toks.len() > 3);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let l = logits();
        let g = argmax(&l);
        for seed in 0..20 {
            assert_eq!(
                Sampler::new(&params(1.5, 1, 1.0, Some(seed)), 0).sample(&l),
                g
            );
            assert_eq!(
                Sampler::new(&params(1.5, 0, 1e-6, Some(seed)), 0).sample(&l),
                g
            );
        }
    }

    #[test]
    fn top_k_restricts_candidates() {
        let l = logits();
        let mut sorted: Vec<u32> = (0..l.len() as u32).collect();
        sorted.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        let top3 = &sorted[..3];
        let mut s = Sampler::new(&params(5.0, 3, 1.0, Some(3)), 0);
        for _ in 0..200 {
            assert!(top3.contains(&s.sample(&l)));
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities ~0.5, 0.3, 0.2 (and negligible): top_p 0.7 keeps two tokens.
        let l = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln(), -100.0];
        let mut s = Sampler::new(&params(1.0, 0, 0.7, Some(11)), 0);
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&l) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0);
        assert!(seen[0] > 1000 && seen[1] > 500, "{seen:?}");
    }

    #[test]
    fn temperature_follows_the_distribution() {
        let l = [0.0f32, 2.0f32.ln()]; // p = 1/3, 2/3
        let mut s = Sampler::new(&params(1.0, 0, 1.0, Some(99)), 0);
        let ones = (0..6000).filter(|_| s.sample(&l) == 1).count();
        assert!((3700..4300).contains(&ones), "{ones}");
    }

    /// The sampler before the lazy nucleus: sorts every candidate.
    fn sample_full_sort(p: &SamplingParams, rng: &mut Rng, logits: &[f32]) -> u32 {
        let inv_t = 1.0 / f64::from(p.temperature);
        let mut cands: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, f64::from(l)))
            .collect();
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, order);
            cands.truncate(p.top_k);
        }
        cands.sort_unstable_by(order);
        let max = cands[0].1;
        let mut total = 0.0;
        for c in cands.iter_mut() {
            c.1 = ((c.1 - max) * inv_t).exp();
            total += c.1;
        }
        let target = f64::from(p.top_p) * total;
        let mut acc = 0.0;
        let mut keep = cands.len();
        for (i, c) in cands.iter().enumerate() {
            acc += c.1;
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        cands.truncate(keep);
        let mut u = rng.next_f64() * acc;
        for c in &cands {
            if u < c.1 {
                return c.0;
            }
            u -= c.1;
        }
        cands.last().map_or(0, |c| c.0)
    }

    #[test]
    fn lazy_nucleus_draws_what_a_full_sort_draws() {
        // A vocabulary-sized row with a long tail and tied logits.
        let l: Vec<f32> = (0..49_152u32)
            .map(|i| {
                let h = i.wrapping_mul(2_654_435_761) >> 8;
                ((h % 4096) as f32 / 4096.0).powi(3) * 12.0 - 4.0 + (i % 7 == 0) as u8 as f32
            })
            .collect();
        for (temperature, top_k, top_p) in [
            (1.0, 0, 0.9),
            (0.7, 0, 0.95),
            (1.3, 0, 0.5),
            (2.0, 0, 0.999),
            (0.8, 40, 0.9),
            (1.0, 5000, 0.99),
        ] {
            let p = params(temperature, top_k, top_p, Some(21));
            let mut lazy = Sampler::new(&p, 0);
            let mut rng = Rng::new(21);
            let mut distinct = std::collections::BTreeSet::new();
            for _ in 0..300 {
                let a = lazy.sample(&l);
                assert_eq!(a, sample_full_sort(&p, &mut rng, &l), "{p:?}");
                distinct.insert(a);
            }
            assert!(distinct.len() > 10, "{p:?}: {} distinct", distinct.len());
        }
    }

    #[test]
    fn a_logit_bias_of_100_makes_greedy_pick_its_token() {
        let l = logits();
        let low = (0..l.len() as u32)
            .min_by(|&a, &b| l[a as usize].total_cmp(&l[b as usize]))
            .unwrap();
        assert_ne!(argmax(&l), low);
        let p = SamplingParams {
            logit_bias: vec![(low, 100.0)],
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(&p, 0);
        assert_eq!(s.sample(&l), low);
        // -100 bans the argmax; ids outside the vocabulary are ignored.
        let best = argmax(&l);
        let p = SamplingParams {
            logit_bias: vec![(best, -100.0), (u32::MAX, 100.0)],
            ..SamplingParams::default()
        };
        assert_ne!(Sampler::new(&p, 0).sample(&l), best);
    }

    #[test]
    fn frequency_penalty_lowers_a_repeated_token_by_count_times_penalty() {
        // Token 0 leads by 1.0; each pick of it costs 0.3 (frequency) and, once,
        // 0.05 (presence): picked at 1.0 and 0.65, then 0.35, then below token 1.
        let l = [1.0f32, 0.0, -5.0];
        let p = SamplingParams {
            frequency_penalty: 0.3,
            presence_penalty: 0.05,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(&p, 0);
        let picks: Vec<u32> = (0..5).map(|_| s.sample(&l)).collect();
        assert_eq!(picks, vec![0, 0, 0, 0, 1]);
        let adjust = s.adjust.as_ref().unwrap();
        assert_eq!(adjust.counts[&0], 4);
        // The adjusted row the last pick saw: 1.0 - 4 * 0.3 - 0.05 for token 0.
        assert!((adjust.row[0] - (1.0 - 4.0 * 0.3 - 0.05)).abs() < 1e-6);
        assert_eq!(adjust.row[1], 0.0);
        // Without options there is nothing to adjust.
        assert!(Sampler::new(&SamplingParams::default(), 0).adjust.is_none());
    }

    #[test]
    fn token_logprobs_are_the_log_softmax_with_sorted_alternatives() {
        let l = logits();
        let max = l.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        let t = token_logprobs(&l, 7, 5);
        assert!((f64::from(t.logprob) - (l[7] as f64 - lse)).abs() < 1e-6);
        assert_eq!(t.top.len(), 5);
        assert_eq!(t.top[0].0, argmax(&l));
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let mass: f64 = l.iter().map(|&x| (x as f64 - lse).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-9);
        assert!(token_logprobs(&l, 7, 0).top.is_empty());
        assert_eq!(token_logprobs(&[0.0, 0.0], 1, 20).top.len(), 2);
    }

    #[test]
    fn validate_rejects_bad_params() {
        for p in [
            params(-0.1, 0, 1.0, None),
            params(f32::NAN, 0, 1.0, None),
            params(f32::INFINITY, 0, 1.0, None),
            params(1.0, 0, 0.0, None),
            params(1.0, 0, 1.5, None),
            params(1.0, 0, f32::NAN, None),
            SamplingParams {
                max_tokens: 0,
                ..SamplingParams::default()
            },
            SamplingParams {
                stop: vec![String::new()],
                ..SamplingParams::default()
            },
            SamplingParams {
                logprobs: Some(21),
                ..SamplingParams::default()
            },
            SamplingParams {
                presence_penalty: 2.5,
                ..SamplingParams::default()
            },
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..SamplingParams::default()
            },
            SamplingParams {
                logit_bias: vec![(1, 101.0)],
                ..SamplingParams::default()
            },
            SamplingParams {
                logit_bias: vec![(1, 1.0); 301],
                ..SamplingParams::default()
            },
        ] {
            assert!(
                matches!(p.validate(), Err(EngineError::InvalidRequest(_))),
                "{p:?}"
            );
        }
        params(0.7, 40, 0.9, Some(1)).validate().unwrap();
    }
}
