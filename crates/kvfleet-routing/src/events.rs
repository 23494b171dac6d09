//! The workers' KV event vocabulary as the router uses it.
//!
//! The router stays free of the model and its engine, so it takes these types from
//! `kvfleet-core`, where the engine takes them too: one definition, no conversion.

pub use kvfleet_core::kv_events::{CacheDump, DumpedBlock, Medium};

/// One KV event with its per-worker sequence number (1, 2, 3, … without gaps).
pub type RouterKvEvent = kvfleet_core::kv_events::KvEvent;

/// What changed in one worker's prefix cache.
pub type RouterKvEventKind = kvfleet_core::kv_events::KvEventKind;
