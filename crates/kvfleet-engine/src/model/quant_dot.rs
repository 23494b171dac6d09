//! Products of GGML block-quantized weights (Q4_0, Q4_1, Q8_0, repacked as
//! [`PackedQuant`]) with activations, for every row count: decode steps, short cached
//! tails and whole prefills.
//!
//! Why not candle's `QMatMul`: it quantizes the activations to 8 bits (as llama.cpp
//! does), which on SmolLM2 Q4_1 moved the logits to a cosine of 0.9978 from the
//! f32-dequantized reference, and it has no SIMD kernel for Q4_1. Why not widening the
//! weights to f32 and running gemm: for one or a few rows that costs more than the
//! product itself, and a row's sums would then depend on how many rows share its step.
//!
//! Each 32-weight block is unpacked in registers to 16-bit integers and multiplied with
//! the activations scaled to 16 bits per block (`_mm256_madd_epi16`), exact in i32 and
//! scaled into f32 once per block. 16 bits keep the logits at a cosine of 1.000000 to
//! the f32 product (tests/gguf_reference.rs), and the weights are read once, packed.
//! Few rows (decode) unpack each block where it is used; many rows (prefill) unpack a
//! group of eight weight rows once into 16-bit columns and broadcast activation pairs
//! against them. Measured against the previous kernels (f32 products for ≤ 64 rows,
//! widening into gemm above), 2 threads, `kvfleet bench model`, alternating: tg128
//! 71–83 against 50–55 tokens/s, pp512 280–300 against 261–280.
//!
//! **Batch invariance.** Every (activation row, weight row) pair is summed by the same
//! sequence of operations, whatever loop shape or tile computed it and however many
//! rows the step has (see [`avx2`]). So a prompt's logits are bit for bit the same
//! whether it was prefilled cold, in one step, or as a short tail after a cached
//! prefix, and greedy output does not change with the cache. (The paged attention
//! kernel keeps the same property.)
//!
//! AVX2+FMA+F16C where the CPU has them (checked at run time), portable f32 code
//! elsewhere; both compute the same sums up to rounding (`tests` pin them against the
//! dequantized product).

use rayon::prelude::*;

use super::packed_quant::{PackedQuant, QuantKind, BLOCK, GROUP};

/// Fewest output rows one parallel task computes: enough work to outweigh the scheduling.
const MIN_ROWS_PER_TASK: usize = 64;

/// Parallel tasks per pool thread: a few, so a thread slowed by a neighbour on a shared
/// machine does not hold the product up, and not many, as each costs a steal and a wake.
const TASKS_PER_THREAD: usize = 4;

/// From this many activation rows on, a product unpacks each group of eight weight rows
/// once into 16-bit columns and runs every row against them ([`avx2`]'s `columns`);
/// below, each block is unpacked where it is used. Both give the same sums.
const COLUMN_MIN_ROWS: usize = 8;

/// `x · Wᵀ` for `x` of `rows × inp` (row-major) and the packed `W` (`out × inp`):
/// `rows × out`, row-major. `None` when `x` does not fit. Each output is computed the
/// same way for any `rows` (see the module docs).
pub(crate) fn quant_product(w: &PackedQuant, x: &[f32], rows: usize) -> Option<Vec<f32>> {
    let (out, inp) = w.dims();
    if x.len() != rows * inp || rows == 0 {
        return None;
    }
    let blocks = inp / BLOCK;
    // Σx per block and row: the Q4_0/Q4_1 offsets multiply it.
    let xsum: Vec<f32> = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
    let simd = simd_available();
    // The SIMD path multiplies 16-bit integers: activations scaled per block.
    let xq = if simd {
        Q16Rows::of(x)
    } else {
        Q16Rows::default()
    };
    let mut y = vec![0.0f32; rows * out];
    let threads = rayon::current_num_threads();
    // Whole groups of eight weight rows per task (the SIMD kernels' width).
    let rows_per_task = out
        .div_ceil(threads * TASKS_PER_THREAD)
        .max(MIN_ROWS_PER_TASK)
        .next_multiple_of(GROUP);
    let tasks = out.div_ceil(rows_per_task);
    let dst = OutPtr(y.as_mut_ptr());
    let work = |task: usize| {
        let o0 = task * rows_per_task;
        let o1 = (o0 + rows_per_task).min(out);
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked by `simd_available`);
            // `xq` is `rows × blocks·32` values with `rows × blocks` scales and `xsum`
            // `rows × blocks` sums (checked above); `y` is `rows × out` and this task
            // alone writes its columns `o0..o1`.
            unsafe { avx2::product(w, &xq, &xsum, rows, o0..o1, dst.get()) };
            return;
        }
        for r in 0..rows {
            let xr = &x[r * inp..(r + 1) * inp];
            let sr = &xsum[r * blocks..(r + 1) * blocks];
            for o in o0..o1 {
                let v = portable_row_dot(w, o, xr, sr);
                // SAFETY: `r · out + o` is inside `y`, and only this task writes column `o`.
                unsafe { *dst.get().add(r * out + o) = v };
            }
        }
    };
    if out * inp * rows >= 1 << 16 && threads > 1 && tasks > 1 {
        (0..tasks).into_par_iter().for_each(work);
    } else {
        (0..tasks).for_each(work);
    }
    Some(y)
}

/// The product's output, written by every task at once, each in its own columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (their own output columns), and the buffer
// outlives the parallel loop that uses the pointer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the field).
    fn get(self) -> *mut f32 {
        self.0
    }
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

/// Weight row `o` times one activation row in f32, blocks in order (the same sums for
/// any number of rows, as the SIMD path).
fn portable_row_dot(w: &PackedQuant, o: usize, x: &[f32], xsum: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, (xb, s)) in x.chunks_exact(BLOCK).zip(xsum).enumerate() {
        let (d, m, qs) = w.block_of(o, b);
        match w.kind() {
            QuantKind::Q8_0 => {
                let dot: f32 = qs.iter().zip(xb).map(|(&q, &x)| q as i8 as f32 * x).sum();
                acc += d * dot;
            }
            kind => {
                let mut dot = 0.0f32;
                for (j, &q) in qs.iter().enumerate() {
                    dot += (q & 0x0f) as f32 * xb[j] + (q >> 4) as f32 * xb[j + 16];
                }
                acc += match kind {
                    QuantKind::Q4_1 => d * dot + m * s,
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
    //! The AVX2 kernels. Two loop shapes, one arithmetic: for each (activation row,
    //! weight row) pair and each block `b`, the block's integer dot product `i_b` (exact
    //! in i32: |w| ≤ 128, |x| ≤ 32,767, 32 products) and then
    //!
    //! ```text
    //! acc = fma(f32(i_b), d_b · s_b, acc)      (d: weight scale, s: activation scale)
    //! off = off + shift_b · Σx_b               (Q4_0 and Q4_1 only)
    //! ```
    //!
    //! in block order, the result being `acc + off`. A packed group's eight rows share a
    //! vector, one per lane, so each lane runs exactly that sequence whichever shape
    //! computed it: the product is batch-invariant.

    use super::{PackedQuant, Q16Rows, QuantKind, BLOCK, COLUMN_MIN_ROWS, GROUP};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// [`QuantKind`]s as const parameters.
    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q8_0: u8 = 2;

    /// Activation rows per pass of the column kernel (its accumulators fill the
    /// registers).
    const ROWS_PER_TILE: usize = 4;

    /// Output columns `cols` of `y = x · Wᵀ` (`y` is `rows × out`, row-major).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `x` must hold `rows × blocks·32` values
    /// with `rows × blocks` scales, `xsum` `rows × blocks` sums, and `y` `rows × out`
    /// floats, none of columns `cols` (within `0..out`) written by anyone else meanwhile.
    pub(super) unsafe fn product(
        w: &PackedQuant,
        x: &Q16Rows,
        xsum: &[f32],
        rows: usize,
        cols: Range<usize>,
        y: *mut f32,
    ) {
        let kind = w.kind();
        let a = Args {
            data: w.bytes().as_ptr(),
            group_block: GROUP * kind.block_bytes(),
            xq: x.q.as_ptr(),
            xs: x.scale.as_ptr(),
            xsum: xsum.as_ptr(),
            blocks: w.blocks(),
            rows,
            y,
            out: w.dims().0,
        };
        match kind {
            QuantKind::Q4_0 => product_of::<Q4_0>(&a, cols),
            QuantKind::Q4_1 => product_of::<Q4_1>(&a, cols),
            QuantKind::Q8_0 => product_of::<Q8_0>(&a, cols),
        }
    }

    /// [`product`]'s operands as raw pointers (checked by its caller).
    struct Args {
        data: *const u8,
        group_block: usize,
        xq: *const i16,
        xs: *const f32,
        xsum: *const f32,
        blocks: usize,
        rows: usize,
        y: *mut f32,
        out: usize,
    }

    /// The [`QuantKind`] of a const parameter (its layout sizes fold to constants).
    const fn kind<const KIND: u8>() -> QuantKind {
        match KIND {
            Q4_0 => QuantKind::Q4_0,
            Q4_1 => QuantKind::Q4_1,
            _ => QuantKind::Q8_0,
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn product_of<const KIND: u8>(a: &Args, cols: Range<usize>) {
        let columns_shape = a.rows >= COLUMN_MIN_ROWS;
        // The group's weights unpacked into columns: pair `j` of block `b` of every row.
        let mut columns = if columns_shape {
            vec![_mm256_setzero_si256(); a.blocks * BLOCK / 2]
        } else {
            Vec::new()
        };
        // Columns are whole groups: tasks start on group boundaries.
        let mut o = cols.start;
        while o < cols.end {
            let valid = (cols.end - o).min(GROUP);
            let group = a.data.add(o / GROUP * a.blocks * a.group_block);
            if columns_shape {
                unpack_columns::<KIND>(a, group, &mut columns);
                let mut r = 0;
                while r < a.rows {
                    let n = (a.rows - r).min(ROWS_PER_TILE);
                    match n {
                        1 => column_tile::<1, KIND>(a, group, &columns, r, o, valid),
                        2 => column_tile::<2, KIND>(a, group, &columns, r, o, valid),
                        3 => column_tile::<3, KIND>(a, group, &columns, r, o, valid),
                        _ => column_tile::<4, KIND>(a, group, &columns, r, o, valid),
                    }
                    r += n;
                }
            } else {
                for r in 0..a.rows {
                    row_group::<KIND>(a, group, r, o, valid);
                }
            }
            o += GROUP;
        }
    }

    /// A group-block's scales and offsets per unit of Σx, one lane per row.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales<const KIND: u8>(gb: *const u8) -> (__m256, __m256) {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i));
        let shift = match KIND {
            Q4_1 => _mm256_cvtph_ps(_mm_loadu_si128(gb.add(2 * GROUP) as *const __m128i)),
            Q4_0 => _mm256_mul_ps(_mm256_set1_ps(-8.0), d),
            _ => _mm256_setzero_ps(),
        };
        (d, shift)
    }

    /// Row `m`'s quants in the group-block at `gb` as 32 i16 weights: 0..16 and 16..32
    /// (Q4_x: the nibbles; the offset is applied through Σx).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack<const KIND: u8>(gb: *const u8, m: usize) -> (__m256i, __m256i) {
        let q = gb.add(kind::<KIND>().header_bytes() + m * kind::<KIND>().quant_bytes());
        match KIND {
            Q8_0 => (
                _mm256_cvtepi8_epi16(_mm_loadu_si128(q as *const __m128i)),
                _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(16) as *const __m128i)),
            ),
            _ => {
                let qs = _mm_loadu_si128(q as *const __m128i);
                let mask = _mm_set1_epi8(0x0f);
                (
                    _mm256_cvtepu8_epi16(_mm_and_si128(qs, mask)),
                    _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(qs, 4), mask)),
                )
            }
        }
    }

    /// One block step of a lane: `acc = fma(f32(i), d·s, acc)`, `off = off + shift·Σx`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step<const KIND: u8>(
        dot: __m256i,
        (d, shift): (__m256, __m256),
        s: f32,
        sum: f32,
        acc: &mut __m256,
        off: &mut __m256,
    ) {
        let scale = _mm256_mul_ps(d, _mm256_set1_ps(s));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
        if KIND != Q8_0 {
            *off = _mm256_add_ps(*off, _mm256_mul_ps(shift, _mm256_set1_ps(sum)));
        }
    }

    /// Writes a lane per weight row: `acc + off` into row `r`, columns `o..o + valid`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store<const KIND: u8>(
        a: &Args,
        acc: __m256,
        off: __m256,
        r: usize,
        o: usize,
        valid: usize,
    ) {
        let v = if KIND != Q8_0 {
            _mm256_add_ps(acc, off)
        } else {
            acc
        };
        let dst = a.y.add(r * a.out + o);
        if valid == GROUP {
            _mm256_storeu_ps(dst, v);
        } else {
            let mut lanes = [0.0f32; GROUP];
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst, valid);
        }
    }

    /// Few activation rows: row `r` against the group at `group`, each block unpacked
    /// where it is used and the eight rows' block sums gathered into lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_group<const KIND: u8>(
        a: &Args,
        group: *const u8,
        r: usize,
        o: usize,
        valid: usize,
    ) {
        let xq = a.xq.add(r * a.blocks * BLOCK);
        let (xs, xsum) = (a.xs.add(r * a.blocks), a.xsum.add(r * a.blocks));
        let mut acc = _mm256_setzero_ps();
        let mut off = _mm256_setzero_ps();
        for b in 0..a.blocks {
            let gb = group.add(b * a.group_block);
            let xlo = _mm256_loadu_si256(xq.add(b * BLOCK) as *const __m256i);
            let xhi = _mm256_loadu_si256(xq.add(b * BLOCK + 16) as *const __m256i);
            let mut p = [_mm256_setzero_si256(); GROUP];
            for (m, pm) in p.iter_mut().enumerate() {
                let (lo, hi) = unpack::<KIND>(gb, m);
                *pm = _mm256_add_epi32(_mm256_madd_epi16(lo, xlo), _mm256_madd_epi16(hi, xhi));
            }
            // Eight vectors of partial sums into one of whole sums, lane m = row m
            // (integer adds: exact in any order).
            let t0 = _mm256_hadd_epi32(p[0], p[1]);
            let t1 = _mm256_hadd_epi32(p[2], p[3]);
            let t2 = _mm256_hadd_epi32(p[4], p[5]);
            let t3 = _mm256_hadd_epi32(p[6], p[7]);
            let u0 = _mm256_hadd_epi32(t0, t1);
            let u1 = _mm256_hadd_epi32(t2, t3);
            let dot = _mm256_add_epi32(
                _mm256_permute2x128_si256(u0, u1, 0x20),
                _mm256_permute2x128_si256(u0, u1, 0x31),
            );
            step::<KIND>(
                dot,
                scales::<KIND>(gb),
                *xs.add(b),
                *xsum.add(b),
                &mut acc,
                &mut off,
            );
        }
        store::<KIND>(a, acc, off, r, o, valid);
    }

    /// The group's rows unpacked into `columns`: entry `b·16 + j` holds, in lane m,
    /// weights `2j` and `2j + 1` of block `b` of row m.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_columns<const KIND: u8>(a: &Args, group: *const u8, columns: &mut [__m256i]) {
        let mut pairs = [[0i32; BLOCK / 2]; GROUP];
        for b in 0..a.blocks {
            let gb = group.add(b * a.group_block);
            for (m, row) in pairs.iter_mut().enumerate() {
                let (lo, hi) = unpack::<KIND>(gb, m);
                _mm256_storeu_si256(row.as_mut_ptr() as *mut __m256i, lo);
                _mm256_storeu_si256(row.as_mut_ptr().add(8) as *mut __m256i, hi);
            }
            for j in 0..BLOCK / 2 {
                columns[b * BLOCK / 2 + j] = _mm256_setr_epi32(
                    pairs[0][j],
                    pairs[1][j],
                    pairs[2][j],
                    pairs[3][j],
                    pairs[4][j],
                    pairs[5][j],
                    pairs[6][j],
                    pairs[7][j],
                );
            }
        }
    }

    /// Many activation rows: `R` of them, from row `r0`, against the group's unpacked
    /// `columns`, each activation pair broadcast against eight rows' weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn column_tile<const R: usize, const KIND: u8>(
        a: &Args,
        group: *const u8,
        columns: &[__m256i],
        r0: usize,
        o: usize,
        valid: usize,
    ) {
        let mut xq = [a.xq; R];
        for (r, p) in xq.iter_mut().enumerate() {
            *p = a.xq.add((r0 + r) * a.blocks * BLOCK);
        }
        let mut acc = [_mm256_setzero_ps(); R];
        let mut off = [_mm256_setzero_ps(); R];
        for b in 0..a.blocks {
            let mut dot = [_mm256_setzero_si256(); R];
            for j in 0..BLOCK / 2 {
                let wv = columns[b * BLOCK / 2 + j];
                for r in 0..R {
                    let pair = (xq[r].add(b * BLOCK + 2 * j) as *const i32).read_unaligned();
                    dot[r] =
                        _mm256_add_epi32(dot[r], _mm256_madd_epi16(wv, _mm256_set1_epi32(pair)));
                }
            }
            let sc = scales::<KIND>(group.add(b * a.group_block));
            for r in 0..R {
                let at = (r0 + r) * a.blocks + b;
                step::<KIND>(
                    dot[r],
                    sc,
                    *a.xs.add(at),
                    *a.xsum.add(at),
                    &mut acc[r],
                    &mut off[r],
                );
            }
        }
        for r in 0..R {
            store::<KIND>(a, acc[r], off[r], r0 + r, o, valid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::packed_quant::fixture;
    use candle_core::quantized::GgmlDType;

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

    /// `out × inp` seeded weights of `dtype`, packed, and dequantized.
    fn weights(dtype: GgmlDType, out: usize, inp: usize, seed: u64) -> (PackedQuant, Vec<f32>) {
        let (packed, _, deq) = fixture::quantized(seeded(out * inp, seed), out, inp, dtype);
        (packed, deq)
    }

    const KINDS: [GgmlDType; 3] = [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0];

    /// Each kind, both loop shapes and the portable path, against the product with the
    /// dequantized weights.
    #[test]
    fn quantized_products_match_the_dequantized_weights() {
        // 71 rows: the last group of eight is short.
        let (out, inp) = (71, 96);
        for dtype in KINDS {
            let (w, deq) = weights(dtype, out, inp, 7);
            for rows in [1, 3, 6, 37] {
                let x = seeded(rows * inp, 11 + rows as u64);
                let got = quant_product(&w, &x, rows).unwrap();
                let xsum: Vec<f32> = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
                for r in 0..rows {
                    for o in 0..out {
                        let want: f32 = (0..inp).map(|k| x[r * inp + k] * deq[o * inp + k]).sum();
                        let g = got[r * out + o];
                        assert!(
                            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{dtype:?} rows {rows} [{r},{o}]: {g} vs {want}"
                        );
                        let blocks = inp / BLOCK;
                        let p = portable_row_dot(
                            &w,
                            o,
                            &x[r * inp..(r + 1) * inp],
                            &xsum[r * blocks..(r + 1) * blocks],
                        );
                        assert!(
                            (p - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{dtype:?} {o}"
                        );
                    }
                }
            }
        }
    }

    /// A row's outputs are the same bits whatever other rows share its product: the
    /// property that keeps a cached prompt's tail and its cold prefill in agreement.
    #[test]
    fn each_rows_product_is_the_same_bits_for_any_row_count() {
        // 75 weight rows: the last group is short; 70 activation rows: column tiles of
        // four end on two, and slices below COLUMN_MIN_ROWS take the other loop shape.
        let (out, inp) = (75, 128);
        for dtype in KINDS {
            let (w, _) = weights(dtype, out, inp, 3);
            let rows = 70;
            let x = seeded(rows * inp, 19);
            let all = quant_product(&w, &x, rows).unwrap();
            for (lo, hi) in [(0, 1), (5, 6), (69, 70), (3, 10), (30, 67), (60, 63)] {
                let part = quant_product(&w, &x[lo * inp..hi * inp], hi - lo).unwrap();
                for r in lo..hi {
                    for o in 0..out {
                        let (a, b) = (all[r * out + o], part[(r - lo) * out + o]);
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{dtype:?} row {r} of {lo}..{hi}, out {o}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn activations_that_do_not_fit_are_refused() {
        let (w, _) = weights(GgmlDType::Q4_1, 2, 32, 1);
        assert!(quant_product(&w, &[0.0; 32], 1).is_some());
        assert!(quant_product(&w, &[0.0; 31], 1).is_none());
        assert!(quant_product(&w, &[0.0; 64], 1).is_none());
        assert!(quant_product(&w, &[], 0).is_none());
    }
}
