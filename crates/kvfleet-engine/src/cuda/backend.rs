//! [`CudaBackend`]: one engine step on the GPU, with the CPU model's semantics (same
//! validation, same `LogitsRequest` handling, rope scaling, q/k norm, biases, sliding
//! window), so its logits match the CPU backend's within bf16 tolerance.
//!
//! Per step: token embedding → per layer RMSNorm → qkv GEMM (+bias) → q/k norm + RoPE →
//! K/V written to their slots → attention (split-K decode kernel for sequences with at
//! most [`DECODE_MAX_ROWS`] new tokens, the tiled prefill kernel for longer chunks) →
//! o GEMM accumulated into the residual → RMSNorm → gate|up GEMM → SiLU·mul → down GEMM
//! accumulated into the residual; then the final norm and `lm_head` on the rows whose
//! logits are wanted.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::device_err;
use super::gemm::Gemm;
use super::kernels::{decode_kernel_name, prefill_kernel_name, Kernels};
use super::kv_blocks::DeviceKv;
use super::launch::{i32_of, launch, ptr, Arg};
use super::probe::{probe, DeviceInfo};
use super::step_buffers::StepBuffers;
use super::weights::DeviceWeights;
use crate::backend::ModelBackend;
use crate::error::{EngineError, Result};
use crate::kv_sizing::{
    kv_block_bytes_of, size_from_memory, step_workspace_bytes, DeviceMemory, KvDtype, KvPool,
    KvSizing,
};
use crate::model::{ForwardItem, LlamaModel, LogitsRequest};
use crate::model_config::ModelConfig;

/// Sequences with at most this many new tokens in a step go through the decode kernel.
pub const DECODE_MAX_ROWS: usize = 8;
/// Keys per split-K partition of the decode kernel (`DEC_PART` in paged_decode.cu).
pub const DECODE_PARTITION: usize = 512;
/// Query rows per tile of the prefill kernel (`PF_ROWS` in prefill_attention.cu).
const PREFILL_TILE_ROWS: usize = 8;

/// The attention shape the kernels need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geom {
    pub(crate) hidden: usize,
    pub(crate) n_heads: usize,
    pub(crate) n_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) inter: usize,
    pub(crate) vocab: usize,
    pub(crate) window: usize,
    pub(crate) scale: f32,
    pub(crate) eps: f32,
}

impl Geom {
    fn of(c: &ModelConfig) -> Self {
        Self {
            hidden: c.hidden_size,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_kv_heads(),
            head_dim: c.head_dim(),
            inter: c.intermediate_size,
            vocab: c.vocab_size,
            window: c.sliding_window().unwrap_or(0),
            scale: 1.0 / (c.head_dim() as f32).sqrt(),
            eps: c.rms_norm_eps as f32,
        }
    }
    fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// The device, its stream, kernels and cuBLAS handle: what every launch needs.
pub(crate) struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: Kernels,
    pub(crate) gemm: Gemm,
    pub(crate) info: DeviceInfo,
}

impl Gpu {
    /// Probes device `ordinal`, then opens it and compiles the kernels for it.
    pub(crate) fn open(ordinal: usize) -> Result<Self> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(device_err("creating a CUDA context"))?;
        // One stream, buffers owned by the backend: no per-buffer events needed.
        // SAFETY: called before any allocation on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let kernels = Kernels::load(&ctx)?;
        let gemm = Gemm::new(Arc::clone(&stream))?;
        Ok(Self {
            ctx,
            stream,
            kernels,
            gemm,
            info,
        })
    }

    /// Launches kernel `name`.
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        launch(&self.stream, self.kernels.get(name)?, grid, block, args)
    }

    /// An uninitialized device buffer of `n` elements (at least one).
    pub(crate) fn alloc<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every buffer is written by a kernel or a GEMM before it is read.
        unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(device_err("allocating device memory"))
    }

    /// Copies `v` to a new device buffer.
    pub(crate) fn upload<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>> {
        if v.is_empty() {
            return self.alloc(1);
        }
        self.stream
            .clone_htod(v)
            .map_err(device_err("copying to the device"))
    }

    /// Copies a device buffer back.
    pub(crate) fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        s: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>> {
        let head = s.try_slice(..n).ok_or_else(|| {
            EngineError::Device(format!(
                "reading {n} elements of a {}-element device buffer",
                s.len()
            ))
        })?;
        let mut out = vec![T::default(); n];
        self.stream
            .memcpy_dtoh(&head, &mut out)
            .map_err(device_err("copying from the device"))?;
        Ok(out)
    }

    /// Device address of `s`.
    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.stream)
    }

    /// Free and total bytes of the device (`cuMemGetInfo` on this context).
    pub(crate) fn memory(&self) -> Result<DeviceMemory> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(device_err("querying free device memory"))?;
        Ok(DeviceMemory { free, total })
    }
}

fn grid1(n: usize) -> (u32, u32, u32) {
    (u32::try_from(n).unwrap_or(u32::MAX), 1, 1)
}

/// The host-side plan of one step: per-row arrays the kernels read.
struct StepPlan {
    n: usize,
    tokens: Vec<i32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    table_off: Vec<i32>,
    tables: Vec<i32>,
    dec_rows: Vec<i32>,
    tile_row0: Vec<i32>,
    tile_rows: Vec<i32>,
    logit_rows: Vec<i32>,
    /// Logit rows per item.
    logit_counts: Vec<usize>,
    /// Most keys a decode row attends to.
    max_dec_keys: usize,
}

fn plan_step(items: &[ForwardItem<'_>], block_size: usize, window: usize) -> Result<StepPlan> {
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| EngineError::InvalidRequest(format!("{v} exceeds i32")))
    };
    let mut p = StepPlan {
        n: 0,
        tokens: Vec::new(),
        pos: Vec::new(),
        slots: Vec::new(),
        table_off: Vec::new(),
        tables: Vec::new(),
        dec_rows: Vec::new(),
        tile_row0: Vec::new(),
        tile_rows: Vec::new(),
        logit_rows: Vec::new(),
        logit_counts: Vec::new(),
        max_dec_keys: 0,
    };
    for item in items {
        let t = item.tokens.len();
        let row0 = p.n;
        let end = item.start_pos + t;
        let needed = end.div_ceil(block_size);
        let off = int(p.tables.len())?;
        for &b in &item.block_table[..needed] {
            p.tables.push(int(b as usize)?);
        }
        for (i, &tok) in item.tokens.iter().enumerate() {
            let pos = item.start_pos + i;
            p.tokens.push(int(tok as usize)?);
            p.pos.push(int(pos)?);
            p.slots.push(int(item.block_table[pos / block_size] as usize
                * block_size
                + pos % block_size)?);
            p.table_off.push(off);
        }
        if t > 0 && t <= DECODE_MAX_ROWS {
            for r in row0..row0 + t {
                p.dec_rows.push(int(r)?);
            }
            let keys = if window > 0 { end.min(window) } else { end };
            p.max_dec_keys = p.max_dec_keys.max(keys);
        } else if t > DECODE_MAX_ROWS {
            let mut r = 0;
            while r < t {
                let k = PREFILL_TILE_ROWS.min(t - r);
                p.tile_row0.push(int(row0 + r)?);
                p.tile_rows.push(int(k)?);
                r += k;
            }
        }
        let logit = match item.logits {
            LogitsRequest::None => row0 + t..row0 + t,
            LogitsRequest::Last => row0 + t - 1..row0 + t,
            LogitsRequest::All => row0..row0 + t,
        };
        p.logit_counts.push(logit.len());
        for r in logit {
            p.logit_rows.push(int(r)?);
        }
        p.n += t;
    }
    Ok(p)
}

/// The Llama-family model on a CUDA device, with its KV cache in device memory.
pub struct CudaBackend {
    model: Arc<LlamaModel>,
    gpu: Gpu,
    geom: Geom,
    weights: DeviceWeights,
    inv_freq: CudaSlice<f32>,
    kv: DeviceKv,
    decode_kernel: String,
    prefill_kernel: String,
    /// A failed `copy_block` (which cannot return an error), reported by the next step.
    pending_error: Option<EngineError>,
    /// How the pool was sized from device memory, when it was.
    sizing: Option<KvSizing>,
    /// Activations and step metadata, kept across steps.
    bufs: StepBuffers,
}

impl CudaBackend {
    /// Probes `cuda:{ordinal}`, compiles the kernels for it, uploads the weights (bf16)
    /// and allocates the KV pool of blocks of `block_size` tokens: a fixed count, or
    /// (`KvPool::MemoryFraction`) what fits in device memory once the weights are there.
    pub fn new(
        model: Arc<LlamaModel>,
        pool: impl Into<KvPool>,
        block_size: usize,
        ordinal: usize,
    ) -> Result<Self> {
        let config = model.config();
        let geom = Geom::of(config);
        let group = geom.n_heads / geom.n_kv_heads.max(1);
        let unsupported =
            |what: String| EngineError::Config(format!("the CUDA backend does not support {what}"));
        let decode_kernel = decode_kernel_name(geom.head_dim, group)
            .ok_or_else(|| unsupported(format!("head_dim {} with {group} query heads per KV head (head_dim 16/32/64/128, at most 8 per KV head)", geom.head_dim)))?;
        let prefill_kernel = prefill_kernel_name(geom.head_dim)
            .ok_or_else(|| unsupported(format!("head_dim {}", geom.head_dim)))?;
        if block_size == 0 {
            return Err(EngineError::Config("block_size must be positive".into()));
        }
        let gpu = Gpu::open(ordinal)?;
        let weights = DeviceWeights::upload(model.weights(), &gpu.stream)?;
        let inv_freq = gpu.upload(model.rope_inv_freq())?;
        let (num_blocks, sizing) = match pool.into() {
            KvPool::Blocks(n) => (n, None),
            KvPool::MemoryFraction {
                utilization,
                max_step_tokens,
            } => {
                // Measure once the weights are resident, so they count as in use.
                gpu.stream
                    .synchronize()
                    .map_err(device_err("uploading the model"))?;
                let s = size_from_memory(
                    gpu.memory()?,
                    utilization,
                    step_workspace_bytes(config, max_step_tokens),
                    kv_block_bytes_of(config, block_size, KvDtype::Bf16)?,
                )?;
                (s.num_blocks, Some(s))
            }
        };
        let kv = DeviceKv::new(
            &gpu.stream,
            config.num_hidden_layers,
            num_blocks,
            block_size,
            geom.kv_dim(),
        )?;
        gpu.stream
            .synchronize()
            .map_err(device_err("uploading the model"))?;
        Ok(Self {
            model,
            gpu,
            geom,
            weights,
            inv_freq,
            kv,
            decode_kernel,
            prefill_kernel,
            pending_error: None,
            sizing,
            bufs: StepBuffers::default(),
        })
    }

    /// What the probe found about the device.
    pub fn device_info(&self) -> &DeviceInfo {
        &self.gpu.info
    }

    /// Bytes of device memory held by the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Bytes of device memory held by the step buffers (activations, metadata,
    /// logits): the most any step so far has needed.
    pub fn step_buffer_bytes(&self) -> usize {
        self.bufs.bytes()
    }

    /// Waits for the device to finish queued work (for timing).
    pub fn synchronize(&self) -> Result<()> {
        self.gpu
            .stream
            .synchronize()
            .map_err(device_err("synchronizing"))
    }

    fn forward_inner(&mut self, items: &[ForwardItem<'_>]) -> Result<Vec<Vec<f32>>> {
        if let Some(e) = self.pending_error.take() {
            return Err(e);
        }
        let bs = self.kv.block_size();
        for (i, item) in items.iter().enumerate() {
            self.model
                .check_item_for(i, item, bs, self.kv.num_blocks())?;
        }
        let g = self.geom;
        let plan = plan_step(items, bs, g.window)?;
        let n = plan.n;
        if n == 0 {
            return Ok(vec![Vec::new(); items.len()]);
        }
        let gpu = &self.gpu;
        let (h, qd, kvd) = (g.hidden, g.q_dim(), g.kv_dim());
        let qkv_out = qd + 2 * kvd;

        // Step metadata, one upload each, and the activations: buffers kept across
        // steps (grown when a step is bigger than any before).
        let b = &mut self.bufs;
        let d_tokens = b.tokens.upload(gpu, &plan.tokens)?;
        let d_pos = b.pos.upload(gpu, &plan.pos)?;
        let d_slots = b.slots.upload(gpu, &plan.slots)?;
        let d_table_off = b.table_off.upload(gpu, &plan.table_off)?;
        let d_tables = b.tables.upload(gpu, &plan.tables)?;
        let d_dec_rows = b.dec_rows.upload(gpu, &plan.dec_rows)?;
        let d_tile_row0 = b.tile_row0.upload(gpu, &plan.tile_row0)?;
        let d_tile_rows = b.tile_rows.upload(gpu, &plan.tile_rows)?;
        let d_logit_rows = b.logit_rows.upload(gpu, &plan.logit_rows)?;

        let x = &*b.x.at_least(gpu, n * h)?;
        let hb = &*b.hb.at_least(gpu, n * h)?;
        let qkv = &*b.qkv.at_least(gpu, n * qkv_out)?;
        let attn = &*b.attn.at_least(gpu, n * qd)?;
        let gu = &*b.gu.at_least(gpu, n * 2 * g.inter)?;
        let act = &*b.act.at_least(gpu, n * g.inter)?;
        let n_dec = plan.dec_rows.len();
        let splits = plan.max_dec_keys.div_ceil(DECODE_PARTITION).max(1);
        let part_len = if splits > 1 {
            n_dec * g.n_heads * splits
        } else {
            1
        };
        let part_out = &*b.part_out.at_least(gpu, part_len * g.head_dim)?;
        let part_max = &*b.part_max.at_least(gpu, part_len)?;
        let part_sum = &*b.part_sum.at_least(gpu, part_len)?;

        let p = |s: &CudaSlice<f32>| Arg::Ptr(gpu.ptr(s));
        let pb = |s: &CudaSlice<u16>| Arg::Ptr(gpu.ptr(s));
        let pi = |s: &CudaSlice<i32>| Arg::Ptr(gpu.ptr(s));
        let threads = |w: usize| -> u32 { (w.next_power_of_two().clamp(32, 1024)) as u32 };

        gpu.launch(
            "embed_tokens",
            grid1(n),
            threads(h),
            &[pb(&self.weights.embed), pi(d_tokens), p(x), i32_of(h)],
        )?;
        let add_bias = |y: &CudaSlice<f32>,
                        b: &Option<CudaSlice<f32>>,
                        rows: usize,
                        cols: usize|
         -> Result<()> {
            if let Some(b) = b {
                let blocks = (rows * cols).div_ceil(256).min(65_535);
                gpu.launch(
                    "add_bias",
                    grid1(blocks),
                    256,
                    &[p(y), p(b), i32_of(rows), i32_of(cols)],
                )?;
            }
            Ok(())
        };

        for (li, layer) in self.weights.layers.iter().enumerate() {
            gpu.launch(
                "rms_norm",
                grid1(n),
                threads(h).min(256),
                &[
                    p(x),
                    p(&layer.input_norm),
                    pb(hb),
                    Arg::Ptr(0),
                    i32_of(h),
                    Arg::F32(g.eps),
                ],
            )?;
            gpu.gemm.linear(
                gpu.ptr(hb),
                gpu.ptr(&layer.qkv.w),
                gpu.ptr(qkv),
                n,
                qkv_out,
                h,
                0.0,
            )?;
            add_bias(qkv, &layer.qkv.bias, n, qkv_out)?;
            let (qn, kn) = match &layer.qk_norm {
                Some((q, k)) => (p(q), p(k)),
                None => (Arg::Ptr(0), Arg::Ptr(0)),
            };
            gpu.launch(
                "qk_norm_rope",
                (n as u32, (g.n_heads + g.n_kv_heads) as u32, 1),
                32,
                &[
                    p(qkv),
                    i32_of(qkv_out),
                    i32_of(g.n_heads),
                    i32_of(g.head_dim),
                    qn,
                    kn,
                    Arg::F32(g.eps),
                    pi(d_pos),
                    p(&self.inv_freq),
                ],
            )?;
            let (kc, vc) = (
                self.kv.k_ptr(&gpu.stream, li),
                self.kv.v_ptr(&gpu.stream, li),
            );
            gpu.launch(
                "reshape_and_cache",
                grid1(n),
                threads(kvd).min(256),
                &[
                    p(qkv),
                    i32_of(qkv_out),
                    i32_of(qd),
                    i32_of(qd + kvd),
                    i32_of(kvd),
                    pi(d_slots),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                ],
            )?;
            if n_dec > 0 {
                gpu.launch(
                    &self.decode_kernel,
                    (n_dec as u32, g.n_kv_heads as u32, splits as u32),
                    128,
                    &[
                        pb(attn),
                        i32_of(qd),
                        p(part_out),
                        p(part_max),
                        p(part_sum),
                        p(qkv),
                        i32_of(qkv_out),
                        Arg::Ptr(kc),
                        Arg::Ptr(vc),
                        pi(d_tables),
                        pi(d_table_off),
                        pi(d_pos),
                        pi(d_dec_rows),
                        i32_of(g.n_heads),
                        i32_of(g.n_kv_heads),
                        i32_of(bs),
                        i32_of(g.window),
                        Arg::F32(g.scale),
                    ],
                )?;
                if splits > 1 {
                    gpu.launch(
                        "paged_decode_reduce",
                        (n_dec as u32, g.n_heads as u32, 1),
                        threads(g.head_dim).min(128),
                        &[
                            pb(attn),
                            i32_of(qd),
                            p(part_out),
                            p(part_max),
                            p(part_sum),
                            pi(d_dec_rows),
                            i32_of(g.n_heads),
                            i32_of(g.head_dim),
                            i32_of(splits),
                        ],
                    )?;
                }
            }
            if !plan.tile_row0.is_empty() {
                gpu.launch(
                    &self.prefill_kernel,
                    (plan.tile_row0.len() as u32, g.n_heads as u32, 1),
                    (PREFILL_TILE_ROWS * 32) as u32,
                    &[
                        pb(attn),
                        i32_of(qd),
                        p(qkv),
                        i32_of(qkv_out),
                        Arg::Ptr(kc),
                        Arg::Ptr(vc),
                        pi(d_tables),
                        pi(d_tile_row0),
                        pi(d_tile_rows),
                        pi(d_table_off),
                        pi(d_pos),
                        i32_of(g.n_heads),
                        i32_of(g.n_kv_heads),
                        i32_of(bs),
                        i32_of(g.window),
                        Arg::F32(g.scale),
                    ],
                )?;
            }
            // o_proj straight into the residual stream.
            gpu.gemm.linear(
                gpu.ptr(attn),
                gpu.ptr(&layer.o.w),
                gpu.ptr(x),
                n,
                h,
                qd,
                1.0,
            )?;
            add_bias(x, &layer.o.bias, n, h)?;
            gpu.launch(
                "rms_norm",
                grid1(n),
                threads(h).min(256),
                &[
                    p(x),
                    p(&layer.post_norm),
                    pb(hb),
                    Arg::Ptr(0),
                    i32_of(h),
                    Arg::F32(g.eps),
                ],
            )?;
            gpu.gemm.linear(
                gpu.ptr(hb),
                gpu.ptr(&layer.gate_up.w),
                gpu.ptr(gu),
                n,
                2 * g.inter,
                h,
                0.0,
            )?;
            add_bias(gu, &layer.gate_up.bias, n, 2 * g.inter)?;
            let blocks = (n * g.inter).div_ceil(256).min(65_535);
            gpu.launch(
                "silu_mul",
                grid1(blocks),
                256,
                &[p(gu), pb(act), i32_of(n), i32_of(g.inter)],
            )?;
            gpu.gemm.linear(
                gpu.ptr(act),
                gpu.ptr(&layer.down.w),
                gpu.ptr(x),
                n,
                h,
                g.inter,
                1.0,
            )?;
            add_bias(x, &layer.down.bias, n, h)?;
        }

        let m = plan.logit_rows.len();
        let mut out = Vec::with_capacity(items.len());
        if m == 0 {
            gpu.stream
                .synchronize()
                .map_err(device_err("running the step"))?;
            out.resize(items.len(), Vec::new());
            return Ok(out);
        }
        gpu.launch(
            "rms_norm",
            grid1(m),
            threads(h).min(256),
            &[
                p(x),
                p(&self.weights.norm),
                pb(hb),
                pi(d_logit_rows),
                i32_of(h),
                Arg::F32(g.eps),
            ],
        )?;
        let logits = &*b.logits.at_least(gpu, m * g.vocab)?;
        let head = match &self.weights.lm_head {
            Some(l) => gpu.ptr(&l.w),
            None => gpu.ptr(&self.weights.embed),
        };
        gpu.gemm
            .linear(gpu.ptr(hb), head, gpu.ptr(logits), m, g.vocab, h, 0.0)?;
        let host = gpu.download(logits, m * g.vocab)?;
        let mut r = 0;
        for &k in &plan.logit_counts {
            out.push(host[r * g.vocab..(r + k) * g.vocab].to_vec());
            r += k;
        }
        Ok(out)
    }
}

impl ModelBackend for CudaBackend {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }
    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }
    fn forward(&mut self, items: &[ForwardItem]) -> Result<Vec<Vec<f32>>> {
        self.forward_inner(items)
    }
    fn copy_block(&mut self, src: u32, dst: u32) {
        let nb = self.kv.num_blocks();
        assert!(
            (src as usize) < nb && (dst as usize) < nb,
            "copy_block({src}, {dst}) outside a cache of {nb} blocks"
        );
        if src == dst {
            return;
        }
        let res = (|| -> Result<()> {
            // The pair buffer is reused: the next write to it is ordered after this
            // copy on the one stream, so nothing waits here.
            let pairs = self
                .bufs
                .copy_pairs
                .upload(&self.gpu, &[src as i32, dst as i32])?;
            let (args, grid) = self.kv.copy_args(&self.gpu.stream, self.gpu.ptr(pairs), 1);
            self.gpu.launch("copy_blocks", grid, 256, &args)
        })();
        if let Err(e) = res {
            self.pending_error.get_or_insert(e);
        }
    }
    fn device_name(&self) -> String {
        format!("cuda:{}", self.gpu.info.ordinal)
    }
    fn kv_sizing(&self) -> Option<KvSizing> {
        self.sizing
    }
}
