//! kvfleet-router: routes each request to the worker that already holds (or is about
//! to hold) the KV cache of its prompt prefix, without overloading that worker.
//!
//! The pure core (no I/O, no async, no clocks other than arguments) is:
//!
//! - [`registry`]: string worker ids ⇄ compact [`registry::WorkerIdx`] slots.
//! - [`events`]: the router's mirror of the workers' KV events and cache dumps.
//! - [`prefix_index`]: block hash → holding workers, fed by KV events, answering
//!   "how deep does each worker match this prompt" in a few map probes.
//! - [`reservations`]: pending holders — where a prefix *will* be cached because this
//!   router just sent a request there — so fork siblings follow their first sibling.
//! - [`load`]: per-worker load snapshots plus this router's own in-flight work.
//! - [`policy`]: `cache-aware`, `round-robin`, `least-loaded`, `consistent-hash`,
//!   `random`, behind one [`policy::RoutingPolicy`] trait.
//! - [`kv_router`]: the [`KvRouter`] facade that combines all of the above.
//!
//! Around it, the serving side:
//!
//! - [`incremental_tokenizer`]: per-conversation token memo, so a new turn tokenizes
//!   only its tail.
//! - [`circuit_breaker`]: per-worker breaker that takes failing workers out of routing.
//! - [`prompt_model`]: the tokenizer and chat template of the served model.
//! - [`worker_conn`]: a gRPC connection to one worker.
//! - [`fleet`]: the live fleet — supervisors that follow each worker's KV events and
//!   load, keeping the [`KvRouter`] current.
//! - [`prefix_breaks`] and [`sessions`]: per-session memory and the diagnostics that
//!   name what broke a conversation's prefix cache.
//! - [`agent_status`]: the status bar's request fields and server-observed values.
//! - [`control_hooks`]: where a control plane (placement shared by several routers,
//!   usage records) joins the request path.
//! - [`decision_log`]: the bounded log of recent decisions behind `/dashboard`.
//! - [`dispatch`]: route a request, start it on a worker, retry while not started.
//! - [`tenants`] and [`admission`]: API keys, tenants and their cache namespaces,
//!   and the limits a request is admitted under.
//! - [`openai`] and [`http_front`]: the OpenAI-compatible HTTP API.
//! - [`fleet_metrics`]: the Prometheus metrics.

pub mod admission;
pub mod agent_status;
pub mod circuit_breaker;
pub mod control_hooks;
pub mod decision_log;
pub mod dispatch;
pub mod events;
pub mod fleet;
pub mod fleet_metrics;
pub mod http_front;
pub mod incremental_tokenizer;
pub mod kv_router;
pub mod load;
pub mod openai;
pub mod policy;
pub mod prefix_breaks;
pub mod prefix_index;
pub mod prompt_model;
pub mod registry;
pub mod reservations;
pub mod sessions;
pub mod tenants;
pub mod worker_conn;

pub use events::{CacheDump, RouterKvEvent, RouterKvEventKind};
pub use fleet::{Fleet, FleetConfig};
pub use kv_router::{
    KvRouter, PredictionStats, RegisterError, RouteDecision, RouteError, RouteTimings,
    RouterConfig, RouterSnapshot, UnknownWorker, WorkerSnapshot,
};
pub use load::WorkerLoad;
pub use policy::{PolicyKind, RoutingPolicy};
pub use prefix_index::{IndexError, Matches, PrefixIndex, WorkerMatch};
pub use registry::{WorkerIdx, WorkerRegistry};
pub use reservations::{ReservationId, Reservations};
