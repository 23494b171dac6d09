//! The engine's default step budget: how many tokens one step of continuous batching
//! runs, and how many of them one prompt may take. Shared by the engine's
//! configuration and the fleet simulator, which runs the prefills that fit one step
//! together as the engine does (`kvfleet sim --mixed-steps`).

/// Most tokens one engine step runs: decode rows and prefill chunks together.
pub const DEFAULT_MAX_BATCHED_TOKENS: usize = 2048;

/// Most prompt tokens one sequence runs in one step, so that several prefills advance
/// together instead of one long prompt taking the whole budget.
pub const DEFAULT_MAX_PREFILL_CHUNK: usize = 1024;
