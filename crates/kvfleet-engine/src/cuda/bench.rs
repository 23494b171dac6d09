//! Kernel benchmarks for `examples/cuda_bench.rs`: device-to-device copy bandwidth and
//! paged decode attention on synthetic K/V read through shuffled block tables.

use cudarc::driver::CudaSlice;

use super::backend::{Gpu, DECODE_PARTITION};
use super::device_err;
use super::kernels::decode_kernel_name;
use super::launch::{i32_of, Arg};
use crate::error::{EngineError, Result};

/// What one timed kernel run measured.
#[derive(Debug, Clone)]
pub struct Timing {
    /// Mean milliseconds per iteration.
    pub ms: f64,
    /// Bytes moved per iteration (read + write for a copy; K/V read for attention).
    pub bytes: usize,
}

impl Timing {
    /// Achieved bandwidth in GB/s (1e9 bytes).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / (self.ms * 1e-3) / 1e9
    }
}

/// Deterministic pseudo-random numbers (xorshift), for synthetic inputs.
fn fill(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

fn time_ms(gpu: &Gpu, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    gpu.stream.synchronize().map_err(device_err("warm-up"))?;
    let start = gpu.ctx.new_event(None).map_err(device_err("event"))?;
    let end = gpu.ctx.new_event(None).map_err(device_err("event"))?;
    start.record(&gpu.stream).map_err(device_err("event"))?;
    for _ in 0..iters {
        f()?;
    }
    end.record(&gpu.stream).map_err(device_err("event"))?;
    end.synchronize().map_err(device_err("event"))?;
    let ms = start.elapsed_ms(&end).map_err(device_err("event"))?;
    Ok(f64::from(ms) / iters.max(1) as f64)
}

/// `cuMemcpyDtoD` of a `bytes`-byte buffer; bytes moved counts the read and the write.
pub fn d2d_copy(ordinal: usize, bytes: usize, iters: usize) -> Result<Timing> {
    let gpu = Gpu::open(ordinal)?;
    let src: CudaSlice<u8> = gpu
        .stream
        .alloc_zeros(bytes)
        .map_err(device_err("allocating"))?;
    let mut dst: CudaSlice<u8> = gpu
        .stream
        .alloc_zeros(bytes)
        .map_err(device_err("allocating"))?;
    let ms = time_ms(&gpu, iters, || {
        gpu.stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(device_err("memcpy_dtod"))
    })?;
    Ok(Timing {
        ms,
        bytes: 2 * bytes,
    })
}

/// Shape of a paged decode benchmark.
#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    /// Sequences, one query row each.
    pub batch: usize,
    /// Keys per sequence.
    pub context: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

/// Paged decode attention (split-K kernel + reduce) on bf16 K/V in blocks handed out
/// in a shuffled order; bytes counted are the K and V read.
pub fn paged_decode(ordinal: usize, s: DecodeShape, iters: usize) -> Result<Timing> {
    let group = s.n_heads / s.n_kv_heads.max(1);
    let name = decode_kernel_name(s.head_dim, group)
        .ok_or_else(|| EngineError::Config(format!("no decode kernel for {s:?}")))?;
    let gpu = Gpu::open(ordinal)?;
    let kvd = s.n_kv_heads * s.head_dim;
    let qd = s.n_heads * s.head_dim;
    let blocks_per_seq = s.context.div_ceil(s.block_size);
    let num_blocks = s.batch * blocks_per_seq;
    let cache_elems = num_blocks * s.block_size * kvd;
    let to_bits = |v: Vec<f32>| -> Vec<u16> {
        v.into_iter()
            .map(|x| half::bf16::from_f32(x).to_bits())
            .collect()
    };
    let k = gpu.upload(&to_bits(fill(cache_elems, 1, 1.0)))?;
    let v = gpu.upload(&to_bits(fill(cache_elems, 2, 1.0)))?;
    let q = gpu.upload(&fill(s.batch * qd, 3, 1.0))?;
    // Blocks in a scrambled order, as a long-running pool hands them out.
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    let mut st = 0x9E37_79B9_u64;
    for i in (1..ids.len()).rev() {
        st = st.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        ids.swap(i, (st >> 33) as usize % (i + 1));
    }
    let tables = gpu.upload(&ids)?;
    let table_off: Vec<i32> = (0..s.batch).map(|b| (b * blocks_per_seq) as i32).collect();
    let table_off = gpu.upload(&table_off)?;
    let pos = gpu.upload(&vec![(s.context - 1) as i32; s.batch])?;
    let rows = gpu.upload(&(0..s.batch as i32).collect::<Vec<_>>())?;
    let splits = s.context.div_ceil(DECODE_PARTITION);
    let out: CudaSlice<u16> = gpu.alloc(s.batch * qd)?;
    let part_out: CudaSlice<f32> = gpu.alloc(s.batch * s.n_heads * splits * s.head_dim)?;
    let part_max: CudaSlice<f32> = gpu.alloc(s.batch * s.n_heads * splits)?;
    let part_sum: CudaSlice<f32> = gpu.alloc(s.batch * s.n_heads * splits)?;
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    let args = [
        Arg::Ptr(gpu.ptr(&out)),
        i32_of(qd),
        Arg::Ptr(gpu.ptr(&part_out)),
        Arg::Ptr(gpu.ptr(&part_max)),
        Arg::Ptr(gpu.ptr(&part_sum)),
        Arg::Ptr(gpu.ptr(&q)),
        i32_of(qd),
        Arg::Ptr(gpu.ptr(&k)),
        Arg::Ptr(gpu.ptr(&v)),
        Arg::Ptr(gpu.ptr(&tables)),
        Arg::Ptr(gpu.ptr(&table_off)),
        Arg::Ptr(gpu.ptr(&pos)),
        Arg::Ptr(gpu.ptr(&rows)),
        i32_of(s.n_heads),
        i32_of(s.n_kv_heads),
        i32_of(s.block_size),
        Arg::I32(0),
        Arg::F32(scale),
    ];
    let reduce_args = [
        Arg::Ptr(gpu.ptr(&out)),
        i32_of(qd),
        Arg::Ptr(gpu.ptr(&part_out)),
        Arg::Ptr(gpu.ptr(&part_max)),
        Arg::Ptr(gpu.ptr(&part_sum)),
        Arg::Ptr(gpu.ptr(&rows)),
        i32_of(s.n_heads),
        i32_of(s.head_dim),
        i32_of(splits),
    ];
    let ms = time_ms(&gpu, iters, || {
        gpu.launch(
            &name,
            (s.batch as u32, s.n_kv_heads as u32, splits as u32),
            128,
            &args,
        )?;
        if splits > 1 {
            gpu.launch(
                "paged_decode_reduce",
                (s.batch as u32, s.n_heads as u32, 1),
                s.head_dim.clamp(32, 128) as u32,
                &reduce_args,
            )?;
        }
        Ok(())
    })?;
    let bytes = 2 * s.batch * s.context * kvd * 2;
    Ok(Timing { ms, bytes })
}
