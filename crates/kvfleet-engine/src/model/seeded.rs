//! Deterministic weights for the embedded default model (no weights can be downloaded).
//!
//! Each tensor draws from its own splitmix64 stream, seeded from the model seed and the
//! tensor's name, so adding a tensor never shifts another's values. Values are sums of
//! four uniforms (a bell shape from integer arithmetic only, identical on every
//! platform), scaled to `1/sqrt(fan_in)` so activations keep unit scale through the
//! layers and attention is far from uniform — a seeded model then behaves like a
//! trained one where it matters for numerics tests (peaked softmaxes, O(1) logits).
//! Every value is rounded to bf16 precision, so a checkpoint saved as bf16 reloads
//! bit-exactly.

use super::weights::{Kind, WeightSource};
use crate::error::Result;

/// splitmix64 step.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor name.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

/// Generates tensors on request.
pub(crate) struct SeededSource {
    pub(crate) seed: u64,
}

impl SeededSource {
    /// `n` values with mean 0 and standard deviation `std`, from the stream of `name`.
    fn normalish(&self, name: &str, n: usize, std: f64) -> Vec<f32> {
        let mut state = self.seed ^ name_hash(name).rotate_left(17);
        // Decorrelate nearby seeds before the stream starts.
        splitmix64(&mut state);
        // Sum of four U(0,1) has variance 1/3.
        let scale = std * 3.0f64.sqrt();
        (0..n)
            .map(|_| {
                let r = splitmix64(&mut state);
                let u = |shift: u32| ((r >> shift) & 0xFFFF) as f64 / 65_536.0;
                let x = (u(0) + u(16) + u(32) + u(48) - 2.0) * scale;
                half::bf16::from_f64(x).to_f32()
            })
            .collect()
    }
}

impl WeightSource for SeededSource {
    fn fetch(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: Kind,
        required: bool,
    ) -> Result<Option<Vec<f32>>> {
        if !required {
            return Ok(None);
        }
        let n: usize = shape.iter().product();
        let fan_in = shape.last().copied().unwrap_or(1).max(1) as f64;
        Ok(Some(match kind {
            Kind::Norm => vec![1.0; n],
            Kind::Bias => self.normalish(name, n, 0.1),
            Kind::Matrix | Kind::Embedding => self.normalish(name, n, 1.0 / fan_in.sqrt()),
        }))
    }

    fn describe(&self) -> String {
        format!("the seeded generator (seed {})", self.seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_deterministic_and_independent() {
        let s = SeededSource { seed: 42 };
        let a = s.normalish("a", 1000, 1.0);
        assert_eq!(a, s.normalish("a", 1000, 1.0));
        assert_ne!(a, s.normalish("b", 1000, 1.0));
        assert_ne!(a, SeededSource { seed: 43 }.normalish("a", 1000, 1.0));
        let mean: f64 = a.iter().map(|&x| f64::from(x)).sum::<f64>() / 1000.0;
        let var: f64 = a
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / 1000.0;
        assert!(
            mean.abs() < 0.1 && (var.sqrt() - 1.0).abs() < 0.1,
            "{mean} {var}"
        );
        assert!(a.iter().all(|&x| half::bf16::from_f32(x).to_f32() == x));
    }
}
