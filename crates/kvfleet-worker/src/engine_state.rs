//! What the engine thread publishes for the gRPC handlers, so that `Load` and
//! `Abort` never wait behind an engine step (one step of a long prefill can outlast a
//! router's unary deadline): its load and totals, refreshed around every step, and the
//! names of its unfinished requests and forks. (`CacheDump` answers from the event
//! log's mirror of the cache, `EventLog::cache_dump`.)
//!
//! The engine thread is the only writer; the handlers only read.

use crate::commands::LoadSnapshot;
use std::collections::HashSet;
use std::sync::Mutex;

/// The engine's published state (see the module docs).
#[derive(Default)]
pub(crate) struct EngineState {
    load: Mutex<LoadSnapshot>,
    live: Mutex<HashSet<String>>,
}

impl EngineState {
    /// Replaces the published load.
    pub(crate) fn publish_load(&self, snap: LoadSnapshot) {
        *kvfleet_core::sync::lock(&self.load) = snap;
    }

    /// The load last published.
    pub(crate) fn load(&self) -> LoadSnapshot {
        kvfleet_core::sync::lock(&self.load).clone()
    }

    /// A request or fork named `name` is now unfinished.
    pub(crate) fn started(&self, name: &str) {
        kvfleet_core::sync::lock(&self.live).insert(name.to_string());
    }

    /// The request or fork named `name` is done.
    pub(crate) fn ended(&self, name: &str) {
        kvfleet_core::sync::lock(&self.live).remove(name);
    }

    /// Whether a request or fork named `name` is unfinished.
    pub(crate) fn is_live(&self, name: &str) -> bool {
        kvfleet_core::sync::lock(&self.live).contains(name)
    }
}
