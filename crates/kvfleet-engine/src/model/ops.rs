//! Small numeric kernels on `f32` slices, written so the compiler vectorizes them.
//!
//! Every kernel reduces in a fixed order that depends only on the length of its input,
//! never on what else is in the batch: a row's result is then the same whether it is
//! computed alone or with others, which the prefix-cache equivalence relies on.

/// Dot product with eight independent accumulators (vectorizes; fixed reduction order).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += x`, elementwise.
#[inline]
pub(crate) fn add_assign(y: &mut [f32], x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += xi;
    }
}

/// RMSNorm of each `width`-wide row of `x` into `out`: `x / sqrt(mean(x²) + eps) * w`,
/// in f32 like Hugging Face's `LlamaRMSNorm`.
pub(crate) fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let width = w.len();
    for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let inv = 1.0 / (dot(xr, xr) / width as f32 + eps).sqrt();
        for ((o, xi), wi) in or.iter_mut().zip(xr).zip(w) {
            *o = wi * (xi * inv);
        }
    }
}

/// In-place RMSNorm of each `w.len()`-wide row.
pub(crate) fn rms_norm_rows_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let width = w.len();
    for xr in x.chunks_exact_mut(width) {
        let inv = 1.0 / (dot(xr, xr) / width as f32 + eps).sqrt();
        for (xi, wi) in xr.iter_mut().zip(w) {
            *xi = wi * (*xi * inv);
        }
    }
}

/// `exp(x)` to about one ulp (Cephes `expf` polynomial), branch-free so loops over it
/// vectorize; `std`'s `exp` is a libm call per element and dominates softmax otherwise.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.33, 88.37);
    let t = x * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let r = x - n * C1 - n * C2;
    let mut y = 1.987_569_1e-4_f32;
    y = y * r + 1.398_199_9e-3;
    y = y * r + 8.333_452e-3;
    y = y * r + 4.166_579_6e-2;
    y = y * r + 0.166_666_65;
    y = y * r + 0.5;
    y = y * (r * r) + r + 1.0;
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    y * f32::from_bits(((ni + 127) << 23) as u32)
}

/// SwiGLU activation: reads rows `[gate | up]` of width `2 * inter` and writes
/// `silu(gate) * up` rows of width `inter`.
pub(crate) fn silu_mul_rows(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    for (gu, o) in gate_up
        .chunks_exact(2 * inter)
        .zip(out.chunks_exact_mut(inter))
    {
        let (g, u) = gu.split_at(inter);
        for ((oi, gi), ui) in o.iter_mut().zip(g).zip(u) {
            *oi = gi / (1.0 + fast_exp(-gi)) * ui;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let e = f64::from(x).exp();
            let rel = ((f64::from(fast_exp(x)) - e) / e).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(fast_exp(0.0), 1.0);
        assert!(fast_exp(-1000.0) < 1e-37);
        assert!(fast_exp(1000.0).is_finite());
    }

    #[test]
    fn dot_matches_naive() {
        for n in [0usize, 1, 7, 8, 9, 16, 63, 64, 130] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
            assert!((f64::from(dot(&a, &b)) - naive).abs() < 1e-5);
        }
    }
}
