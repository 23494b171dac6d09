//! kvfleet-bench: the tools load-test engineers use to size a fleet and pick a policy.
//!
//! - [`trace`]: the JSONL trace format (a superset of Mooncake's), with a reader that
//!   names the line of any bad record.
//! - [`trace_gen`]: agent sessions with fork fan-out (`kvfleet bench gen`).
//! - [`token_blocks`]: hash id → deterministic tokens (replay) and → chained block
//!   hashes (simulation).
//! - [`bounds`]: the unbounded ceiling and the pooled-LRU bounds (with and without
//!   tiers).
//! - [`sim`]: the discrete-event fleet simulator (`kvfleet sim`) with kvfleet's
//!   policies through the real router core and the SGLang / Dynamo baselines.
//! - [`sweep`]: every policy over a family of generated traces, fleet sizes and loads
//!   (`kvfleet bench sweep`), `cache-aware` checked against the best baseline.
//! - [`tiers`]: host and disk tiers against none, and load-time pricing against
//!   fixed discounts (`kvfleet bench tiers`, docs/kv-tiers.md).
//! - [`replay`]: the HTTP replay client (`kvfleet bench replay`).
//! - [`session_placement`]: session moves and sessions per worker, counted alike by
//!   the simulator and the replay.
//! - [`report`] and [`plots`]: JSON, Markdown and SVG output.
//! - [`usage_trace`]: production usage records → a trace (`kvfleet trace export`).
//! - [`synthetic_load`]: worker loads spread over what a fleet reports, for the
//!   router's benches.

pub mod bounds;
pub mod matrix;
pub mod plots;
pub mod replay;
pub mod report;
pub mod session_placement;
pub mod sim;
pub mod sweep;
pub mod synthetic_load;
pub mod tiers;
pub mod token_blocks;
pub mod trace;
pub mod trace_gen;
pub mod usage_trace;

pub use trace::{Trace, TraceRecord};
