//! Products of GGML block-quantized weights (Q4_0, Q4_1, Q8_0) with activations, for the
//! few rows of a decode step.
//!
//! Why not candle's `QMatMul`: it quantizes the activations to 8 bits (as llama.cpp
//! does), which on SmolLM2 Q4_1 moved the logits to a cosine of 0.9978 from the
//! f32-dequantized reference, and it has no SIMD kernel for Q4_1. Why not the widening
//! path used for prefill: it writes every weight out as f32 once per product, which for
//! one or a few rows costs more than the product itself.
//!
//! Here each 32-weight block is unpacked in registers to 16-bit integers and multiplied
//! with the activations scaled to 16 bits per block (`_mm256_madd_epi16`), exact in i32
//! and scaled into f32 once per block. 16 bits keep the logits at a cosine of 1.000000
//! to the f32 product (tests/gguf_reference.rs), and the weights are read once, packed.
//! Measured on one thread against the previous kernel, which widened every weight to
//! f32: 1.7–1.9× on SmolLM2's Q4_1 layers, 1.3–2× on its 49,152 × 576 Q8_0 output layer.
//!
//! AVX2+FMA where the CPU has them (checked at run time), portable f32 code elsewhere;
//! both compute the same sums up to rounding (`tests` pin them against the dequantized
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
    // The SIMD path multiplies 16-bit integers: activations scaled per block.
    let xq = if simd {
        Q16Rows::of(x)
    } else {
        Q16Rows::default()
    };
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
        #[cfg(target_arch = "x86_64")]
        if simd && rows == 1 {
            // One activation row (a decode step): two weight rows per pass share its loads.
            let first = task * rows_per_task;
            let w = &data[first * row_bytes..(first + chunk.len()) * row_bytes];
            // SAFETY: as below; `w` holds `chunk.len()` rows of `blocks` blocks.
            unsafe { avx2::one_row_dot(kind, w, row_bytes, &xq, &xsum, blocks, chunk) };
            return;
        }
        for (i, dst) in chunk.chunks_exact_mut(rows).enumerate() {
            let o = task * rows_per_task + i;
            let w = &data[o * row_bytes..(o + 1) * row_bytes];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the CPU has AVX2, FMA and F16C (checked by `simd_available`);
                // `w` holds `blocks` blocks, `xq` is `rows × blocks·32` values with
                // `rows × blocks` scales, `xsum` `rows × blocks` (checked above), and
                // `dst` has `rows` entries.
                unsafe { avx2::rows_dot(kind, w, &xq, &xsum, blocks, dst) };
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

/// Activation rows as 16-bit integers, one scale per 32-value block: `x ≈ scale·q`.
///
/// Why 16 bits: `_mm256_madd_epi16` multiplies and pairs sixteen weights at once, half
/// the instructions of widening every weight to f32, and 16 bits keep the activations'
/// error at 1/65,534 of each block's largest value, where llama.cpp's 8 bits moved
/// SmolLM2's logits off the reference (see the module docs).
#[derive(Default)]
struct Q16Rows {
    q: Vec<i16>,
    scale: Vec<f32>,
}

impl Q16Rows {
    /// `x` (whole blocks of 32) in 16-bit form.
    fn of(x: &[f32]) -> Self {
        let mut q = vec![0i16; x.len()];
        let mut scale = Vec::with_capacity(x.len() / BLOCK);
        for (xb, qb) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)) {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if amax == 0.0 || !amax.is_finite() {
                // Zeros stay zero; a non-finite block keeps its poison in the scale so the
                // product is NaN, as the f32 product would be.
                scale.push(if amax == 0.0 { 0.0 } else { f32::NAN });
                continue;
            }
            let s = amax / i16::MAX as f32;
            let inv = 1.0 / s;
            for (v, o) in xb.iter().zip(qb.iter_mut()) {
                // Rounds half away from zero (`as` truncates), without a libm call.
                let t = v * inv;
                *o = (t + 0.5f32.copysign(t)) as i16;
            }
            scale.push(s);
        }
        Self { q, scale }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q16Rows, QuantKind, BLOCK};
    use std::arch::x86_64::*;

    /// One weight row `w` times every activation row of `x` (`rows × blocks·32` in 16-bit
    /// form, f32 block sums in `xsum`) into `dst` (`rows`), four activation rows per pass
    /// so that each block is unpacked once per four rows.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `w` must hold `blocks` blocks of `kind`,
    /// `x` `dst.len() × blocks·32` values with `dst.len() × blocks` scales, and `xsum`
    /// `dst.len() × blocks`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_dot(
        kind: QuantKind,
        w: &[u8],
        x: &Q16Rows,
        xsum: &[f32],
        blocks: usize,
        dst: &mut [f32],
    ) {
        let mut r = 0;
        while r < dst.len() {
            let n = (dst.len() - r).min(4);
            let rows = Rows {
                q: x.q.as_ptr().add(r * blocks * BLOCK),
                scale: x.scale.as_ptr().add(r * blocks),
                sum: xsum.as_ptr().add(r * blocks),
            };
            let out = &mut dst[r..r + n];
            // One instance per kind and row count: no branch on either inside the loop.
            macro_rules! by_rows {
                ($k:expr) => {
                    match n {
                        1 => group::<1, 2, { $k }>(w, rows, blocks, out),
                        2 => group::<2, 1, { $k }>(w, rows, blocks, out),
                        3 => group::<3, 1, { $k }>(w, rows, blocks, out),
                        _ => group::<4, 1, { $k }>(w, rows, blocks, out),
                    }
                };
            }
            match kind {
                QuantKind::Q4_0 => by_rows!(Q4_0),
                QuantKind::Q4_1 => by_rows!(Q4_1),
                QuantKind::Q8_0 => by_rows!(Q8_0),
            }
            r += n;
        }
    }

    /// Weight rows `w` (`dst.len()` rows of `row_bytes`) times one activation row `x`
    /// into `dst`, two weight rows per pass so that they share the activations' loads
    /// and scales.
    ///
    /// # Safety
    /// As [`rows_dot`], with `w` holding `dst.len()` rows of `blocks` blocks of `kind`
    /// and `x` one row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn one_row_dot(
        kind: QuantKind,
        w: &[u8],
        row_bytes: usize,
        x: &Q16Rows,
        xsum: &[f32],
        blocks: usize,
        dst: &mut [f32],
    ) {
        let rows = Rows {
            q: x.q.as_ptr(),
            scale: x.scale.as_ptr(),
            sum: xsum.as_ptr(),
        };
        if kind == QuantKind::Q8_0 {
            // Measured (one thread, 49,152 × 576): pairs of Q8_0 rows ran at a third of the
            // speed of one row at a time, stalled on the second row's loads.
            for (o, y) in dst.chunks_exact_mut(1).enumerate() {
                rows_dot(
                    kind,
                    &w[o * row_bytes..(o + 1) * row_bytes],
                    x,
                    xsum,
                    blocks,
                    y,
                );
            }
            return;
        }
        let pairs = dst.len() / 2;
        for p in 0..pairs {
            let wp = w.as_ptr().add(2 * p * row_bytes);
            let out = &mut dst[2 * p..2 * p + 2];
            match kind {
                QuantKind::Q4_0 => weight_pair::<Q4_0>(wp, row_bytes, rows, blocks, out),
                QuantKind::Q4_1 => weight_pair::<Q4_1>(wp, row_bytes, rows, blocks, out),
                QuantKind::Q8_0 => unreachable!("Q8_0 takes rows_dot above"),
            }
        }
        if dst.len() % 2 == 1 {
            let last = dst.len() - 1;
            rows_dot(
                kind,
                &w[last * row_bytes..],
                x,
                xsum,
                blocks,
                &mut dst[last..],
            );
        }
    }

    /// The block at `blk` as 32 i16 weights (0..16, 16..32), its scale and its offset
    /// per unit of Σx.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack<const KIND: u8>(blk: *const u8) -> (__m256i, __m256i, f32, f32) {
        let d = half(blk);
        match KIND {
            Q8_0 => (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(2) as *const __m128i)),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(18) as *const __m128i)),
                d,
                0.0,
            ),
            _ => {
                let at = if KIND == Q4_1 { 4 } else { 2 };
                let qs = _mm_loadu_si128(blk.add(at) as *const __m128i);
                let mask = _mm_set1_epi8(0x0f);
                let shift = if KIND == Q4_1 {
                    half(blk.add(2))
                } else {
                    -8.0 * d
                };
                (
                    _mm256_cvtepu8_epi16(_mm_and_si128(qs, mask)),
                    _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)),
                    d,
                    shift,
                )
            }
        }
    }

    /// Two weight rows (at `w` and `w + row_bytes`) against one activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weight_pair<const KIND: u8>(
        w: *const u8,
        row_bytes: usize,
        x: Rows,
        blocks: usize,
        out: &mut [f32],
    ) {
        let bb = row_bytes / blocks;
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut offset = [0.0f32; 2];
        for b in 0..blocks {
            let xb = x.q.add(b * BLOCK);
            let xlo = _mm256_loadu_si256(xb as *const __m256i);
            let xhi = _mm256_loadu_si256(xb.add(16) as *const __m256i);
            let (sx, sum) = (*x.scale.add(b), *x.sum.add(b));
            for (m, a) in acc.iter_mut().enumerate() {
                let (lo, hi, d, shift) = unpack::<KIND>(w.add(m * row_bytes + b * bb));
                let dot = _mm256_add_epi32(_mm256_madd_epi16(lo, xlo), _mm256_madd_epi16(hi, xhi));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * sx), *a);
                offset[m] += shift * sum;
            }
        }
        for m in 0..2 {
            out[m] = hsum(acc[m]) + offset[m];
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
    }

    /// [`QuantKind`]s as const parameters of [`group`].
    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// Where a group's activation rows start: values, block scales, block sums.
    #[derive(Clone, Copy)]
    struct Rows {
        q: *const i16,
        scale: *const f32,
        sum: *const f32,
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half(b: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*b, *b.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// `N` activation rows against one weight row. Each block's integer dot product is
    /// exact in i32 (|w| ≤ 128, |x| ≤ 32,767, four products per lane) and is scaled into
    /// f32 once per block, into `K` accumulators per row: an FMA's latency is four of
    /// its issue slots, so a lone row needs two chains to keep the units busy.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const N: usize, const K: usize, const KIND: u8>(
        w: &[u8],
        x: Rows,
        blocks: usize,
        out: &mut [f32],
    ) {
        let kind = match KIND {
            Q4_0 => QuantKind::Q4_0,
            Q4_1 => QuantKind::Q4_1,
            _ => QuantKind::Q8_0,
        };
        let bb = kind.block_bytes();
        let mut acc = [[_mm256_setzero_ps(); K]; N];
        // The offsets' sums in `K` chains too: one scalar chain would be the loop's
        // longest dependency.
        let mut offset = [[0.0f32; K]; N];
        let wp = w.as_ptr();
        let mask = _mm_set1_epi8(0x0f);
        // Blocks `K` at a time, block `b + k` into accumulator `k` (a constant once the
        // inner loop is unrolled, so the accumulators stay in registers).
        let mut b0 = 0;
        while b0 < blocks {
            for k in 0..K {
                let b = b0 + k;
                if b >= blocks {
                    break;
                }
                let blk = wp.add(b * bb);
                let d = half(blk);
                // The block's 32 weights as i16: weights 0..16 in `lo`, 16..32 in `hi`.
                let (lo, hi) = match kind {
                    QuantKind::Q8_0 => (
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(2) as *const __m128i)),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(18) as *const __m128i)),
                    ),
                    QuantKind::Q4_0 | QuantKind::Q4_1 => {
                        let at = if kind == QuantKind::Q4_1 { 4 } else { 2 };
                        let qs = _mm_loadu_si128(blk.add(at) as *const __m128i);
                        (
                            _mm256_cvtepu8_epi16(_mm_and_si128(qs, mask)),
                            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)),
                        )
                    }
                };
                let shift = match kind {
                    QuantKind::Q4_1 => half(blk.add(2)),
                    QuantKind::Q4_0 => -8.0 * d,
                    QuantKind::Q8_0 => 0.0,
                };
                for r in 0..N {
                    let at = r * blocks + b;
                    let xb = x.q.add(at * BLOCK);
                    let dot = _mm256_add_epi32(
                        _mm256_madd_epi16(lo, _mm256_loadu_si256(xb as *const __m256i)),
                        _mm256_madd_epi16(hi, _mm256_loadu_si256(xb.add(16) as *const __m256i)),
                    );
                    let scale = _mm256_set1_ps(d * *x.scale.add(at));
                    acc[r][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][k]);
                    offset[r][k] += shift * *x.sum.add(at);
                }
            }
            b0 += K;
        }
        for r in 0..N {
            let mut v = acc[r][0];
            for a in &acc[r][1..] {
                v = _mm256_add_ps(v, *a);
            }
            let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
            let one = _mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1));
            out[r] = _mm_cvtss_f32(one) + offset[r].iter().sum::<f32>();
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
        // 71 rows: the two-row pass of a decode step ends on a lone row.
        let (out, inp) = (71, 96);
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
