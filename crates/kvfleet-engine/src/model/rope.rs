//! Rotary position embeddings, rotate-half (NeoX) style as in Hugging Face Llama,
//! with optional Llama-3 / linear frequency scaling.

use crate::model_config::{ModelConfig, RopeScaling};

/// Inverse frequencies of one model; angles are computed per call for the positions in
/// the batch, which costs little and needs no table sized by the context length.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    inv_freq: Vec<f32>,
}

/// cos/sin of every rotary pair for a list of positions: row `i` (width `head_dim / 2`)
/// belongs to position `i` of the list.
pub(crate) struct RopeTables {
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
    pub(crate) half: usize,
}

impl Rope {
    pub(crate) fn new(config: &ModelConfig) -> Self {
        let dim = config.head_dim();
        let base = config.rope_theta;
        let inv_freq = (0..dim / 2)
            .map(|i| {
                let f = 1.0 / base.powf((2 * i) as f64 / dim as f64);
                scale_frequency(f, config.rope_scaling.as_ref()) as f32
            })
            .collect();
        Self { inv_freq }
    }

    /// Divides each inverse frequency by its factor (Llama 3 GGUF files carry their
    /// rope scaling as these per-pair divisors, `rope_freqs.weight`, as llama.cpp applies them).
    pub(crate) fn divide_frequencies(&mut self, factors: &[f32]) {
        for (f, d) in self.inv_freq.iter_mut().zip(factors) {
            *f /= d;
        }
    }

    /// The inverse frequency of each rotary pair, scaling applied.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Tables for `positions`. The angle is rounded to f32 before cos/sin, as Hugging
    /// Face and vLLM compute it, so long positions lose the same precision they do.
    pub(crate) fn tables(&self, positions: impl IntoIterator<Item = usize>) -> RopeTables {
        let half = self.inv_freq.len();
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for p in positions {
            for &f in &self.inv_freq {
                let angle = f64::from(p as f32 * f);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        RopeTables { cos, sin, half }
    }
}

impl RopeTables {
    /// Rotates the `n_heads` heads stored contiguously in `x` (each `2 * half` wide)
    /// with the angles of table row `row`.
    #[inline]
    pub(crate) fn apply(&self, row: usize, x: &mut [f32], n_heads: usize) {
        let half = self.half;
        let cos = &self.cos[row * half..(row + 1) * half];
        let sin = &self.sin[row * half..(row + 1) * half];
        for head in x.chunks_exact_mut(2 * half).take(n_heads) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

/// Applies `rope_scaling` to one inverse frequency (transformers' `_compute_llama3_parameters`).
fn scale_frequency(inv_freq: f64, scaling: Option<&RopeScaling>) -> f64 {
    match scaling {
        None => inv_freq,
        Some(RopeScaling::Linear { factor }) => inv_freq / factor,
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old_len = *original_max_position_embeddings as f64;
            let low_freq_wavelen = old_len / low_freq_factor;
            let high_freq_wavelen = old_len / high_freq_factor;
            let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
            if wavelen < high_freq_wavelen {
                inv_freq
            } else if wavelen > low_freq_wavelen {
                inv_freq / factor
            } else {
                let smooth =
                    (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_config_hits_all_llama3_bands() {
        let c = ModelConfig::tiny();
        let plain = Rope::new(&ModelConfig {
            rope_scaling: None,
            ..c.clone()
        });
        let scaled = Rope::new(&c);
        let (mut kept, mut divided, mut mixed) = (0, 0, 0);
        for (p, s) in plain.inv_freq.iter().zip(&scaled.inv_freq) {
            let ratio = p / s;
            if (ratio - 1.0).abs() < 1e-6 {
                kept += 1;
            } else if (ratio - 8.0).abs() < 1e-4 {
                divided += 1;
            } else {
                mixed += 1;
            }
        }
        assert!(
            kept > 0 && divided > 0 && mixed > 0,
            "{kept} {divided} {mixed}"
        );
    }

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let rope = Rope::new(&ModelConfig::tiny());
        let t = rope.tables([0usize, 1234]);
        let orig: Vec<f32> = (0..32).map(|i| (i as f32 * 0.7).sin()).collect();
        let mut x = orig.clone();
        t.apply(0, &mut x, 2);
        assert_eq!(x, orig);
        t.apply(1, &mut x, 2);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        assert_ne!(x, orig);
    }
}
