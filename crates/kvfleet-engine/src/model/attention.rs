//! Causal grouped-query attention over the paged KV cache, plus the plain reference
//! implementation the paged one is tested against.
//!
//! Two paged paths: a chunk of many queries (prefill) gathers its sequence's keys and
//! values into contiguous buffers and runs two matrix products per KV head on candle;
//! a few queries (decode) are computed by a direct loop reading keys and values through
//! the block table, spread over threads by (sequence, KV head).

use std::ops::Range;

use candle_core::{Device, Tensor};

use super::ops::{axpy, dot, softmax_scaled_in_place};
use crate::error::Result;

/// Queries per sequence up to which the direct loop is used instead of matrix products.
const SMALL_QUERY_ROWS: usize = 8;
/// Upper bound on the floats of one score tile in the chunk path (16 MiB).
const SCORE_TILE_FLOATS: usize = 1 << 22;
/// Below this many multiply-adds a layer's decode attention is not worth a thread.
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

/// Calls `f(i, slot)` for the positions in `range`, `i` counted from `range.start`,
/// walking the block table one block at a time so no division happens per position.
#[inline]
fn for_each_slot(table: &[u32], range: Range<usize>, bs: usize, mut f: impl FnMut(usize, usize)) {
    let mut p = range.start;
    while p < range.end {
        let b = p / bs;
        let base = table[b] as usize * bs;
        let end = range.end.min((b + 1) * bs);
        for q in p..end {
            f(q - range.start, base + (q - b * bs));
        }
        p = end;
    }
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
    threads: usize,
    out: &mut [f32],
) -> Result<()> {
    let qd = geom.q_dim();
    let mut row0 = Vec::with_capacity(queries.len());
    let mut acc = 0;
    for q in queries {
        row0.push(acc);
        acc += q.rows.len();
    }
    debug_assert_eq!(out.len(), acc * qd);

    // Chunks: one after the other, each matrix product using all cores.
    for (q, &r0) in queries.iter().zip(&row0) {
        let n = q.rows.len();
        if n > SMALL_QUERY_ROWS {
            chunk_attention(
                geom,
                qkv,
                qkv_stride,
                q,
                kv,
                threads,
                &mut out[r0 * qd..(r0 + n) * qd],
            )?;
        }
    }

    // Decode-sized queries: independent (sequence, KV head) units.
    let units: Vec<(usize, usize)> = queries
        .iter()
        .enumerate()
        .filter(|(_, q)| !q.rows.is_empty() && q.rows.len() <= SMALL_QUERY_ROWS)
        .flat_map(|(i, _)| (0..geom.n_kv_heads).map(move |h| (i, h)))
        .collect();
    if units.is_empty() {
        return Ok(());
    }
    let work = |&(i, _): &(usize, usize)| {
        let q = &queries[i];
        q.rows.len() * (q.first_pos + q.rows.len()) * geom.group() * geom.head_dim
    };
    let total: usize = units.iter().map(work).sum();
    let run = |us: &[(usize, usize)]| -> Vec<Vec<f32>> {
        us.iter()
            .map(|&(i, h)| decode_unit(geom, qkv, qkv_stride, &queries[i], h, kv))
            .collect()
    };
    let results: Vec<Vec<f32>> = if threads <= 1 || total < PARALLEL_MIN_WORK || units.len() < 2 {
        run(&units)
    } else {
        // Contiguous groups of about equal work, one per thread.
        let per = total.div_ceil(threads);
        let mut groups: Vec<&[(usize, usize)]> = Vec::new();
        let (mut start, mut sum) = (0, 0);
        for (i, u) in units.iter().enumerate() {
            sum += work(u);
            if sum >= per && groups.len() + 1 < threads {
                groups.push(&units[start..=i]);
                start = i + 1;
                sum = 0;
            }
        }
        if start < units.len() {
            groups.push(&units[start..]);
        }
        std::thread::scope(|s| {
            let (first, rest) = groups.split_at(1);
            let handles: Vec<_> = rest.iter().map(|g| s.spawn(|| run(g))).collect();
            let mut all = first.iter().flat_map(|g| run(g)).collect::<Vec<_>>();
            for h in handles {
                match h.join() {
                    Ok(r) => all.extend(r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            all
        })
    };
    let (g, hd) = (geom.group(), geom.head_dim);
    for (&(i, kvh), res) in units.iter().zip(&results) {
        let r0 = row0[i];
        for (t, src) in res.chunks_exact(g * hd).enumerate() {
            let dst = (r0 + t) * qd + kvh * g * hd;
            out[dst..dst + g * hd].copy_from_slice(src);
        }
    }
    Ok(())
}

/// Direct attention of a few query rows for the heads of KV head `kvh`; returns
/// `rows × (group · head_dim)` outputs.
fn decode_unit(
    geom: &AttnGeom,
    qkv: &[f32],
    qkv_stride: usize,
    q: &AttnQuery<'_>,
    kvh: usize,
    kv: PagedKv<'_>,
) -> Vec<f32> {
    let (g, hd, kvd) = (geom.group(), geom.head_dim, geom.kv_dim());
    let mut res = vec![0.0f32; q.rows.len() * g * hd];
    let mut scores = Vec::new();
    for (t, row) in q.rows.clone().enumerate() {
        let pos = q.first_pos + t;
        let keys = geom.key_lo(pos)..pos + 1;
        let nk = keys.len();
        let qrow = &qkv[row * qkv_stride + kvh * g * hd..][..g * hd];
        scores.clear();
        scores.resize(g * nk, 0.0);
        for_each_slot(q.table, keys.clone(), kv.block_size, |j, slot| {
            let kp = &kv.k[slot * kvd + kvh * hd..][..hd];
            for hi in 0..g {
                scores[hi * nk + j] = dot(&qrow[hi * hd..(hi + 1) * hd], kp);
            }
        });
        for hi in 0..g {
            softmax_scaled_in_place(&mut scores[hi * nk..(hi + 1) * nk], geom.scale);
        }
        let o = &mut res[t * g * hd..(t + 1) * g * hd];
        for_each_slot(q.table, keys, kv.block_size, |j, slot| {
            let vp = &kv.v[slot * kvd + kvh * hd..][..hd];
            for hi in 0..g {
                axpy(scores[hi * nk + j], vp, &mut o[hi * hd..(hi + 1) * hd]);
            }
        });
    }
    res
}

/// Attention of a long run of query rows: per KV head, gather the keys and values the
/// chunk can see into contiguous buffers, then per tile of queries compute
/// `softmax(mask(Q·Kᵀ·scale))·V` with two matrix products.
fn chunk_attention(
    geom: &AttnGeom,
    qkv: &[f32],
    qkv_stride: usize,
    q: &AttnQuery<'_>,
    kv: PagedKv<'_>,
    threads: usize,
    out: &mut [f32],
) -> Result<()> {
    let (g, hd, kvd, qd) = (geom.group(), geom.head_dim, geom.kv_dim(), geom.q_dim());
    let n = q.rows.len();
    let p0 = q.first_pos;
    let k_lo = geom.key_lo(p0);
    let lk = p0 + n - k_lo;
    // Tiles bound the score buffer and skip most of the causal upper triangle.
    let tq = (SCORE_TILE_FLOATS / (g * lk).max(1)).clamp(16, 256).min(n);
    let dev = Device::Cpu;
    for kvh in 0..geom.n_kv_heads {
        let mut kbuf = vec![0.0f32; lk * hd];
        let mut vbuf = vec![0.0f32; lk * hd];
        for_each_slot(q.table, k_lo..p0 + n, kv.block_size, |j, slot| {
            let src = slot * kvd + kvh * hd;
            kbuf[j * hd..(j + 1) * hd].copy_from_slice(&kv.k[src..src + hd]);
            vbuf[j * hd..(j + 1) * hd].copy_from_slice(&kv.v[src..src + hd]);
        });
        let kt = Tensor::from_vec(kbuf, (lk, hd), &dev)?;
        let vt = Tensor::from_vec(vbuf, (lk, hd), &dev)?;
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + tq).min(n);
            let m = t1 - t0;
            // Keys this tile can see, relative to `k_lo`.
            let tk_lo = geom.key_lo(p0 + t0) - k_lo;
            let tk_hi = p0 + t1 - k_lo;
            let nk = tk_hi - tk_lo;
            let mut qbuf = Vec::with_capacity(g * m * hd);
            for hi in 0..g {
                let col = (kvh * g + hi) * hd;
                for t in t0..t1 {
                    let r = (q.rows.start + t) * qkv_stride + col;
                    qbuf.extend_from_slice(&qkv[r..r + hd]);
                }
            }
            let qt = Tensor::from_vec(qbuf, (g * m, hd), &dev)?;
            let mut s = qt
                .matmul(&kt.narrow(0, tk_lo, nk)?.t()?)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            // Mask and softmax, row by row; rows are independent, so split them over threads.
            let mask_rows = |first_row: usize, chunk: &mut [f32]| {
                for (i, row) in chunk.chunks_exact_mut(nk).enumerate() {
                    let pos = p0 + t0 + (first_row + i) % m;
                    // Visible keys of this row, as columns of the tile.
                    let a = geom.key_lo(pos) - k_lo - tk_lo;
                    let b = pos - k_lo - tk_lo + 1;
                    row[..a].fill(0.0);
                    row[b..].fill(0.0);
                    softmax_scaled_in_place(&mut row[a..b], geom.scale);
                }
            };
            let rows = g * m;
            if threads > 1 && rows * nk >= PARALLEL_MIN_WORK {
                let per = rows.div_ceil(threads);
                std::thread::scope(|sc| {
                    let mut chunks = s.chunks_mut(per * nk).enumerate();
                    let first = chunks.next();
                    for (i, c) in chunks {
                        sc.spawn(move || mask_rows(i * per, c));
                    }
                    if let Some((_, c)) = first {
                        mask_rows(0, c);
                    }
                });
            } else {
                mask_rows(0, &mut s);
            }
            let p = Tensor::from_vec(s, (g * m, nk), &dev)?;
            let o = p
                .matmul(&vt.narrow(0, tk_lo, nk)?)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            for hi in 0..g {
                let col = (kvh * g + hi) * hd;
                for t in 0..m {
                    let src = (hi * m + t) * hd;
                    let dst = (t0 + t) * qd + col;
                    out[dst..dst + hd].copy_from_slice(&o[src..src + hd]);
                }
            }
            t0 = t1;
        }
    }
    Ok(())
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
