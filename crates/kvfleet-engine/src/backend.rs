//! The seam between scheduling and compute: a backend runs one batched forward step
//! over its own KV memory. The CPU backend is candle-based; a CUDA backend plugs in
//! behind the same trait.

use crate::block_export::KvBlockReader;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::kv_sizing::KvSizing;
use crate::model::{ForwardItem, LlamaModel};
use crate::model_config::ModelConfig;
use std::sync::Arc;

/// What one engine step computes, counted by the engine (which knows each sequence's
/// prompt length): backends that price a step instead of computing it
/// ([`crate::sim_backend::SimBackend`]) need it; the others ignore it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Prompt tokens computed (prefill chunks, recomputed ones included).
    pub prefill_tokens: usize,
    /// Sequences whose prompt's last chunk runs in this step.
    pub prompts_finished: usize,
    /// Sequences computing one generated token.
    pub decode_rows: usize,
}

/// Runs model steps over a paged KV cache it owns.
pub trait ModelBackend: Send {
    /// The model's architecture.
    fn config(&self) -> &ModelConfig;
    /// Number of KV blocks in this backend's memory.
    fn num_blocks(&self) -> usize;
    /// One batched step (see [`LlamaModel::forward`]).
    fn forward(&mut self, items: &[ForwardItem]) -> Result<Vec<Vec<f32>>>;
    /// One batched step, told its [`StepShape`]; the engine calls this one. Backends
    /// that compute ignore the shape.
    fn forward_step(&mut self, items: &[ForwardItem], shape: StepShape) -> Result<Vec<Vec<f32>>> {
        let _ = shape;
        self.forward(items)
    }
    /// Copies one block's K/V (all layers) into another: copy-on-write for forks.
    fn copy_block(&mut self, src: u32, dst: u32);
    /// Short name for logs and metrics ("cpu", "cuda:0").
    fn device_name(&self) -> String;
    /// How the pool was sized from device memory, when it was (for the start log).
    fn kv_sizing(&self) -> Option<KvSizing> {
        None
    }
    /// The byte format of [`ModelBackend::read_block`]'s output ("f32le", "bf16le"):
    /// tiers and peers only exchange blocks of the same format and size.
    fn block_format(&self) -> &'static str {
        "none"
    }
    /// Bytes of one block's K/V across every layer, in [`ModelBackend::block_format`].
    fn block_bytes(&self) -> usize {
        0
    }
    /// Copies one block's K/V (all layers) out, for a lower tier or a peer. Backends
    /// that cannot read their KV memory back return an error (tiers stay off).
    fn read_block(&mut self, id: u32) -> Result<Vec<u8>> {
        let _ = id;
        Err(crate::error::EngineError::Config(format!(
            "the {} backend cannot copy KV blocks out (no host/disk tier, no peer transfer)",
            self.device_name()
        )))
    }
    /// A reader of this backend's KV memory for other threads, when it has one: peers'
    /// `FetchBlocks` are then served without waiting for the step in progress.
    fn block_reader(&self) -> Option<Arc<dyn KvBlockReader>> {
        None
    }
    /// Overwrites one block's K/V with bytes [`ModelBackend::read_block`] produced
    /// (same format and length, checked by the caller).
    fn write_block(&mut self, id: u32, bytes: &[u8]) -> Result<()> {
        let _ = (id, bytes);
        Err(crate::error::EngineError::Config(format!(
            "the {} backend cannot copy KV blocks in",
            self.device_name()
        )))
    }
}

/// The model on the CPU, with its KV cache in host memory.
pub struct CpuBackend {
    model: Arc<LlamaModel>,
    kv: KvCache,
}

impl CpuBackend {
    /// A backend with `num_blocks` blocks of `block_size` tokens.
    pub fn new(model: Arc<LlamaModel>, num_blocks: usize, block_size: usize) -> Self {
        let kv = model.new_kv_cache(num_blocks, block_size);
        CpuBackend { model, kv }
    }

    /// The model this backend runs.
    pub fn model(&self) -> &Arc<LlamaModel> {
        &self.model
    }
}

impl ModelBackend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }
    fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }
    fn forward(&mut self, items: &[ForwardItem]) -> Result<Vec<Vec<f32>>> {
        self.model.forward(items, &mut self.kv)
    }
    fn copy_block(&mut self, src: u32, dst: u32) {
        self.kv.copy_block(src, dst);
    }
    fn device_name(&self) -> String {
        "cpu".to_string()
    }
    fn block_format(&self) -> &'static str {
        "f32le"
    }
    fn block_bytes(&self) -> usize {
        self.kv.bytes_per_block()
    }
    fn read_block(&mut self, id: u32) -> Result<Vec<u8>> {
        self.kv.read_block(id)
    }
    fn block_reader(&self) -> Option<Arc<dyn KvBlockReader>> {
        Some(self.kv.reader())
    }
    fn write_block(&mut self, id: u32, bytes: &[u8]) -> Result<()> {
        self.kv.write_block(id, bytes)
    }
}
