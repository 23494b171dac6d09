//! kvfleet-control: the control plane of a kvfleet cluster that runs as separate
//! router and worker processes.
//!
//! - [`Membership`]: workers register under a lease kept alive while they live; the
//!   lease's expiry removes them. Routers list and watch the members from a revision.
//! - [`Placement`]: which worker owns a prefix root or fork group, created once with a
//!   compare-and-set (create-if-absent) and a TTL, so every router replica agrees.
//! - [`EventStream`]: KV events and usage records, keyed by worker, with offsets that
//!   consumer groups commit and resume from.
//!
//! Each trait has an in-process implementation (the embedded default, [`memory`]) and a
//! real one: membership and placement on etcd ([`etcd`]), the event stream on Kafka
//! ([`kafka`]). Membership and placement are written once, over the small [`KvStore`]
//! abstraction (leases, compare-and-set, watch from a revision), which the in-process
//! store and etcd both implement with the same semantics.

#![warn(missing_docs)]

pub mod config;
pub mod error;
pub mod etcd;
pub mod events;
pub mod kafka;
pub mod kv;
pub mod membership;
pub mod memory;
pub mod placement;
#[cfg(feature = "test-services")]
pub mod test_services;
pub mod usage;
pub mod watch;

pub use config::ControlConfig;
pub use error::{ControlError, Result};
pub use events::{
    decode_kv_events, encode_kv_events, EventStream, KvEventEnvelope, Record, StartAt,
    Subscription, Topic, Topics,
};
pub use kv::{CasOutcome, KvChange, KvChangeKind, KvStore};
pub use membership::{
    KvMembership, MemberEvent, MemberSnapshot, Membership, Registration, WorkerRecord,
};
pub use placement::{KvPlacement, Placement, PlacementEvent, PlacementKey, PlacementKind};
pub use usage::UsageRecord;
pub use watch::WatchStream;

use std::time::Duration;

/// Default time a network call may take before it fails with [`ControlError::Timeout`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Default lease TTL of a worker's registration.
pub const DEFAULT_MEMBER_TTL: Duration = Duration::from_secs(10);
