//! Causal grouped-query attention over the paged KV cache, plus the plain reference
//! implementation the paged one is tested against.
//!
//! One tiled kernel serves prefill and decode alike: the step's work is cut into units of
//! (sequence, KV head, tile of up to [`QUERY_TILE`] queries), all of them, across every
//! sequence of the step, run in one parallel pass on rayon's pool (the one candle's
//! matrix products use, so the two never oversubscribe the cores). A unit walks its keys
//! block by block through the block table, reading K and V where they lie in the cache,
//! and keeps a running (online) softmax, so nothing is gathered into contiguous buffers.

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use super::ops::fast_exp;

/// Queries of one sequence per unit of work: bounds the unit's scratch (scores of
/// `group × QUERY_TILE` rows by one key chunk) and gives prefill enough units to spread.
const QUERY_TILE: usize = 16;
/// Keys per inner step: scores of a row for one chunk fill two 8-lane registers.
const KEY_CHUNK: usize = 16;
/// Rows (query × head) per vector register in the Q·Kᵀ product and the softmax.
const LANES: usize = 8;
/// Width of the head-dimension slices the P·V product keeps in registers.
const DIM_CHUNK: usize = 16;
/// Below this many multiply-adds a layer's attention is not worth waking the pool.
const PARALLEL_MIN_WORK: usize = 1 << 17;

/// Attention shape of one model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnGeom {
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) scale: f32,
    /// Mistral's sliding window: a query at `p` sees keys `p - window + 1 ..= p`.
    pub(crate) window: Option<usize>,
}

impl AttnGeom {
    fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    pub(crate) fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub(crate) fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// First key position visible to a query at `pos`.
    fn key_lo(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// One layer of the paged cache, read-only.
#[derive(Clone, Copy)]
pub(crate) struct PagedKv<'a> {
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    pub(crate) block_size: usize,
}

/// The queries of one sequence in this step.
pub(crate) struct AttnQuery<'a> {
    /// The sequence's block table.
    pub(crate) table: &'a [u32],
    /// Rows of the q/k/v buffer holding the queries (consecutive positions).
    pub(crate) rows: Range<usize>,
    /// Position of the first query row.
    pub(crate) first_pos: usize,
}

/// One unit of work: queries `t0..t1` (counted within the sequence's rows) of sequence
/// `seq` for the query heads of KV head `kvh`.
#[derive(Clone, Copy)]
struct Unit {
    seq: usize,
    kvh: usize,
    t0: usize,
    t1: usize,
}

/// Per-thread scratch of the kernel, kept between calls so a step allocates nothing.
/// Rows `r = t · group + head` of a unit are padded to `rp`, a multiple of [`LANES`].
#[derive(Default)]
struct Scratch {
    /// Scaled queries transposed, `head_dim × rp`: rows are the vector lanes.
    qt: Vec<f32>,
    /// Scores, then weights, of the current key chunk, `KEY_CHUNK × rp`.
    s: Vec<f32>,
    /// Running max and sum of each row's softmax, and this chunk's rescale factor.
    m: Vec<f32>,
    l: Vec<f32>,
    alpha: Vec<f32>,
    /// Position of each row's query, and its first visible key (padding rows: none).
    pos: Vec<i32>,
    lo: Vec<i32>,
    /// Unnormalized outputs, `rows × head_dim`.
    o: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Reusable buffers of [`paged_attention`], owned by the caller.
#[derive(Default)]
pub(crate) struct AttnBuffers {
    units: Vec<Unit>,
    /// First output row of each query.
    row0: Vec<usize>,
    /// Unit outputs, each unit's rows contiguous, before they are scattered to `out`.
    staged: Vec<f32>,
}

/// Attention of every query in `queries`, whose keys and values (own positions included)
/// are already in `kv`. Queries are read from the first `q_dim` columns of `qkv` (row
/// stride `qkv_stride`); results are written to `out`, one `q_dim`-wide row per query
/// row, in the order of `queries`.
pub(crate) fn paged_attention(
    geom: &AttnGeom,
    qkv: &[f32],
    qkv_stride: usize,
    queries: &[AttnQuery<'_>],
    kv: PagedKv<'_>,
    bufs: &mut AttnBuffers,
    out: &mut [f32],
) {
    let (g, hd, qd) = (geom.group(), geom.head_dim, geom.q_dim());
    let units = &mut bufs.units;
    units.clear();
    bufs.row0.clear();
    let mut total_work = 0usize;
    let mut rows = 0;
    for (seq, q) in queries.iter().enumerate() {
        let n = q.rows.len();
        bufs.row0.push(rows);
        rows += n;
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + QUERY_TILE).min(n);
            let keys = q.first_pos + t1 - geom.key_lo(q.first_pos + t0);
            total_work += (t1 - t0) * keys * hd * 2 * geom.n_heads;
            for kvh in 0..geom.n_kv_heads {
                units.push(Unit { seq, kvh, t0, t1 });
            }
            t0 = t1;
        }
    }
    debug_assert_eq!(out.len(), rows * qd);
    if units.is_empty() {
        return;
    }
    let staged = &mut bufs.staged;
    staged.resize(rows * qd, 0.0);
    // Each unit owns a contiguous slice of `staged`, in unit order.
    let mut jobs: Vec<(Unit, &mut [f32])> = Vec::with_capacity(units.len());
    let mut rest = &mut staged[..];
    for &u in units.iter() {
        let (dst, tail) = rest.split_at_mut((u.t1 - u.t0) * g * hd);
        jobs.push((u, dst));
        rest = tail;
    }
    let run = |(u, dst): (Unit, &mut [f32])| {
        SCRATCH.with(|s| {
            unit_attention(
                geom,
                qkv,
                qkv_stride,
                &queries[u.seq],
                kv,
                u,
                dst,
                &mut s.borrow_mut(),
            )
        });
    };
    if total_work < PARALLEL_MIN_WORK || rayon::current_num_threads() < 2 || jobs.len() < 2 {
        jobs.into_iter().for_each(run);
    } else {
        jobs.into_par_iter().with_max_len(1).for_each(run);
    }
    // Scatter: unit rows are [t][head in group][dim]; `out` rows are [head][dim].
    let w = g * hd;
    let mut off = 0;
    for u in units.iter() {
        let row0 = bufs.row0[u.seq];
        for t in u.t0..u.t1 {
            let dst = (row0 + t) * qd + u.kvh * w;
            out[dst..dst + w].copy_from_slice(&staged[off..off + w]);
            off += w;
        }
    }
}

/// Multiply-add, fused where the CPU has FMA (selected per call of the kernel).
trait MulAdd {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

struct Plain;
impl MulAdd for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
struct Fused;
#[cfg(target_arch = "x86_64")]
impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// Runs one unit, with AVX2 and FMA where the CPU has them (the build targets baseline
/// x86-64, where the kernel would run at a quarter of the width).
#[allow(clippy::too_many_arguments)]
fn unit_attention(
    geom: &AttnGeom,
    qkv: &[f32],
    qkv_stride: usize,
    q: &AttnQuery<'_>,
    kv: PagedKv<'_>,
    u: Unit,
    dst: &mut [f32],
    s: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features `unit_avx2` is compiled for.
        unsafe { unit_avx2(geom, qkv, qkv_stride, q, kv, u, dst, s) };
        return;
    }
    unit_kernel::<Plain>(geom, qkv, qkv_stride, q, kv, u, dst, s);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn unit_avx2(
    geom: &AttnGeom,
    qkv: &[f32],
    qkv_stride: usize,
    q: &AttnQuery<'_>,
    kv: PagedKv<'_>,
    u: Unit,
    dst: &mut [f32],
    s: &mut Scratch,
) {
    unit_kernel::<Fused>(geom, qkv, qkv_stride, q, kv, u, dst, s);
}

/// The kernel: the unit's rows against its keys, chunk by chunk. Chunks never straddle a
/// block and start at fixed offsets inside it, and every step is per row, so a query's
/// arithmetic does not depend on which other queries share its unit.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn unit_kernel<F: MulAdd>(
    geom: &AttnGeom,
    qkv: &[f32],
    qkv_stride: usize,
    q: &AttnQuery<'_>,
    kv: PagedKv<'_>,
    u: Unit,
    dst: &mut [f32],
    s: &mut Scratch,
) {
    let (g, hd, kvd) = (geom.group(), geom.head_dim, geom.kv_dim());
    let nq = u.t1 - u.t0;
    let rows = nq * g;
    let rp = rows.div_ceil(LANES) * LANES;
    let first = q.first_pos + u.t0;
    let last = q.first_pos + u.t1 - 1;
    s.qt.clear();
    s.qt.resize(hd * rp, 0.0);
    s.pos.clear();
    s.pos.resize(rp, -1);
    s.lo.clear();
    s.lo.resize(rp, 0);
    for t in 0..nq {
        let src = &qkv[(q.rows.start + u.t0 + t) * qkv_stride + u.kvh * g * hd..][..g * hd];
        for hi in 0..g {
            let r = t * g + hi;
            for (d, &x) in src[hi * hd..(hi + 1) * hd].iter().enumerate() {
                s.qt[d * rp + r] = x * geom.scale;
            }
            s.pos[r] = (first + t) as i32;
            s.lo[r] = geom.key_lo(first + t) as i32;
        }
    }
    s.s.resize(KEY_CHUNK * rp, 0.0);
    s.m.clear();
    s.m.resize(rp, f32::NEG_INFINITY);
    s.l.clear();
    s.l.resize(rp, 0.0);
    s.alpha.resize(rp, 1.0);
    s.o.clear();
    s.o.resize(rows * hd, 0.0);

    let bs = kv.block_size;
    let chunk = KEY_CHUNK.min(bs);
    // Start at a chunk boundary of the first visible key's block.
    let lo = geom.key_lo(first);
    let last_lo = geom.key_lo(last);
    let mut p = lo / bs * bs + (lo % bs) / chunk * chunk;
    let kv_off = u.kvh * hd;
    while p <= last {
        let b = p / bs;
        let in_block = p - b * bs;
        let nk = chunk.min(bs - in_block).min(last + 1 - p);
        let base = q.table[b] as usize * bs + in_block;
        let key_row = |j: usize| &kv.k[(base + j) * kvd + kv_off..][..hd];
        // Scores, up to six keys at a time against sixteen rows.
        let mut j = 0;
        while j + 6 <= nk {
            let ks = [
                key_row(j),
                key_row(j + 1),
                key_row(j + 2),
                key_row(j + 3),
                key_row(j + 4),
                key_row(j + 5),
            ];
            scores_keys::<F, 6>(&s.qt, rp, hd, ks, &mut s.s[j * rp..(j + 6) * rp]);
            j += 6;
        }
        while j + 4 <= nk {
            let ks = [key_row(j), key_row(j + 1), key_row(j + 2), key_row(j + 3)];
            scores_keys::<F, 4>(&s.qt, rp, hd, ks, &mut s.s[j * rp..(j + 4) * rp]);
            j += 4;
        }
        while j < nk {
            scores_keys::<F, 1>(&s.qt, rp, hd, [key_row(j)], &mut s.s[j * rp..(j + 1) * rp]);
            j += 1;
        }
        // Keys outside some row's view only near the diagonal (or the window's edge).
        let masked = p + nk - 1 > first || p < last_lo;
        online_softmax(s, rp, nk, p as i32, masked);
        for r in 0..rows {
            let a = s.alpha[r];
            if a != 1.0 {
                for o in &mut s.o[r * hd..(r + 1) * hd] {
                    *o *= a;
                }
            }
        }
        let v = &kv.v[base * kvd + kv_off..];
        weighted_values::<F>(&s.s, rp, v, kvd, nk, hd, rows, &mut s.o);
        p += nk;
    }
    for r in 0..rows {
        let inv = 1.0 / s.l[r];
        for (d, o) in dst[r * hd..(r + 1) * hd].iter_mut().zip(&s.o[r * hd..]) {
            *d = o * inv;
        }
    }
}

/// `s[j][r] = qt[·][r] · k_j` for `N` keys read in place (each `hd` long), sixteen or
/// eight rows per step.
#[inline(always)]
fn scores_keys<F: MulAdd, const N: usize>(
    qt: &[f32],
    rp: usize,
    hd: usize,
    ks: [&[f32]; N],
    s: &mut [f32],
) {
    assert!(qt.len() >= hd * rp && s.len() >= N * rp && ks.iter().all(|k| k.len() >= hd));
    let mut rb = 0;
    while rb + 2 * LANES <= rp {
        scores_block::<F, N, { 2 * LANES }>(qt, rp, hd, ks, rb, s);
        rb += 2 * LANES;
    }
    while rb < rp {
        scores_block::<F, N, LANES>(qt, rp, hd, ks, rb, s);
        rb += LANES;
    }
}

// Index loops over fixed-size register tiles: the shape the vectorizer wants.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn scores_block<F: MulAdd, const N: usize, const L: usize>(
    qt: &[f32],
    rp: usize,
    hd: usize,
    ks: [&[f32]; N],
    rb: usize,
    s: &mut [f32],
) {
    let mut acc = [[0.0f32; L]; N];
    let kp = ks.map(<[f32]>::as_ptr);
    let qp = qt.as_ptr();
    for d in 0..hd {
        // SAFETY: `scores_keys` checked qt (hd × rp, rb + L <= rp) and every key (hd).
        let qv = unsafe { &*(qp.add(d * rp + rb) as *const [f32; L]) };
        for n in 0..N {
            let kd = unsafe { *kp[n].add(d) };
            for l in 0..L {
                acc[n][l] = F::mul_add(kd, qv[l], acc[n][l]);
            }
        }
    }
    for n in 0..N {
        s[n * rp + rb..n * rp + rb + L].copy_from_slice(&acc[n]);
    }
}

/// One chunk's online-softmax step, every row at once (rows are the vector lanes):
/// masks keys a row cannot see, updates the running max, leaves in `alpha` how much
/// earlier sums shrink, turns scores into weights and adds them to the running sums.
#[inline(always)]
fn online_softmax(s: &mut Scratch, rp: usize, nk: usize, key0: i32, masked: bool) {
    const NEG: f32 = f32::NEG_INFINITY;
    let Scratch {
        s: sc,
        m,
        l,
        alpha,
        pos,
        lo,
        ..
    } = s;
    let (m, l, alpha, pos, lo) = (
        &mut m[..rp],
        &mut l[..rp],
        &mut alpha[..rp],
        &pos[..rp],
        &lo[..rp],
    );
    // `alpha` holds the chunk's max per row first.
    alpha.fill(NEG);
    for (j, row) in sc[..nk * rp].chunks_exact_mut(rp).enumerate() {
        if masked {
            let key = key0 + j as i32;
            for ((x, &lo), &pos) in row.iter_mut().zip(lo).zip(pos) {
                *x = if key >= lo && key <= pos { *x } else { NEG };
            }
        }
        for (a, &x) in alpha.iter_mut().zip(row.iter()) {
            *a = if x > *a { x } else { *a };
        }
    }
    for ((a, mr), lr) in alpha.iter_mut().zip(m.iter_mut()).zip(l.iter_mut()) {
        let mn = if *a > *mr { *a } else { *mr };
        // A row that has seen no key yet keeps its (empty) sums as they are.
        *a = if mn == NEG { 1.0 } else { fast_exp(*mr - mn) };
        *mr = mn;
        *lr *= *a;
    }
    for row in sc[..nk * rp].chunks_exact_mut(rp) {
        for ((x, &mr), lr) in row.iter_mut().zip(m.iter()).zip(l.iter_mut()) {
            let e = if *x == NEG { 0.0 } else { fast_exp(*x - mr) };
            *x = e;
            *lr += e;
        }
    }
}

/// `o[r] += Σ_j w[j][r] · v[j]` for the chunk's `nk` value rows (row `j` at
/// `v[j · stride]`, read in place), up to six rows and [`DIM_CHUNK`] dims at a time in
/// registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weighted_values<F: MulAdd>(
    w: &[f32],
    rp: usize,
    v: &[f32],
    stride: usize,
    nk: usize,
    hd: usize,
    rows: usize,
    o: &mut [f32],
) {
    let mut r = 0;
    while r + 6 <= rows {
        values_rows::<F, 6>(w, rp, r, v, stride, nk, hd, &mut o[r * hd..(r + 6) * hd]);
        r += 6;
    }
    while r + 4 <= rows {
        values_rows::<F, 4>(w, rp, r, v, stride, nk, hd, &mut o[r * hd..(r + 4) * hd]);
        r += 4;
    }
    while r < rows {
        values_rows::<F, 1>(w, rp, r, v, stride, nk, hd, &mut o[r * hd..(r + 1) * hd]);
        r += 1;
    }
}

// Index loops over fixed-size register tiles: the shape the vectorizer wants.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn values_rows<F: MulAdd, const N: usize>(
    w: &[f32],
    rp: usize,
    r0: usize,
    v: &[f32],
    stride: usize,
    nk: usize,
    hd: usize,
    o: &mut [f32],
) {
    assert!(nk >= 1 && v.len() >= (nk - 1) * stride + hd);
    assert!(w.len() >= (nk - 1) * rp + r0 + N && o.len() >= N * hd);
    let (wp, vp) = (w.as_ptr(), v.as_ptr());
    let full = hd / DIM_CHUNK * DIM_CHUNK;
    let mut dc = 0;
    while dc < full {
        let mut acc = [[0.0f32; DIM_CHUNK]; N];
        for n in 0..N {
            acc[n].copy_from_slice(&o[n * hd + dc..n * hd + dc + DIM_CHUNK]);
        }
        for j in 0..nk {
            // SAFETY: checked above: value row j spans `hd` floats from `j · stride`
            // (dc + DIM_CHUNK <= hd), and row j of the weights holds r0 + N.
            let vr = unsafe { &*(vp.add(j * stride + dc) as *const [f32; DIM_CHUNK]) };
            for n in 0..N {
                let wj = unsafe { *wp.add(j * rp + r0 + n) };
                for l in 0..DIM_CHUNK {
                    acc[n][l] = F::mul_add(wj, vr[l], acc[n][l]);
                }
            }
        }
        for n in 0..N {
            o[n * hd + dc..n * hd + dc + DIM_CHUNK].copy_from_slice(&acc[n]);
        }
        dc += DIM_CHUNK;
    }
    // Head dims that are not a multiple of the chunk: plain loop for the tail.
    for n in 0..N {
        for j in 0..nk {
            let wj = w[j * rp + r0 + n];
            for d in full..hd {
                o[n * hd + d] = F::mul_add(wj, v[j * stride + d], o[n * hd + d]);
            }
        }
    }
}

/// Plain causal attention over contiguous `q` (`n × q_dim`), `k` and `v` (`n × kv_dim`)
/// for positions `0..n`, accumulating in f64: the yardstick for the paged paths.
pub(crate) fn reference_attention(
    geom: &AttnGeom,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
) -> Vec<f32> {
    let (g, hd, qd, kvd) = (geom.group(), geom.head_dim, geom.q_dim(), geom.kv_dim());
    let mut out = vec![0.0f32; n * qd];
    let mut w = Vec::new();
    for i in 0..n {
        for h in 0..geom.n_heads {
            let kvh = h / g;
            let qi = &q[i * qd + h * hd..][..hd];
            let lo = geom.key_lo(i);
            w.clear();
            for j in lo..=i {
                let kj = &k[j * kvd + kvh * hd..][..hd];
                let s: f64 = qi
                    .iter()
                    .zip(kj)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                w.push(s * f64::from(geom.scale));
            }
            let max = w.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut sum = 0.0;
            for x in w.iter_mut() {
                *x = (*x - max).exp();
                sum += *x;
            }
            for d in 0..hd {
                let acc: f64 = (lo..=i)
                    .zip(&w)
                    .map(|(j, wj)| wj * f64::from(v[j * kvd + kvh * hd + d]))
                    .sum();
                out[i * qd + h * hd + d] = (acc / sum) as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn fill(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i ^ seed.wrapping_mul(0x9E37_79B9)).wrapping_mul(2_654_435_761);
                (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The paged kernel against the f64 reference on awkward shapes: head_dim not a
    /// multiple of the register chunk, blocks shorter than a key chunk and of odd size,
    /// shuffled block tables, a sliding window, and one step mixing a long prefill, a
    /// chunk that starts mid-sequence and single decode queries.
    #[test]
    fn paged_kernel_matches_reference_on_odd_shapes() {
        for (head_dim, block_size, window, n_heads, n_kv) in [
            (20usize, 5usize, None, 6usize, 2usize),
            (64, 16, None, 9, 3),
            (48, 7, Some(13), 4, 4),
            (32, 32, Some(40), 8, 2),
        ] {
            let geom = AttnGeom {
                n_heads,
                n_kv_heads: n_kv,
                head_dim,
                scale: 1.0 / (head_dim as f32).sqrt(),
                window,
            };
            let (qd, kvd) = (geom.q_dim(), geom.kv_dim());
            // Sequence lengths and how many of their last positions are queried now.
            let seqs = [(70usize, 70usize), (45, 29), (33, 1), (1, 1), (90, 3)];
            let blocks_per: Vec<usize> = seqs.iter().map(|s| s.0.div_ceil(block_size)).collect();
            let total_blocks: usize = blocks_per.iter().sum();
            // A permutation of block ids, handed out in order.
            let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, (i * 7 + 3) % (i + 1));
            }
            let mut kc = vec![0.0f32; total_blocks * block_size * kvd];
            let mut vc = vec![0.0f32; total_blocks * block_size * kvd];
            let stride = qd + 2 * kvd;
            let mut qkv = Vec::new();
            let mut tables = Vec::new();
            let mut refs = Vec::new();
            let mut next = 0;
            for (si, &(len, nq)) in seqs.iter().enumerate() {
                let table: Vec<u32> = ids[next..next + blocks_per[si]].to_vec();
                next += blocks_per[si];
                let q = fill(len * qd, 10 + si as u32);
                let k = fill(len * kvd, 20 + si as u32);
                let v = fill(len * kvd, 30 + si as u32);
                for pos in 0..len {
                    let slot = table[pos / block_size] as usize * block_size + pos % block_size;
                    kc[slot * kvd..(slot + 1) * kvd].copy_from_slice(&k[pos * kvd..][..kvd]);
                    vc[slot * kvd..(slot + 1) * kvd].copy_from_slice(&v[pos * kvd..][..kvd]);
                }
                for pos in len - nq..len {
                    qkv.extend_from_slice(&q[pos * qd..][..qd]);
                    qkv.extend(std::iter::repeat_n(0.0, 2 * kvd));
                }
                let r = reference_attention(&geom, &q, &k, &v, len);
                refs.extend_from_slice(&r[(len - nq) * qd..]);
                tables.push(table);
            }
            let mut row = 0;
            let queries: Vec<AttnQuery<'_>> = seqs
                .iter()
                .zip(&tables)
                .map(|(&(len, nq), t)| {
                    row += nq;
                    AttnQuery {
                        table: t,
                        rows: row - nq..row,
                        first_pos: len - nq,
                    }
                })
                .collect();
            let mut out = vec![f32::NAN; refs.len()];
            let kv = PagedKv {
                k: &kc,
                v: &vc,
                block_size,
            };
            let mut bufs = AttnBuffers::default();
            paged_attention(&geom, &qkv, stride, &queries, kv, &mut bufs, &mut out);
            let worst = out
                .iter()
                .zip(&refs)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-5,
                "{geom:?} block {block_size}: max diff {worst}"
            );
            // Each query alone (decode-style units) gives the same bits as in the batch.
            let mut alone = vec![f32::NAN; refs.len()];
            for (qi, q) in queries.iter().enumerate() {
                for (t, r) in q.rows.clone().enumerate() {
                    let one = [AttnQuery {
                        table: q.table,
                        rows: r..r + 1,
                        first_pos: q.first_pos + t,
                    }];
                    paged_attention(
                        &geom,
                        &qkv,
                        stride,
                        &one,
                        kv,
                        &mut bufs,
                        &mut alone[r * qd..(r + 1) * qd],
                    );
                }
                let rows = q.rows.start * qd..q.rows.end * qd;
                assert_eq!(out[rows.clone()], alone[rows], "sequence {qi}");
            }
        }
    }
}
