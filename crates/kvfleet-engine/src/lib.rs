//! kvfleet-engine: the worker's compute engine, built so a shared prefix costs
//! nothing the second time.
//!
//! - [`block_pool`]: fixed KV blocks, reference counted and addressed by chained hash,
//!   with an LRU free list whose blocks stay cached until reused.
//! - [`block_export`]: copying ready blocks out for a peer from another thread while
//!   the engine steps.
//! - [`scheduler`]: continuous batching with chunked prefill, prefix reuse at
//!   admission, in-flight sharing, and preemption by recompute.
//! - [`decode_reserve`]: the room kept for what running sequences will still
//!   generate, so that admissions do not make them preempt each other (it lives in
//!   kvfleet-core, where the fleet simulator models the same admissions).
//! - [`engine`]: one step = schedule, batched forward, sample, publish KV events.
//! - [`gguf`]: GGUF model files (config from metadata, weights kept quantized).
//! - [`model`]: a Llama-family decoder on candle-core whose attention reads K/V
//!   through block tables ([`kv_cache`]).
//! - [`device`]: `--device cpu|cuda:N` and the backend built for it; the CUDA
//!   backend itself is in `cuda` (feature `cuda`).
//! - [`gguf_tokenizer`]: the tokenizer and chat template of a GGUF file.
//! - [`kv_sizing`]: bytes of a KV block and how many blocks a device-memory budget
//!   holds (`--gpu-memory-utilization`).
//! - [`constrained`]: the structured-output hook, a per-sequence llguidance token
//!   mask applied to the logits before sampling.
//! - [`kv_events`]: `Stored` / `Removed` / `Cleared` events with sequence numbers.
//! - [`pins`]: prefix blocks pinned for a TTL (never evicted until it ends), under a
//!   cap on the pool's share.
//! - [`kv_tiers`]: host-memory and disk tiers below the pool: evicted blocks are
//!   demoted there and promoted back on a hit instead of being recomputed.
//! - [`sim_backend`]: a backend whose steps sleep as long as a cost model says instead
//!   of computing (`kvfleet worker --engine sim`), for load tests of real fleets.

pub mod backend;
pub mod block_export;
pub mod block_pool;
pub mod constrained;
#[cfg(feature = "cuda")]
pub mod cuda;
pub use kvfleet_core::decode_reserve;
pub mod device;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod kv_cache;
pub mod kv_events;
pub mod kv_sizing;
pub mod kv_tiers;
pub mod model;
pub mod model_cache;
pub mod model_config;
pub mod model_source;
pub mod pins;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod sim_backend;
pub mod stop_matcher;
pub mod throughput;

pub use backend::{CpuBackend, ModelBackend, StepShape};
pub use block_export::{BlockExporter, KvBlockReader};
pub use decode_reserve::DecodeReserveConfig;
pub use device::{new_backend, Device};
pub use engine::{
    Completion, Engine, EngineConfig, EngineLoad, EngineStats, ForkChild, ForkRequest, PinClock,
    ProgressGuard, Request, StepOutput, DEFAULT_PIN_POOL_FRACTION, MAX_IDLE_STEPS,
};
pub use error::{EngineError, Result};
pub use gguf::{GgufFile, GgufLoadOptions};
pub use kv_events::{DumpedBlock, KvEvent, KvEventKind, KvEventSink, Medium, RecordingSink};
pub use kv_sizing::{KvPool, KvSizing};
pub use kv_tiers::{DiskTierConfig, KvBlockPayload, TierConfig, TierStats};
pub use model::{ForwardItem, LlamaModel, LogitsRequest};
pub use model_config::ModelConfig;
pub use model_source::{
    load_model, load_prompt_model, load_sim_model, LoadedModel, PromptSide, SimModel,
};
pub use pins::{PinOutcome, PinRefusal, PinSpec, MAX_PIN_TTL};
pub use sampling::{token_logprobs, Sampler, SamplingParams, TokenLogprobs};
pub use sequence::{FinishReason, PromotedTokens, RequestId};
pub use sim_backend::SimBackend;
