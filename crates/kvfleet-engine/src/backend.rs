//! The seam between scheduling and compute: a backend runs one batched forward step
//! over its own KV memory. The CPU backend is candle-based; a CUDA backend plugs in
//! behind the same trait.

use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::kv_sizing::KvSizing;
use crate::model::{ForwardItem, LlamaModel};
use crate::model_config::ModelConfig;
use std::sync::Arc;

/// Runs model steps over a paged KV cache it owns.
pub trait ModelBackend: Send {
    /// The model's architecture.
    fn config(&self) -> &ModelConfig;
    /// Number of KV blocks in this backend's memory.
    fn num_blocks(&self) -> usize;
    /// One batched step (see [`LlamaModel::forward`]).
    fn forward(&mut self, items: &[ForwardItem]) -> Result<Vec<Vec<f32>>>;
    /// Copies one block's K/V (all layers) into another: copy-on-write for forks.
    fn copy_block(&mut self, src: u32, dst: u32);
    /// Short name for logs and metrics ("cpu", "cuda:0").
    fn device_name(&self) -> String;
    /// How the pool was sized from device memory, when it was (for the start log).
    fn kv_sizing(&self) -> Option<KvSizing> {
        None
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
}
