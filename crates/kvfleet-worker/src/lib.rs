//! kvfleet-worker: one worker of the fleet — the engine behind the `kvfleet.v1.Worker`
//! gRPC service, publishing its KV cache events to routers.
//!
//! - `engine_loop` (private): the OS thread that owns the synchronous engine and
//!   serves a bounded queue of `commands`; `outbox` holds what a slow client has not
//!   taken yet; `engine_metrics` records the worker's metrics; `engine_state` is what the engine
//!   publishes for `Load` and `Abort` (all private).
//! - [`engine_health`]: whether the engine thread still runs, [`EngineHealth`].
//! - [`event_log`]: the engine's KV event sink, a bounded replay ring and live fan-out.
//! - [`service`]: the tonic service, [`WorkerService`].
//! - [`server`]: [`serve`] on a listener, or [`spawn_worker`] on a loopback port.
//! - [`config`]: [`WorkerConfig`], the model and the pool and batching sizes.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvfleet_worker::WorkerError> {
//! let worker = kvfleet_worker::spawn_worker(kvfleet_worker::WorkerConfig::new("w0", "tiny")).await?;
//! println!("worker {} at {}", worker.worker_id(), worker.endpoint());
//! worker.shutdown().await
//! # }
//! ```

#![warn(missing_docs)]

mod commands;
pub mod config;
pub mod control_plane;
mod convert;
pub mod engine_health;
mod engine_loop;
mod engine_metrics;
mod engine_state;
pub mod error;
pub mod event_log;
mod outbox;
pub mod peer_pull;
pub mod server;
pub mod service;
mod tier_metrics;

pub use config::{EngineFaults, WorkerConfig, WorkerModel};
pub use engine_health::{EngineHealth, EngineStatus};
pub use engine_metrics::describe_metrics;
pub use error::WorkerError;
pub use event_log::{EventLog, SubscribeError, Subscription};
pub use server::{
    serve, serve_service, serve_service_tls, spawn_worker, spawn_worker_on, WorkerHandle,
};
pub use service::{
    EventStreamCloser, ForkStream, GenerateStream, KvEventStream, WorkerService, MAX_FORK_CHILDREN,
};
pub use tier_metrics::describe_tier_metrics;
