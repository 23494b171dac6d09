//! `random`: uniformly random, from a seeded generator so runs are reproducible.

use super::{RouteContext, RoutingPolicy, Selection};

/// Picks a uniformly random candidate with an xorshift64* generator.
#[derive(Clone, Debug)]
pub struct RandomPolicy {
    state: u64,
}

impl RandomPolicy {
    /// A generator seeded with `seed` (any value; zero is remapped).
    pub fn new(seed: u64) -> Self {
        Self {
            // xorshift must not start at zero.
            state: super::mix64(seed) | 1,
        }
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

impl RoutingPolicy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection> {
        let n = ctx.candidates.len() as u64;
        if n == 0 {
            return None;
        }
        // Multiply-shift maps 64 random bits onto 0..n without a division.
        let i = ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as usize;
        ctx.candidates.get(i).map(|c| Selection::to(c.worker))
    }
}
