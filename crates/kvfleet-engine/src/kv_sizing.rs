//! How big a worker's KV pool is: the bytes of one block from the model's shape and the
//! KV dtype, and the number of blocks a device-memory budget leaves room for
//! (`--gpu-memory-utilization`, as in vLLM). Pure arithmetic, so it is tested without a
//! GPU; the CUDA backend feeds it the driver's free/total figures.

use std::fmt;

use crate::error::{EngineError, Result};
use crate::model_config::ModelConfig;

/// Element type of the stored keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// bfloat16: the CUDA backend's cache.
    Bf16,
    /// f32: the CPU backend's cache.
    F32,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

/// Bytes of one KV block across every layer: `layers × kv_heads × head_dim × 2 (K and V)
/// × block_size × bytes per element`. `None` when the product overflows.
pub fn kv_block_bytes(
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    dtype: KvDtype,
) -> Option<usize> {
    num_layers
        .checked_mul(num_kv_heads)?
        .checked_mul(head_dim)?
        .checked_mul(2)?
        .checked_mul(block_size)?
        .checked_mul(dtype.bytes())
}

/// [`kv_block_bytes`] for a model configuration.
pub fn kv_block_bytes_of(config: &ModelConfig, block_size: usize, dtype: KvDtype) -> Result<usize> {
    kv_block_bytes(
        config.num_hidden_layers,
        config.num_kv_heads(),
        config.head_dim(),
        block_size,
        dtype,
    )
    .filter(|&b| b > 0)
    .ok_or_else(|| {
        EngineError::Config(format!(
            "a KV block of {block_size} tokens for {} layers × {} KV heads × {} dims has no \
             representable size",
            config.num_hidden_layers,
            config.num_kv_heads(),
            config.head_dim()
        ))
    })
}

/// How a backend's KV pool is sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvPool {
    /// Exactly this many blocks (`--num-blocks`).
    Blocks(usize),
    /// As many blocks as fit once this process holds `utilization` of the device's total
    /// memory (weights, workspace and KV together); CUDA only.
    MemoryFraction {
        /// Fraction of total device memory, in (0, 1].
        utilization: f64,
        /// Most tokens in one step: sizes the activation workspace kept out of the pool.
        max_step_tokens: usize,
    },
}

impl From<usize> for KvPool {
    fn from(num_blocks: usize) -> Self {
        KvPool::Blocks(num_blocks)
    }
}

/// A device's memory as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes not allocated by anyone.
    pub free: usize,
    /// Bytes on the device.
    pub total: usize,
}

/// Device memory kept out of the KV pool besides the step activations: the cuBLAS
/// workspace, split-K decode partials and allocator slack.
pub const WORKSPACE_SLACK_BYTES: usize = 512 << 20;

/// Bytes of the per-step activation buffers for `tokens` rows of `config` (the CUDA
/// backend's residual, normed input, qkv, attention output, gate|up, activation and,
/// conservatively, logits for every row), plus [`WORKSPACE_SLACK_BYTES`].
pub fn step_workspace_bytes(config: &ModelConfig, tokens: usize) -> usize {
    let (h, i) = (config.hidden_size, config.intermediate_size);
    let q = config.num_attention_heads * config.head_dim();
    let kv = config.num_kv_heads() * config.head_dim();
    // f32: residual, qkv, gate|up, logits; bf16: normed input, attention, activation.
    let per_row = 4 * (h + q + 2 * kv + 2 * i + config.vocab_size) + 2 * (h + q + i);
    per_row
        .saturating_mul(tokens)
        .saturating_add(WORKSPACE_SLACK_BYTES)
}

/// The outcome of sizing a pool from device memory, for the start log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvSizing {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Bytes of one block.
    pub block_bytes: usize,
    /// The memory figures sized from.
    pub memory: DeviceMemory,
    /// The fraction of total memory allowed.
    pub utilization: f64,
    /// Bytes kept out of the pool for the step workspace.
    pub reserve: usize,
}

impl KvSizing {
    /// Bytes of the pool.
    pub fn pool_bytes(&self) -> usize {
        self.num_blocks * self.block_bytes
    }
}

fn gib(b: usize) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

impl fmt::Display for KvSizing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} KV blocks of {:.2} MiB ({:.2} GiB): {:.0}% of {:.2} GiB total, {:.2} GiB was \
             free, {:.2} GiB kept for the step workspace",
            self.num_blocks,
            self.block_bytes as f64 / (1u64 << 20) as f64,
            gib(self.pool_bytes()),
            self.utilization * 100.0,
            gib(self.memory.total),
            gib(self.memory.free),
            gib(self.reserve),
        )
    }
}

/// Most blocks a pool may have: block ids are `u32`.
const MAX_BLOCKS: usize = u32::MAX as usize;

/// Sizes a KV pool from device memory measured after the weights are on the device:
/// the process may hold `utilization × total`; what is already in use (`total − free`:
/// weights, context, any other process) and `reserve` come off that, and the rest is
/// whole blocks of `block_bytes`. Errors when not one block fits, saying why.
pub fn size_from_memory(
    memory: DeviceMemory,
    utilization: f64,
    reserve: usize,
    block_bytes: usize,
) -> Result<KvSizing> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(EngineError::Config(format!(
            "--gpu-memory-utilization must be in (0, 1], got {utilization}"
        )));
    }
    if block_bytes == 0 {
        return Err(EngineError::Config("KV block size of 0 bytes".into()));
    }
    if memory.free > memory.total {
        return Err(EngineError::Device(format!(
            "the driver reports {} bytes free of {} total",
            memory.free, memory.total
        )));
    }
    let allowed = (memory.total as f64 * utilization) as usize;
    let in_use = memory.total - memory.free;
    let kv = allowed.saturating_sub(in_use).saturating_sub(reserve);
    let num_blocks = (kv / block_bytes).min(MAX_BLOCKS);
    if num_blocks == 0 {
        return Err(EngineError::Device(format!(
            "no room for the KV cache: --gpu-memory-utilization {utilization} allows {:.2} GiB \
             of {:.2} GiB, {:.2} GiB is in use already (weights, other processes) and {:.2} GiB \
             is kept for the step workspace, leaving less than one {:.2} MiB block; raise \
             --gpu-memory-utilization or pass --num-blocks",
            gib(allowed),
            gib(memory.total),
            gib(in_use),
            gib(reserve),
            block_bytes as f64 / (1u64 << 20) as f64,
        )));
    }
    Ok(KvSizing {
        num_blocks,
        block_bytes,
        memory,
        utilization,
        reserve,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;
    const GIB: usize = 1 << 30;

    #[test]
    fn block_bytes_of_known_models() {
        // Qwen3-8B in bf16: 36 × 8 × 128 × 2 × 16 × 2 = 2.25 MiB.
        assert_eq!(
            kv_block_bytes(36, 8, 128, 16, KvDtype::Bf16),
            Some(9 * MIB / 4)
        );
        // The same block in f32 is twice that (the chart's old 4.5 MiB figure).
        assert_eq!(
            kv_block_bytes(36, 8, 128, 16, KvDtype::F32),
            Some(9 * MIB / 2)
        );
        // SmolLM2-135M in f32: 30 × 3 × 64 × 2 × 16 × 4 = 737,280 bytes.
        assert_eq!(kv_block_bytes(30, 3, 64, 16, KvDtype::F32), Some(737_280));
        assert_eq!(kv_block_bytes(usize::MAX, 2, 1, 1, KvDtype::Bf16), None);
    }

    #[test]
    fn block_bytes_follow_the_config() {
        let mut c = ModelConfig::tiny();
        c.num_hidden_layers = 36;
        c.num_attention_heads = 32;
        c.num_key_value_heads = Some(8);
        c.head_dim = Some(128);
        assert_eq!(
            kv_block_bytes_of(&c, 16, KvDtype::Bf16).ok(),
            Some(9 * MIB / 4)
        );
        c.num_hidden_layers = 0;
        assert!(kv_block_bytes_of(&c, 16, KvDtype::Bf16).is_err());
    }

    #[test]
    fn sizes_what_is_left_of_the_fraction() {
        // 140 GiB device, 16 GiB in use after the weights, 0.9 allowed, 2 GiB reserve:
        // 126 − 16 − 2 = 108 GiB of 2.25 MiB blocks = 49,152 blocks.
        let mem = DeviceMemory {
            free: 124 * GIB,
            total: 140 * GIB,
        };
        let s = size_from_memory(mem, 0.9, 2 * GIB, 9 * MIB / 4).unwrap();
        assert_eq!(s.num_blocks, 108 * 1024 * 4 / 9);
        assert!(s.pool_bytes() <= 108 * GIB);
        assert!(s.to_string().starts_with("49152 KV blocks of 2.25 MiB"));
        // Partial blocks round down.
        let s = size_from_memory(mem, 0.9, 2 * GIB, 3 * GIB).unwrap();
        assert_eq!(s.num_blocks, 36);
    }

    #[test]
    fn memory_of_other_processes_counts_against_the_fraction() {
        // Half the device taken by someone else: 0.9 leaves 0.4 of it, minus the reserve.
        let mem = DeviceMemory {
            free: 40 * GIB,
            total: 80 * GIB,
        };
        let s = size_from_memory(mem, 0.9, 0, GIB).unwrap();
        assert_eq!(s.num_blocks, 32);
        // 0.5 leaves nothing: a clear error, not a zero-block pool.
        let e = size_from_memory(mem, 0.5, 0, GIB).unwrap_err().to_string();
        assert!(e.contains("no room for the KV cache"), "{e}");
        assert!(e.contains("--num-blocks"), "{e}");
    }

    #[test]
    fn rejects_bad_inputs() {
        let mem = DeviceMemory {
            free: 10 * GIB,
            total: 10 * GIB,
        };
        for u in [0.0, -0.1, 1.01, f64::NAN] {
            assert!(size_from_memory(mem, u, 0, MIB).is_err(), "{u}");
        }
        assert!(size_from_memory(mem, 0.9, 0, 0).is_err());
        let bad = DeviceMemory {
            free: 11 * GIB,
            total: 10 * GIB,
        };
        assert!(size_from_memory(bad, 0.9, 0, MIB).is_err());
        // The whole device at 1.0.
        assert_eq!(
            size_from_memory(mem, 1.0, 0, MIB).unwrap().num_blocks,
            10 * 1024
        );
    }

    #[test]
    fn block_count_is_capped_at_u32_ids() {
        let mem = DeviceMemory {
            free: usize::MAX / 2,
            total: usize::MAX / 2,
        };
        assert_eq!(
            size_from_memory(mem, 1.0, 0, 1).unwrap().num_blocks,
            u32::MAX as usize
        );
    }

    #[test]
    fn workspace_grows_with_step_tokens() {
        let c = ModelConfig::tiny();
        let one = step_workspace_bytes(&c, 1);
        assert!(one > WORKSPACE_SLACK_BYTES);
        assert_eq!(
            step_workspace_bytes(&c, 2048) - WORKSPACE_SLACK_BYTES,
            2048 * (one - WORKSPACE_SLACK_BYTES)
        );
    }
}
