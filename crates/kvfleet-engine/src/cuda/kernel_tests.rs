//! Each kernel against the CPU reference within bf16 tolerance (feature `gpu-tests`,
//! needs a CUDA device; run by scripts/gpu-check.sh).

use cudarc::driver::CudaSlice;

use super::backend::{Gpu, DECODE_PARTITION};
use super::kernels::{decode_kernel_name, prefill_kernel_name};
use super::launch::{i32_of, Arg};
use crate::model::ops::{rms_norm_rows, rms_norm_rows_in_place, silu_mul_rows};
use crate::model::rope::Rope;
use crate::model_config::ModelConfig;

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

fn bf16(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

fn unbf16(v: &[u16]) -> Vec<f32> {
    v.iter()
        .map(|&b| half::bf16::from_bits(b).to_f32())
        .collect()
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    unbf16(&bf16(v))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn gpu() -> Gpu {
    Gpu::open(0).expect("cuda:0 with driver, NVRTC and cuBLAS")
}

fn p<T>(g: &Gpu, s: &CudaSlice<T>) -> Arg {
    Arg::Ptr(g.ptr(s))
}

#[test]
fn rms_norm_matches_cpu() {
    let g = gpu();
    let (rows, width) = (7, 1000);
    let x = rand(rows * width, 1);
    let w = rand(width, 2);
    let mut want = vec![0.0; x.len()];
    rms_norm_rows(&x, &w, 1e-5, &mut want);
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let out: CudaSlice<u16> = g.alloc(rows * width).unwrap();
    // Rows picked in reverse through row_idx.
    let idx: Vec<i32> = (0..rows as i32).rev().collect();
    let didx = g.upload(&idx).unwrap();
    g.launch(
        "rms_norm",
        (rows as u32, 1, 1),
        256,
        &[
            p(&g, &dx),
            p(&g, &dw),
            p(&g, &out),
            p(&g, &didx),
            i32_of(width),
            Arg::F32(1e-5),
        ],
    )
    .unwrap();
    let got = unbf16(&g.download(&out, rows * width).unwrap());
    for (r, &src) in idx.iter().enumerate() {
        let s = src as usize;
        let d = max_diff(
            &got[r * width..(r + 1) * width],
            &want[s * width..(s + 1) * width],
        );
        assert!(d < 2e-2, "row {r}: {d}");
    }
}

#[test]
fn silu_mul_matches_cpu() {
    let g = gpu();
    let (rows, inter) = (5, 333);
    let gu = rand(rows * 2 * inter, 3)
        .iter()
        .map(|x| x * 4.0)
        .collect::<Vec<_>>();
    let mut want = vec![0.0; rows * inter];
    silu_mul_rows(&gu, inter, &mut want);
    let dgu = g.upload(&gu).unwrap();
    let out: CudaSlice<u16> = g.alloc(rows * inter).unwrap();
    g.launch(
        "silu_mul",
        (4, 1, 1),
        256,
        &[p(&g, &dgu), p(&g, &out), i32_of(rows), i32_of(inter)],
    )
    .unwrap();
    let got = unbf16(&g.download(&out, rows * inter).unwrap());
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        // bf16 output: 2^-8 relative.
        assert!((a - b).abs() <= 8e-3 * b.abs() + 1e-3, "{i}: {a} vs {b}");
    }
}

#[test]
fn qk_norm_and_rope_match_cpu() {
    let g = gpu();
    let c = ModelConfig::tiny();
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads(), c.head_dim());
    let stride = (nh + 2 * nkv) * hd;
    let positions = [0usize, 1, 17, 1023, 5000];
    let rows = positions.len();
    let qkv = rand(rows * stride, 4);
    let (qn, kn) = (rand(hd, 5), rand(hd, 6));
    let rope = Rope::new(&c);
    let tables = rope.tables(positions);
    let mut want = qkv.clone();
    for (r, row) in want.chunks_exact_mut(stride).enumerate() {
        let (q, rest) = row.split_at_mut(nh * hd);
        let k = &mut rest[..nkv * hd];
        rms_norm_rows_in_place(q, &qn, 1e-5);
        rms_norm_rows_in_place(k, &kn, 1e-5);
        tables.apply(r, q, nh);
        tables.apply(r, k, nkv);
    }
    let d = g.upload(&qkv).unwrap();
    let (dqn, dkn) = (g.upload(&qn).unwrap(), g.upload(&kn).unwrap());
    let pos: Vec<i32> = positions.iter().map(|&x| x as i32).collect();
    let dpos = g.upload(&pos).unwrap();
    let inv = g.upload(rope.inv_freq()).unwrap();
    g.launch(
        "qk_norm_rope",
        (rows as u32, (nh + nkv) as u32, 1),
        32,
        &[
            p(&g, &d),
            i32_of(stride),
            i32_of(nh),
            i32_of(hd),
            p(&g, &dqn),
            p(&g, &dkn),
            Arg::F32(1e-5),
            p(&g, &dpos),
            p(&g, &inv),
        ],
    )
    .unwrap();
    let got = g.download(&d, qkv.len()).unwrap();
    let diff = max_diff(&got, &want);
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn reshape_and_cache_then_copy_blocks() {
    let g = gpu();
    let (kvd, bs, blocks, layers) = (32usize, 4usize, 6usize, 2usize);
    let stride = 3 * kvd;
    let rows = 5;
    let qkv = rand(rows * stride, 7);
    let slots: Vec<i32> = vec![9, 2, -1, 23, 0];
    let dq = g.upload(&qkv).unwrap();
    let ds = g.upload(&slots).unwrap();
    let kv = super::kv_blocks::DeviceKv::new(&g.stream, layers, blocks, bs, kvd).unwrap();
    let (kc, vc) = (kv.k_ptr(&g.stream, 1), kv.v_ptr(&g.stream, 1));
    g.launch(
        "reshape_and_cache",
        (rows as u32, 1, 1),
        64,
        &[
            p(&g, &dq),
            i32_of(stride),
            i32_of(kvd),
            i32_of(2 * kvd),
            i32_of(kvd),
            p(&g, &ds),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
        ],
    )
    .unwrap();
    // Block 0 (slots 0..4) and 2 (slots 8..12) hold rows; copy 2 -> 5 and 0 -> 4.
    let pairs = g.upload(&[2i32, 5, 0, 4]).unwrap();
    let (args, grid) = kv.copy_args(&g.stream, g.ptr(&pairs), 2);
    g.launch("copy_blocks", grid, 256, &args).unwrap();
    g.stream.synchronize().unwrap();
    let plane = blocks * bs * kvd;
    let all = unbf16(&{
        let mut host = vec![0u16; 2 * layers * plane];
        g.stream.memcpy_dtoh(kv_slice(&kv), &mut host).unwrap();
        host
    });
    let (k1, v1) = (&all[2 * plane..3 * plane], &all[3 * plane..4 * plane]);
    for (r, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let s = s as usize;
        let row = &qkv[r * stride..(r + 1) * stride];
        assert_eq!(
            &k1[s * kvd..(s + 1) * kvd],
            &round_bf16(&row[kvd..2 * kvd])[..]
        );
        assert_eq!(
            &v1[s * kvd..(s + 1) * kvd],
            &round_bf16(&row[2 * kvd..])[..]
        );
    }
    let be = bs * kvd;
    for (src, dst) in [(2usize, 5usize), (0, 4)] {
        assert_eq!(k1[src * be..(src + 1) * be], k1[dst * be..(dst + 1) * be]);
        assert_eq!(v1[src * be..(src + 1) * be], v1[dst * be..(dst + 1) * be]);
    }
    // Layer 0 was never written.
    assert!(all[..2 * plane].iter().all(|&x| x == 0.0));
    // Slot 23 is block 5, overwritten by the copy of block 2.
    assert_ne!(
        &k1[23 * kvd..24 * kvd],
        &round_bf16(&qkv[3 * stride + kvd..3 * stride + 2 * kvd])[..]
    );
}

fn kv_slice(kv: &super::kv_blocks::DeviceKv) -> &CudaSlice<u16> {
    kv.data()
}

#[allow(clippy::too_many_arguments)]
/// f64 attention of one query (already scaled) over keys `lo..=pos` of contiguous k/v.
fn reference_row(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kvd: usize,
    kvh: usize,
    hd: usize,
    lo: usize,
    pos: usize,
) -> Vec<f32> {
    let s: Vec<f64> = (lo..=pos)
        .map(|j| {
            (0..hd)
                .map(|d| f64::from(q[d]) * f64::from(k[j * kvd + kvh * hd + d]))
                .sum()
        })
        .collect();
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let sum: f64 = w.iter().sum();
    (0..hd)
        .map(|d| {
            ((lo..=pos)
                .zip(&w)
                .map(|(j, wj)| wj * f64::from(v[j * kvd + kvh * hd + d]))
                .sum::<f64>()
                / sum) as f32
        })
        .collect()
}

/// Attention kernels on one sequence of `n` positions whose K/V sit in shuffled blocks;
/// the query rows are its last `rows` positions (decode kernel if `rows <= 8`).
fn attention_case(
    n: usize,
    rows: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    window: usize,
    decode: bool,
) {
    let g = gpu();
    let bs = 16;
    let (qd, kvd) = (nh * hd, nkv * hd);
    let nblocks = n.div_ceil(bs);
    let k = round_bf16(&rand(n * kvd, 8));
    let v = round_bf16(&rand(n * kvd, 9));
    let q: Vec<f32> = rand(rows * qd, 10).iter().map(|x| x * 3.0).collect();
    let table: Vec<i32> = (0..nblocks as i32)
        .map(|b| (b * 7 + 3) % nblocks as i32)
        .collect();
    let mut kc = vec![0u16; nblocks * bs * kvd];
    let mut vc = vec![0u16; nblocks * bs * kvd];
    for pos in 0..n {
        let slot = table[pos / bs] as usize * bs + pos % bs;
        kc[slot * kvd..(slot + 1) * kvd].copy_from_slice(&bf16(&k[pos * kvd..(pos + 1) * kvd]));
        vc[slot * kvd..(slot + 1) * kvd].copy_from_slice(&bf16(&v[pos * kvd..(pos + 1) * kvd]));
    }
    let (dk, dv, dq) = (
        g.upload(&kc).unwrap(),
        g.upload(&vc).unwrap(),
        g.upload(&q).unwrap(),
    );
    let dt = g.upload(&table).unwrap();
    let pos: Vec<i32> = (n - rows..n).map(|x| x as i32).collect();
    let dpos = g.upload(&pos).unwrap();
    let doff = g.upload(&vec![0i32; rows]).unwrap();
    let out: CudaSlice<u16> = g.alloc(rows * qd).unwrap();
    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    if decode {
        let rows_idx: Vec<i32> = (0..rows as i32).collect();
        let dr = g.upload(&rows_idx).unwrap();
        let keys = if window > 0 { n.min(window) } else { n };
        let splits = keys.div_ceil(DECODE_PARTITION);
        let part = rows * nh * splits;
        let (po, pm, ps): (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>) = (
            g.alloc(part * hd).unwrap(),
            g.alloc(part).unwrap(),
            g.alloc(part).unwrap(),
        );
        let name = decode_kernel_name(hd, group).unwrap();
        g.launch(
            &name,
            (rows as u32, nkv as u32, splits as u32),
            128,
            &[
                p(&g, &out),
                i32_of(qd),
                p(&g, &po),
                p(&g, &pm),
                p(&g, &ps),
                p(&g, &dq),
                i32_of(qd),
                p(&g, &dk),
                p(&g, &dv),
                p(&g, &dt),
                p(&g, &doff),
                p(&g, &dpos),
                p(&g, &dr),
                i32_of(nh),
                i32_of(nkv),
                i32_of(bs),
                i32_of(window),
                Arg::F32(scale),
            ],
        )
        .unwrap();
        if splits > 1 {
            g.launch(
                "paged_decode_reduce",
                (rows as u32, nh as u32, 1),
                64,
                &[
                    p(&g, &out),
                    i32_of(qd),
                    p(&g, &po),
                    p(&g, &pm),
                    p(&g, &ps),
                    p(&g, &dr),
                    i32_of(nh),
                    i32_of(hd),
                    i32_of(splits),
                ],
            )
            .unwrap();
        }
    } else {
        let row0: Vec<i32> = (0..rows).step_by(8).map(|r| r as i32).collect();
        let nr: Vec<i32> = row0
            .iter()
            .map(|&r| (rows - r as usize).min(8) as i32)
            .collect();
        let (d0, dn) = (g.upload(&row0).unwrap(), g.upload(&nr).unwrap());
        let name = prefill_kernel_name(hd).unwrap();
        g.launch(
            &name,
            (row0.len() as u32, nh as u32, 1),
            256,
            &[
                p(&g, &out),
                i32_of(qd),
                p(&g, &dq),
                i32_of(qd),
                p(&g, &dk),
                p(&g, &dv),
                p(&g, &dt),
                p(&g, &d0),
                p(&g, &dn),
                p(&g, &doff),
                p(&g, &dpos),
                i32_of(nh),
                i32_of(nkv),
                i32_of(bs),
                i32_of(window),
                Arg::F32(scale),
            ],
        )
        .unwrap();
    }
    let got = unbf16(&g.download(&out, rows * qd).unwrap());
    for r in 0..rows {
        let ps = n - rows + r;
        let lo = if window > 0 {
            (ps + 1).saturating_sub(window)
        } else {
            0
        };
        for h in 0..nh {
            let qs: Vec<f32> = q[r * qd + h * hd..r * qd + (h + 1) * hd]
                .iter()
                .map(|x| x * scale)
                .collect();
            let want = reference_row(&qs, &k, &v, kvd, h / group, hd, lo, ps);
            let d = max_diff(&got[r * qd + h * hd..r * qd + (h + 1) * hd], &want);
            assert!(d < 2e-2, "n {n} row {r} head {h}: {d}");
        }
    }
}

#[test]
fn paged_decode_matches_reference() {
    // Short context, one partition; Llama GQA (4 per KV head).
    attention_case(100, 1, 32, 8, 128, 0, true);
    // Split-K: 2,600 keys in six partitions; several rows (a small decode chunk).
    attention_case(2600, 3, 8, 4, 64, 0, true);
    // Group of 7 in the group-8 instance, head_dim 16.
    attention_case(600, 2, 14, 2, 16, 0, true);
    // Sliding window.
    attention_case(1500, 1, 4, 2, 32, 700, true);
}

#[test]
fn prefill_attention_over_a_cached_prefix_matches_reference() {
    // 300 cached positions + 45 new rows attending causally.
    attention_case(345, 45, 8, 4, 64, 0, false);
    attention_case(1000, 20, 32, 8, 128, 0, false);
    attention_case(400, 30, 4, 2, 16, 100, false);
}
