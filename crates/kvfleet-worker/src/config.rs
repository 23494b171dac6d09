//! How a worker is set up: which model, how big its KV block pool is, how the engine
//! batches, and how many KV events it keeps for late subscribers.

use crate::error::WorkerError;
use kvfleet_engine::{Device, EngineConfig, KvPool, LoadedModel, SimModel, TierConfig};
use std::time::Duration;

/// Faults the engine thread injects on purpose, for fault tests only (set directly, or
/// through the hidden `--fault-*` flags of `kvfleet worker`). The default injects none.
#[derive(Clone, Debug, Default)]
pub struct EngineFaults {
    /// Sleep this long before every engine step (a slow prefill on a real model).
    pub step_delay: Option<Duration>,
    /// Panic on the engine thread once this many engine steps have run (an engine
    /// bug), before the next step: the worker must leave routing and exit.
    pub panic_after_steps: Option<u64>,
    /// Exit the process (as if killed) after sending this many blocks of a
    /// `FetchBlocks` stream: a peer dying mid-transfer.
    pub exit_mid_fetch_after: Option<usize>,
}

/// The model a worker serves.
#[derive(Clone)]
pub enum WorkerModel {
    /// A `--model` argument (`tiny`, `small`, or a Hugging Face directory), loaded by
    /// the worker's engine thread with [`kvfleet_engine::load_model`].
    Spec(String),
    /// A model already loaded; several in-process workers can share its weights.
    Loaded(LoadedModel),
    /// No model: the simulated engine (`--engine sim`), whose steps sleep as long as
    /// its cost model says instead of computing. Boxed: a model config and a cost model
    /// are much larger than the other variants.
    Simulated(Box<SimModel>),
}

impl std::fmt::Debug for WorkerModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerModel::Spec(s) => f.debug_tuple("Spec").field(s).finish(),
            WorkerModel::Loaded(m) => f.debug_tuple("Loaded").field(&m.id).finish(),
            WorkerModel::Simulated(m) => f
                .debug_tuple("Simulated")
                .field(&m.prompt.id)
                .field(&m.cost.name)
                .finish(),
        }
    }
}

impl From<&str> for WorkerModel {
    fn from(spec: &str) -> Self {
        WorkerModel::Spec(spec.to_string())
    }
}

impl From<String> for WorkerModel {
    fn from(spec: String) -> Self {
        WorkerModel::Spec(spec)
    }
}

impl From<SimModel> for WorkerModel {
    fn from(model: SimModel) -> Self {
        WorkerModel::Simulated(Box::new(model))
    }
}

impl From<LoadedModel> for WorkerModel {
    fn from(model: LoadedModel) -> Self {
        WorkerModel::Loaded(model)
    }
}

/// Everything a worker needs to start. Build it with [`WorkerConfig::new`] and adjust
/// the public fields.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// This worker's id: reported in `Info`, `Load`, every KV event batch, and as the
    /// `worker` label of its metrics.
    pub worker_id: String,
    /// The model to serve.
    pub model: WorkerModel,
    /// The device the model runs on (`cpu`, the default, or `cuda:N`).
    pub device: Device,
    /// KV blocks in the pool (on a CUDA device, unless `gpu_memory_utilization` is set).
    pub num_blocks: usize,
    /// On a CUDA device, size the pool from device memory instead of `num_blocks`: the
    /// fraction of total device memory the process may hold once this worker's pool is
    /// allocated (weights, workspace and KV; as vLLM's `--gpu-memory-utilization`).
    /// Ignored on the CPU.
    pub gpu_memory_utilization: Option<f64>,
    /// Tokens per KV block; routers must hash with the same size.
    pub block_size: usize,
    /// Most sequences the engine runs at once.
    pub max_num_seqs: usize,
    /// Most tokens per engine step (the chunked-prefill budget).
    pub max_batched_tokens: usize,
    /// Most prompt tokens one sequence runs per step.
    pub max_prefill_chunk: usize,
    /// The room the engine keeps for what running sequences will still generate.
    pub decode_reserve: kvfleet_engine::DecodeReserveConfig,
    /// KV events kept in memory for `KvEvents` replay; a subscriber asking for an
    /// older event must resync with `CacheDump`.
    pub event_ring_capacity: usize,
    /// Live KV events buffered per subscriber before it counts as lagging (it then
    /// continues from the ring, or is told to resync when the ring has moved on).
    pub event_subscriber_buffer: usize,
    /// Commands (new requests, aborts, load queries) queued for the engine thread;
    /// beyond it `Generate` answers RESOURCE_EXHAUSTED.
    pub command_queue_capacity: usize,
    /// Messages buffered per `Generate` stream; a slower client gets its tokens
    /// coalesced into fewer messages, never dropped.
    pub stream_buffer: usize,
    /// Faults to inject (tests only; none by default).
    pub faults: EngineFaults,
    /// Host and disk tiers below the KV pool (none by default).
    pub kv_tiers: TierConfig,
    /// TLS for pulling blocks from `https://` peers (`FetchBlocks`).
    pub peer_tls: Option<tonic::transport::ClientTlsConfig>,
    /// The share of the KV pool pinned prefixes may hold (0 to 1); a pin past it is
    /// refused and its request served unpinned.
    pub pin_pool_fraction: f64,
}

impl WorkerConfig {
    /// A configuration with the engine's default batching, 2,048 blocks, and a ring
    /// of 65,536 events.
    pub fn new(worker_id: impl Into<String>, model: impl Into<WorkerModel>) -> Self {
        let engine = EngineConfig::default();
        WorkerConfig {
            worker_id: worker_id.into(),
            model: model.into(),
            device: Device::Cpu,
            num_blocks: 2048,
            gpu_memory_utilization: None,
            block_size: engine.block_size,
            max_num_seqs: engine.max_num_seqs,
            max_batched_tokens: engine.max_batched_tokens,
            max_prefill_chunk: engine.max_prefill_chunk,
            decode_reserve: engine.decode_reserve,
            event_ring_capacity: 65_536,
            event_subscriber_buffer: 4096,
            command_queue_capacity: 1024,
            stream_buffer: 64,
            faults: EngineFaults::default(),
            kv_tiers: TierConfig::default(),
            peer_tls: None,
            pin_pool_fraction: kvfleet_engine::DEFAULT_PIN_POOL_FRACTION,
        }
    }

    /// Rejects sizes the worker cannot run with (the engine checks its own).
    pub fn validate(&self) -> Result<(), WorkerError> {
        let positive = [
            ("num_blocks", self.num_blocks),
            ("event_ring_capacity", self.event_ring_capacity),
            ("event_subscriber_buffer", self.event_subscriber_buffer),
            ("command_queue_capacity", self.command_queue_capacity),
            ("stream_buffer", self.stream_buffer),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(WorkerError::Config(format!("{name} must be positive")));
            }
        }
        if let Some(u) = self.gpu_memory_utilization {
            if !(u > 0.0 && u <= 1.0) {
                return Err(WorkerError::Config(format!(
                    "gpu_memory_utilization must be in (0, 1], got {u}"
                )));
            }
        }
        self.decode_reserve
            .validate()
            .map_err(WorkerError::Config)?;
        if !(0.0..=1.0).contains(&self.pin_pool_fraction) {
            return Err(WorkerError::Config(format!(
                "pin_pool_fraction must be in [0, 1], got {}",
                self.pin_pool_fraction
            )));
        }
        if self.worker_id.is_empty() {
            return Err(WorkerError::Config("worker_id must not be empty".into()));
        }
        Ok(())
    }

    /// How the backend sizes its KV pool on this worker's device.
    pub(crate) fn kv_pool(&self) -> KvPool {
        match (self.device, self.gpu_memory_utilization) {
            (Device::Cuda(_), Some(utilization)) => KvPool::MemoryFraction {
                utilization,
                max_step_tokens: self.max_batched_tokens,
            },
            _ => KvPool::Blocks(self.num_blocks),
        }
    }

    /// The engine configuration for `model_id`.
    pub(crate) fn engine_config(&self, model_id: &str) -> EngineConfig {
        EngineConfig {
            model_id: model_id.to_string(),
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_prefill_chunk: self.max_prefill_chunk,
            decode_reserve: self.decode_reserve,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_fraction_sizes_cuda_pools_only() {
        let mut c = WorkerConfig::new("w", "tiny");
        c.num_blocks = 64;
        c.max_batched_tokens = 512;
        c.gpu_memory_utilization = Some(0.8);
        // The CPU always takes the block count.
        assert_eq!(c.kv_pool(), KvPool::Blocks(64));
        c.device = Device::Cuda(1);
        assert_eq!(
            c.kv_pool(),
            KvPool::MemoryFraction {
                utilization: 0.8,
                max_step_tokens: 512
            }
        );
        // An explicit count (no fraction) wins on CUDA too.
        c.gpu_memory_utilization = None;
        assert_eq!(c.kv_pool(), KvPool::Blocks(64));
    }

    #[test]
    fn rejects_a_fraction_outside_zero_to_one() {
        let mut c = WorkerConfig::new("w", "tiny");
        for bad in [0.0, 1.5, -1.0, f64::NAN] {
            c.gpu_memory_utilization = Some(bad);
            assert!(c.validate().is_err(), "{bad}");
        }
        c.gpu_memory_utilization = Some(1.0);
        assert!(c.validate().is_ok());
    }

    #[test]
    fn rejects_a_decode_reserve_ratio_outside_zero_to_one() {
        let mut c = WorkerConfig::new("w", "tiny");
        for bad in [1.5, -0.1, f64::NAN] {
            c.decode_reserve.init_ratio = bad;
            let e = c.validate().expect_err("rejected");
            assert!(e.to_string().contains("decode reserve"), "{e}");
        }
        c.decode_reserve = kvfleet_engine::DecodeReserveConfig::off();
        assert!(c.validate().is_ok());
    }
}
