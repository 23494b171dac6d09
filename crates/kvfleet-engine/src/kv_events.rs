//! KV events: what a worker tells routers about the blocks it caches.
//!
//! Every time a full block becomes reusable (`Stored`) or its memory is reused for
//! something else (`Removed`), the engine emits an event with a per-engine sequence
//! number that only ever increases by one, so a consumer can detect a gap and resync.

use kvfleet_core::BlockHash;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// What changed in a worker's prefix cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEventKind {
    /// A chain of blocks became cached; `block_hashes[0]`'s parent is `parent_hash`
    /// (`None` for a first block), and each later block's parent is the one before it.
    Stored {
        /// Hash of the block before the first stored one.
        parent_hash: Option<BlockHash>,
        /// The stored blocks, in prefix order.
        block_hashes: Vec<BlockHash>,
    },
    /// These blocks are no longer cached.
    Removed {
        /// The evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// Every cached block was dropped.
    Cleared,
}

/// One event with its sequence number (1, 2, 3, … per engine).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Monotonic per-engine sequence number, starting at 1, without gaps.
    pub seq: u64,
    /// What happened.
    pub kind: KvEventKind,
}

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
            Some(KvEventKind::Stored { block_hashes, .. }),
            KvEventKind::Stored {
                parent_hash: Some(p),
                block_hashes: new,
            },
        ) if block_hashes.last() == Some(&p) => block_hashes.extend(new),
        (
            Some(KvEventKind::Removed { block_hashes }),
            KvEventKind::Removed { block_hashes: new },
        ) => block_hashes.extend(new),
        (_, kind) => log.push(kind),
    }
}
