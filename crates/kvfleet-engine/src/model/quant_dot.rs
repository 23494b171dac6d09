//! Products of GGML block-quantized weights (Q4_0, Q4_1, Q8_0) with f32 activations, for
//! the few rows of a decode step.
//!
//! Why not candle's `QMatMul`: it quantizes the activations to 8 bits (as llama.cpp
//! does), which on SmolLM2 Q4_1 moved the logits to a cosine of 0.9978 from the
//! f32-dequantized reference, and it has no SIMD kernel for Q4_1. Why not the widening
//! path used for prefill: it writes every weight out as f32 once per product, which for
//! one or a few rows costs more than the product itself. Here each 32-weight block is
//! unpacked in registers and multiplied with f32 activations, so precision is that of
//! the dequantized weights and the weights are read once, in their packed form.
//!
//! AVX2+FMA where the CPU has them (checked at run time), portable code elsewhere; both
//! compute the same sums up to f32 rounding (`tests` pin them against the dequantized
//! product).

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

/// Weights per GGML block of the types handled here.
const BLOCK: usize = 32;

/// Fewest output rows one parallel task computes: enough work to outweigh the scheduling.
const MIN_ROWS_PER_TASK: usize = 64;

/// Parallel tasks per pool thread: a few, so a thread slowed by a neighbour on a shared
/// machine does not hold the product up, and not many, as each costs a steal and a wake.
const TASKS_PER_THREAD: usize = 4;

/// The block types handled here, with their byte sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QuantKind {
    /// `{d: f16, qs: [u8; 16]}`: `w = d·(q − 8)`, q a nibble.
    Q4_0,
    /// `{d: f16, m: f16, qs: [u8; 16]}`: `w = d·q + m`.
    Q4_1,
    /// `{d: f16, qs: [i8; 32]}`: `w = d·q`.
    Q8_0,
}

impl QuantKind {
    /// The kind of a GGML dtype, if it is one handled here.
    pub(crate) fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            _ => None,
        }
    }

    fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }
}

/// `x · Wᵀ` for `x` of `rows × inp` (row-major) and `W` of `out × inp` stored as `data`
/// (GGML blocks, row after row): `rows × out`, row-major. `None` when the shapes do not
/// fit the data (the caller then takes its general path).
pub(crate) fn quant_product(
    kind: QuantKind,
    data: &[u8],
    out: usize,
    inp: usize,
    x: &[f32],
    rows: usize,
) -> Option<Vec<f32>> {
    if !inp.is_multiple_of(BLOCK) || x.len() != rows * inp || rows == 0 {
        return None;
    }
    let row_bytes = inp / BLOCK * kind.block_bytes();
    if data.len() != out * row_bytes {
        return None;
    }
    // Σx per block and row: the Q4_0/Q4_1 offsets multiply it.
    let xsum: Vec<f32> = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
    let simd = simd_available();
    // yt is `out × rows` so that each task writes one contiguous stretch.
    let mut yt = vec![0.0f32; out * rows];
    let blocks = inp / BLOCK;
    let threads = rayon::current_num_threads();
    let rows_per_task = out
        .div_ceil(threads * TASKS_PER_THREAD)
        .max(MIN_ROWS_PER_TASK);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    let work = |(task, chunk): (usize, &mut [f32])| {
        for (i, dst) in chunk.chunks_exact_mut(rows).enumerate() {
            let o = task * rows_per_task + i;
            let w = &data[o * row_bytes..(o + 1) * row_bytes];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked by `simd_available`);
                // `w` holds `blocks` blocks, `x` is `rows × blocks·32` and `xsum`
                // `rows × blocks` (checked above), and `dst` has `rows` entries.
                unsafe { avx2::rows_dot(kind, w, x, &xsum, blocks, dst) };
                continue;
            }
            for (r, y) in dst.iter_mut().enumerate() {
                let xr = &x[r * inp..(r + 1) * inp];
                let sr = &xsum[r * blocks..(r + 1) * blocks];
                *y = portable_row_dot(kind, w, xr, sr);
            }
        }
    };
    if out * inp * rows >= 1 << 16 && threads > 1 {
        yt.par_chunks_mut(rows_per_task * rows)
            .enumerate()
            .for_each(work);
    } else {
        yt.chunks_mut(rows_per_task * rows)
            .enumerate()
            .for_each(work);
    }
    if rows == 1 {
        return Some(yt);
    }
    let mut y = vec![0.0f32; rows * out];
    for (o, col) in yt.chunks_exact(rows).enumerate() {
        for (r, v) in col.iter().enumerate() {
            y[r * out + o] = *v;
        }
    }
    Some(y)
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn portable_row_dot(kind: QuantKind, w: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let bb = kind.block_bytes();
    let mut acc = 0.0f32;
    for ((blk, xb), s) in w.chunks_exact(bb).zip(x.chunks_exact(BLOCK)).zip(xsum) {
        let d = f16_at(blk, 0);
        match kind {
            QuantKind::Q8_0 => {
                let q = &blk[2..34];
                let dot: f32 = q.iter().zip(xb).map(|(&q, &x)| q as i8 as f32 * x).sum();
                acc += d * dot;
            }
            QuantKind::Q4_0 | QuantKind::Q4_1 => {
                let qs = if kind == QuantKind::Q4_1 {
                    &blk[4..20]
                } else {
                    &blk[2..18]
                };
                let mut dot = 0.0f32;
                for (j, &q) in qs.iter().enumerate() {
                    dot += (q & 0x0f) as f32 * xb[j] + (q >> 4) as f32 * xb[j + 16];
                }
                acc += match kind {
                    QuantKind::Q4_1 => d * dot + f16_at(blk, 2) * s,
                    _ => d * (dot - 8.0 * s),
                };
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{QuantKind, BLOCK};
    use std::arch::x86_64::*;

    /// One weight row `w` times every activation row of `x` (`rows × blocks·32`, block
    /// sums in `xsum`) into `dst` (`rows`), four activation rows per pass so that each
    /// block is unpacked once per four rows.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `w` must hold `blocks` blocks of `kind`,
    /// `x` `dst.len() × blocks·32` values and `xsum` `dst.len() × blocks`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_dot(
        kind: QuantKind,
        w: &[u8],
        x: &[f32],
        xsum: &[f32],
        blocks: usize,
        dst: &mut [f32],
    ) {
        let mut r = 0;
        while r < dst.len() {
            let n = (dst.len() - r).min(4);
            let (xs, sums, out) = (
                &x[r * blocks * BLOCK..(r + n) * blocks * BLOCK],
                &xsum[r * blocks..(r + n) * blocks],
                &mut dst[r..r + n],
            );
            match n {
                1 => group::<1, 4>(kind, w, xs, sums, blocks, out),
                2 => group::<2, 2>(kind, w, xs, sums, blocks, out),
                3 => group::<3, 1>(kind, w, xs, sums, blocks, out),
                _ => group::<4, 1>(kind, w, xs, sums, blocks, out),
            }
            r += n;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half(b: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*b, *b.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// `N` activation rows against one weight row, each summed in `K` accumulators:
    /// an FMA's latency is four of its issue slots, so one chain per row would leave a
    /// lone row waiting on its own sum; `N·K` chains keep the units busy.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const N: usize, const K: usize>(
        kind: QuantKind,
        w: &[u8],
        x: &[f32],
        xsum: &[f32],
        blocks: usize,
        out: &mut [f32],
    ) {
        let bb = kind.block_bytes();
        let width = blocks * BLOCK;
        let mut acc = [[_mm256_setzero_ps(); K]; N];
        let mut offset = [0.0f32; N];
        let wp = w.as_ptr();
        let xp = x.as_ptr();
        for b in 0..blocks {
            let blk = wp.add(b * bb);
            let d = half(blk);
            // The block's 32 weights as f32 (times d), in four registers.
            let q = match kind {
                QuantKind::Q8_0 => {
                    let lo = _mm_loadu_si128(blk.add(2) as *const __m128i);
                    let hi = _mm_loadu_si128(blk.add(18) as *const __m128i);
                    [
                        _mm256_cvtepi8_epi32(lo),
                        _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepi8_epi32(hi),
                        _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)),
                    ]
                }
                QuantKind::Q4_0 | QuantKind::Q4_1 => {
                    let at = if kind == QuantKind::Q4_1 { 4 } else { 2 };
                    let qs = _mm_loadu_si128(blk.add(at) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(qs, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                    [
                        _mm256_cvtepu8_epi32(lo),
                        _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepu8_epi32(hi),
                        _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)),
                    ]
                }
            };
            let dv = _mm256_set1_ps(d);
            // (No closure here: closures do not inherit the target features.)
            let qd = [
                _mm256_mul_ps(_mm256_cvtepi32_ps(q[0]), dv),
                _mm256_mul_ps(_mm256_cvtepi32_ps(q[1]), dv),
                _mm256_mul_ps(_mm256_cvtepi32_ps(q[2]), dv),
                _mm256_mul_ps(_mm256_cvtepi32_ps(q[3]), dv),
            ];
            let shift = match kind {
                QuantKind::Q4_1 => half(blk.add(2)),
                QuantKind::Q4_0 => -8.0 * d,
                QuantKind::Q8_0 => 0.0,
            };
            for r in 0..N {
                let xb = xp.add(r * width + b * BLOCK);
                for (j, qj) in qd.iter().enumerate() {
                    let a = &mut acc[r][j % K];
                    *a = _mm256_fmadd_ps(*qj, _mm256_loadu_ps(xb.add(8 * j)), *a);
                }
                offset[r] += shift * *xsum.get_unchecked(r * blocks + b);
            }
        }
        for r in 0..N {
            let mut v = acc[r][0];
            for a in &acc[r][1..] {
                v = _mm256_add_ps(v, *a);
            }
            let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
            let one = _mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1));
            out[r] = _mm_cvtss_f32(one) + offset[r];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    fn seeded(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Each kind, both code paths, against the product with the dequantized weights.
    #[test]
    fn quantized_products_match_the_dequantized_weights() {
        let (out, inp) = (70, 96);
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let kind = QuantKind::of(dtype).unwrap();
            let w = Tensor::from_vec(seeded(out * inp, 7), (out, inp), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let deq: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let data = q.data().unwrap();
            for rows in [1, 3, 6] {
                let x = seeded(rows * inp, 11 + rows as u64);
                let got = quant_product(kind, &data, out, inp, &x, rows).unwrap();
                for r in 0..rows {
                    for o in 0..out {
                        let want: f32 = (0..inp).map(|k| x[r * inp + k] * deq[o * inp + k]).sum();
                        let g = got[r * out + o];
                        assert!(
                            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{dtype:?} rows {rows} [{r},{o}]: {g} vs {want}"
                        );
                    }
                }
                // The portable path gives the same sums.
                let xsum: Vec<f32> = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
                let row_bytes = inp / BLOCK * kind.block_bytes();
                for o in 0..out {
                    let w = &data[o * row_bytes..(o + 1) * row_bytes];
                    let p = portable_row_dot(kind, w, &x[..inp], &xsum[..inp / BLOCK]);
                    assert!(
                        (p - got[o]).abs() <= 1e-4 * (1.0 + p.abs()),
                        "{dtype:?} {o}"
                    );
                }
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_the_data_are_refused() {
        let data = vec![0u8; 20 * 2];
        assert!(quant_product(QuantKind::Q4_1, &data, 2, 32, &[0.0; 32], 1).is_some());
        assert!(quant_product(QuantKind::Q4_1, &data, 3, 32, &[0.0; 32], 1).is_none());
        assert!(quant_product(QuantKind::Q4_1, &data, 2, 32, &[0.0; 31], 1).is_none());
        assert!(quant_product(QuantKind::Q4_1, &data, 1, 40, &[0.0; 40], 1).is_none());
        assert!(QuantKind::of(GgmlDType::Q6K).is_none());
    }
}
