//! kvfleet-router: the serving router. It takes OpenAI-compatible HTTP requests,
//! tokenizes them, asks the pure routing core ([`kvfleet_routing`]) which worker holds
//! (or is about to hold) the prompt's prefix, and streams the answer back from that
//! worker over gRPC.
//!
//! The [`Fleet`] is assembled from parts that each own one concern:
//!
//! - [`routing_state`]: the routing core behind a lock no guard of which leaves it.
//! - [`supervision`]: worker connections ([`worker_conn`]), circuit breakers
//!   ([`circuit_breaker`]), following each worker's KV events and load (and its
//!   KV-tier totals, [`worker_tiers`]).
//! - [`sessions`] and [`prefix_breaks`]: per-session memory and the diagnostics that
//!   name what broke a conversation's prefix cache.
//! - [`decision_log`]: the bounded log of recent decisions behind `/dashboard`.
//! - [`tokenizer_memo`] and [`prompt_model`]: the served model's tokenizer and chat
//!   template, and the conversation memo that tokenizes only a new turn's tail.
//! - [`pin_table`]: pinned prefixes (which worker, until when) and each tenant's pin
//!   budget.
//! - [`control_hooks`]: where a control plane (placement shared by several routers,
//!   usage records) joins the request path; [`control_plane`] is the etcd/Kafka
//!   implementation of it; [`placement_claims`] keeps one claim per key in flight.
//!
//! On top of the fleet, the request path:
//!
//! - [`dispatch`]: route a request, start it on a worker, retry while not started.
//! - [`tenants`] and [`admission`]: API keys, tenants and their cache namespaces,
//!   and the limits a request is admitted under.
//! - [`agent_status`]: the status bar's server-observed values.
//! - [`openai`] and [`http_front`]: the OpenAI-compatible HTTP API.
//! - [`fleet_metrics`]: the Prometheus metrics; [`wall_clock`]: Unix time.

pub mod admission;
pub mod agent_status;
pub mod circuit_breaker;
pub mod control_hooks;
pub mod control_plane;
pub mod decision_log;
pub mod dispatch;
pub mod fleet;
pub mod fleet_metrics;
pub mod http_front;
pub mod openai;
pub mod pin_table;
pub mod placement_claims;
pub mod prefix_breaks;
pub mod prompt_model;
pub mod routing_state;
pub mod sessions;
pub mod supervision;
pub mod tenants;
pub mod tokenizer_memo;
pub mod wall_clock;
pub mod worker_conn;
pub mod worker_tiers;

pub use fleet::{Fleet, FleetConfig};
// Part of `FleetConfig`'s public surface.
pub use kvfleet_routing::policy::{
    default_peer_pull_min_blocks, CacheAwareConfig, PullTrigger, TierCostConfig,
};
pub use kvfleet_routing::{PolicyKind, RouterConfig};
