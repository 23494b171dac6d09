//! Delivering KV events (defined in `kvfleet_core::kv_events`) out of the engine: the
//! sink trait, an in-memory recorder, and the coalescing that turns one step's block
//! changes into few events.

pub use kvfleet_core::kv_events::{DumpedBlock, KvEvent, KvEventKind, Medium};
use std::sync::{Arc, Mutex};

/// Receives the engine's KV events in order. Implementations must not block for long:
/// they are called from the engine's step loop.
pub trait KvEventSink: Send + Sync {
    /// Called once per event, in sequence order.
    fn publish(&self, event: &KvEvent);
}

/// A sink that keeps every event in memory; for tests and for `CacheDump`-style replay.
#[derive(Default, Clone)]
pub struct RecordingSink {
    events: Arc<Mutex<Vec<KvEvent>>>,
}

impl RecordingSink {
    /// A new, empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Everything recorded so far.
    pub fn events(&self) -> Vec<KvEvent> {
        match self.events.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

impl KvEventSink for RecordingSink {
    fn publish(&self, event: &KvEvent) {
        match self.events.lock() {
            Ok(mut g) => g.push(event.clone()),
            Err(p) => p.into_inner().push(event.clone()),
        }
    }
}

/// Appends `kind` to `log`, merging it into the last entry when both describe one
/// contiguous change (a chain extended, or more removals), so a step that stores
/// 100 blocks of one prompt yields one event, not 100.
pub(crate) fn push_coalesced(log: &mut Vec<KvEventKind>, kind: KvEventKind) {
    match (log.last_mut(), kind) {
        (
            Some(KvEventKind::Stored {
                block_hashes,
                medium,
                ..
            }),
            KvEventKind::Stored {
                parent_hash: Some(p),
                block_hashes: new,
                medium: m,
            },
        ) if block_hashes.last() == Some(&p) && *medium == m => block_hashes.extend(new),
        (
            Some(KvEventKind::Removed {
                block_hashes,
                medium,
            }),
            KvEventKind::Removed {
                block_hashes: new,
                medium: m,
            },
        ) if *medium == m => block_hashes.extend(new),
        (_, kind) => log.push(kind),
    }
}
