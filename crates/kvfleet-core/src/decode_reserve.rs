//! The room the scheduler keeps for tokens its running sequences have yet to generate.
//!
//! A sequence is admitted when the blocks of its prompt are free, but it then grows by
//! a block every `block_size` tokens it generates. Admitting while the pool has room
//! for prompts only leaves none for that growth: under memory pressure the running
//! sequences then preempt each other step after step, and each preempted one is
//! computed again, its prefix often evicted meanwhile. Four simulated workers of 64
//! blocks replaying 8-turn conversations (`SHAPE=conversation
//! scripts/bench_engine_sim.sh`) preempted 135 times over 192 requests, and the
//! fleet's cached-token share was 0.23.
//!
//! So a waiting sequence is admitted only if the free blocks cover its own expected
//! blocks and the running sequences' expected growth. A sequence is expected to
//! generate `ratio` × the tokens its `max_tokens` still allows (capped at
//! [`DecodeReserveConfig::clip_tokens`], so a request that leaves `max_tokens` to the
//! context length does not starve the queue). Most requests end before their
//! `max_tokens`, so the ratio starts at [`DecodeReserveConfig::init_ratio`] and relaxes
//! towards [`DecodeReserveConfig::min_ratio`] over
//! [`DecodeReserveConfig::decay_steps`] steps without a preemption; each preemption
//! raises it again. This is SGLang's `new_token_ratio` (0.7 decaying to 0.1 over 600
//! steps, estimates clipped at 4,096 tokens). A lone sequence is always admitted: the
//! reserve delays admissions, it never stalls the queue.
//!
//! It lives here, not in the engine, because the fleet simulator (`kvfleet sim
//! --decode-reserve-ratio`) admits its simulated requests by the same rule.
//!
//! On the replay above (four runs each): with no reserve, 135 preemptions, cached
//! share 0.228, request latency p50 / p99 1.41 / 2.43 s; at 0.3 (the default), 20
//! preemptions, 0.325, 1.33 / 2.63 s, 2% longer in all; at SGLang's 0.7, 11, 0.346,
//! 1.30 / 3.03 s, 4% longer. The p99 time to first token rises with the reserve (1.44
//! → 1.87 and 2.28 s: a request waits for room instead of starting and being preempted
//! later), the p99 inter-token latency falls (22 → 20 and 16 ms).

/// How much of their remaining `max_tokens` running sequences are expected to
/// generate, and how that estimate adapts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeReserveConfig {
    /// The expected share at start and after a preemption (default 0.3; 0 turns the
    /// reserve off).
    pub init_ratio: f64,
    /// The least it relaxes to (default 0.1).
    pub min_ratio: f64,
    /// Steps without a preemption over which it relaxes from `init_ratio` to
    /// `min_ratio` (default 600).
    pub decay_steps: u32,
    /// Tokens of `max_tokens` counted at most (default 4096).
    pub clip_tokens: usize,
}

impl Default for DecodeReserveConfig {
    fn default() -> Self {
        DecodeReserveConfig {
            init_ratio: 0.3,
            min_ratio: 0.1,
            decay_steps: 600,
            clip_tokens: 4096,
        }
    }
}

impl DecodeReserveConfig {
    /// No reserve: a sequence is admitted as soon as its prompt's next chunk fits.
    pub fn off() -> Self {
        DecodeReserveConfig {
            init_ratio: 0.0,
            min_ratio: 0.0,
            ..Self::default()
        }
    }

    /// Whether a reserve is kept at all.
    pub fn enabled(&self) -> bool {
        self.init_ratio > 0.0
    }

    /// An error for a ratio outside [0, 1] (the worker's and the simulator's check).
    pub fn validate(&self) -> Result<(), String> {
        if (0.0..=1.0).contains(&self.init_ratio) && (0.0..=1.0).contains(&self.min_ratio) {
            Ok(())
        } else {
            Err(format!(
                "decode reserve ratios must be in [0, 1], got {} and {}",
                self.init_ratio, self.min_ratio
            ))
        }
    }
}

/// The current estimate of [`DecodeReserveConfig`]'s ratio.
#[derive(Clone, Debug)]
pub struct DecodeReserve {
    config: DecodeReserveConfig,
    ratio: f64,
}

/// How much a preemption raises the ratio above `init_ratio` (once it is back there).
const PREEMPTION_STEP: f64 = 0.1;

impl DecodeReserve {
    /// A reserve at its initial ratio.
    /// The ratio never relaxes below `min_ratio`, and `min_ratio` is never above
    /// `init_ratio`: an `init_ratio` of 0 is off whatever the minimum.
    pub fn new(config: DecodeReserveConfig) -> Self {
        let init_ratio = config.init_ratio.clamp(0.0, 1.0);
        let min_ratio = config.min_ratio.clamp(0.0, init_ratio);
        DecodeReserve {
            config: DecodeReserveConfig {
                init_ratio,
                min_ratio,
                ..config
            },
            ratio: init_ratio,
        }
    }

    /// The expected share of the remaining `max_tokens` now.
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// Whether a reserve is kept at all.
    pub fn enabled(&self) -> bool {
        self.config.enabled()
    }

    /// A step ran that preempted nothing: the estimate relaxes by one step's share.
    pub fn relax(&mut self) {
        let c = &self.config;
        let step = (c.init_ratio - c.min_ratio) / f64::from(c.decay_steps.max(1));
        self.ratio = (self.ratio - step).max(c.min_ratio);
    }

    /// A sequence was preempted: the reserve was too small. Back to `init_ratio`, and
    /// above it if it already was there.
    pub fn tighten(&mut self) {
        if !self.enabled() {
            return;
        }
        self.ratio = if self.ratio < self.config.init_ratio {
            self.config.init_ratio
        } else {
            (self.ratio + PREEMPTION_STEP).min(1.0)
        };
    }

    /// Tokens a sequence that may generate `max_tokens` and has generated `generated`
    /// is expected to add.
    pub fn expected_tokens(&self, max_tokens: usize, generated: usize) -> usize {
        let left = max_tokens
            .min(self.config.clip_tokens)
            .saturating_sub(generated);
        (left as f64 * self.ratio).ceil() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_relaxes_without_preemptions_and_a_preemption_raises_it() {
        let mut r = DecodeReserve::new(DecodeReserveConfig {
            init_ratio: 0.7,
            min_ratio: 0.1,
            decay_steps: 6,
            clip_tokens: 100,
        });
        assert_eq!(r.expected_tokens(40, 0), 28);
        assert_eq!(r.expected_tokens(40, 30), 7);
        assert_eq!(r.expected_tokens(40, 50), 0, "past max_tokens: nothing");
        assert_eq!(r.expected_tokens(1000, 0), 70, "clipped at 100 tokens");
        for _ in 0..6 {
            r.relax();
        }
        assert!((r.ratio() - 0.1).abs() < 1e-9, "{}", r.ratio());
        r.relax();
        assert!((r.ratio() - 0.1).abs() < 1e-9, "never below the minimum");
        r.tighten();
        assert!((r.ratio() - 0.7).abs() < 1e-9);
        r.tighten();
        assert!((r.ratio() - 0.8).abs() < 1e-9, "above init once back there");
        for _ in 0..5 {
            r.tighten();
        }
        assert!(
            (r.ratio() - 1.0).abs() < 1e-9,
            "at most the whole max_tokens"
        );
    }

    #[test]
    fn off_reserves_nothing_and_stays_off() {
        let mut r = DecodeReserve::new(DecodeReserveConfig::off());
        assert!(!r.enabled());
        r.tighten();
        assert_eq!(r.expected_tokens(4000, 0), 0);
        // A ratio of 0 is off with the default minimum too (`--decode-reserve-ratio 0`).
        let mut r = DecodeReserve::new(DecodeReserveConfig {
            init_ratio: 0.0,
            ..DecodeReserveConfig::default()
        });
        r.tighten();
        r.relax();
        assert_eq!(r.expected_tokens(4000, 0), 0);
    }
}
