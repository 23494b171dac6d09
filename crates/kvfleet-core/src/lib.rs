//! kvfleet-core: the pure vocabulary every other kvfleet crate shares.
//!
//! It defines token ids, the chained block hash that names a cached prefix (see
//! `block_hash`), tokenizers, and deterministic chat rendering. No network I/O happens
//! here; the only file reads are the loaders of a model's tokenizer and chat template
//! (`HfTokenizer::from_dir`, `ChatTemplate::from_tokenizer_config`).
//!
//! Also here, because they are pure and both the serving router and the fuzz targets
//! need them: the OpenAI request/response bodies ([`openai`]) and the incremental
//! tokenizer's conversation memo ([`incremental_tokenizer`]). And a worker's cost model
//! ([`cost_model`]), shared by the fleet simulator and the simulated engine; reading
//! its JSON file is this crate's one other file read. Likewise the engine scheduler's
//! decode reserve ([`decode_reserve`]), which the simulator's engine memory model
//! follows, and its default step budget ([`step_budget`]), by which the simulator
//! batches prefills.

pub mod anthropic;
pub mod block_hash;
pub mod byte_lru;
pub mod chat;
pub mod cost_model;
pub mod decode_reserve;
pub mod incremental_tokenizer;
pub mod kv_events;
pub mod openai;
pub mod step_budget;
pub mod structured_output;
pub mod sync;
pub mod tokenizer;
pub mod tokens;

pub use block_hash::{
    chain_hash, extend_block_hashes, hash_blocks, namespace_seed, BlockHash, BlockHashMap,
    DEFAULT_BLOCK_SIZE,
};
pub use chat::{ChatError, ChatMessage, ChatTemplate, Role, ToolDefinition};
pub use cost_model::{CostModel, CostModelError};
pub use step_budget::{DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_MAX_PREFILL_CHUNK};
pub use tokenizer::{ByteTokenizer, HfTokenizer, StreamDecoder, Tokenizer, TokenizerError};
pub use tokens::{blocks_needed, blocks_to_start, full_blocks, TokenId};
