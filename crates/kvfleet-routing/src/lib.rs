//! kvfleet-routing: the pure routing core. It decides which worker gets a request so
//! that requests sharing a prompt prefix land where that prefix's KV blocks are (or are
//! being computed), without overloading that worker.
//!
//! Pure means: no async runtime, no network, no files, no clock read for a decision
//! (time is an argument in milliseconds). The serving router (`kvfleet-router`), the
//! fleet simulator (`kvfleet-bench`) and the fuzz targets all drive this same code.
//!
//! - [`registry`]: string worker ids ⇄ compact [`registry::WorkerIdx`] slots.
//! - [`events`]: the workers' KV events and cache dumps, as the router applies them.
//! - [`prefix_index`]: the block index — block hash → holding workers, fed by KV events,
//!   answering "how deep does each worker match this prompt" in a few map probes.
//! - [`reservations`]: pending holders — where a prefix *will* be cached because this
//!   router just sent a request there — so fork siblings follow their first sibling.
//! - [`load`]: the load view — each worker's last report plus this router's own
//!   in-flight work.
//! - [`load_order`]: the workers in load order, so `cache-aware` prices the few that
//!   can win, not the whole fleet.
//! - [`policy`]: `cache-aware`, `round-robin`, `least-loaded`, `consistent-hash`,
//!   `random`, behind one [`policy::RoutingPolicy`] trait (the selector seam).
//! - [`kv_router`]: the [`KvRouter`] facade that combines all of the above.
//! - [`seams`]: the traits at the core's edges — [`BlockIndex`] (the indexer),
//!   [`RoutingPolicy`] (the selector) and [`KvEventSink`] (where KV events go in).

pub mod events;
pub mod kv_router;
pub mod load;
pub mod load_order;
pub mod policy;
pub mod prefix_index;
pub mod registry;
pub mod reservations;
pub mod seams;

pub use events::{CacheDump, DumpedBlock, Medium, RouterKvEvent, RouterKvEventKind};
pub use kv_router::{
    KvRouter, Pin, PredictionStats, PullPlan, RebuildStep, RegisterError, RouteDecision,
    RouteError, RouteTimings, RouterConfig, RouterSnapshot, RunningId, UnknownWorker,
    WorkerSnapshot,
};
pub use load::{CandidateLoad, WorkerLoad, USAGE_LEVELS};
pub use policy::{PolicyKind, RoutingPolicy};
pub use prefix_index::{IndexError, Matches, PrefixIndex, TieredMatch, TieredMatches, WorkerMatch};
pub use registry::{WorkerIdx, WorkerRegistry};
pub use reservations::{ReservationId, Reservations};
pub use seams::{BlockIndex, KvEventSink};
