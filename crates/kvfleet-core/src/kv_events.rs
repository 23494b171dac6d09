//! KV events: what a worker tells routers about the blocks it caches.
//!
//! Every time a full block becomes reusable (`Stored`) or its memory is reused for
//! something else (`Removed`), a worker's engine emits an event with a per-worker
//! sequence number that only ever increases by one, so a consumer can detect a gap and
//! resync. Engine and router share these types; they live here because both must agree
//! on them field for field.

use crate::block_hash::BlockHash;
use serde::{Deserialize, Serialize};

/// What changed in one worker's prefix cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEventKind {
    /// A chain of blocks became cached: `block_hashes[0]`'s parent is `parent_hash`
    /// (`None` for a first block) and every later block's parent is the one before it.
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
    /// Every cached block of the worker was dropped.
    Cleared,
}

/// One KV event with its per-worker sequence number (1, 2, 3, … without gaps).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// Per-worker sequence number; the first event of a worker is 1.
    pub seq: u64,
    /// What happened.
    pub kind: KvEventKind,
}

impl KvEvent {
    /// A `Stored` event.
    pub fn stored(seq: u64, parent_hash: Option<BlockHash>, block_hashes: Vec<BlockHash>) -> Self {
        Self {
            seq,
            kind: KvEventKind::Stored {
                parent_hash,
                block_hashes,
            },
        }
    }

    /// A `Removed` event.
    pub fn removed(seq: u64, block_hashes: Vec<BlockHash>) -> Self {
        Self {
            seq,
            kind: KvEventKind::Removed { block_hashes },
        }
    }

    /// A `Cleared` event.
    pub fn cleared(seq: u64) -> Self {
        Self {
            seq,
            kind: KvEventKind::Cleared,
        }
    }
}

/// A worker's full cache dump: every cached block as `(hash, parent hash)`, in any
/// order. Used to resync a worker after an event gap, together with the sequence
/// number of the last event the dump reflects.
pub type CacheDump = [(BlockHash, Option<BlockHash>)];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializes_like_the_engine_events() {
        let e = KvEvent::stored(3, None, vec![BlockHash(1), BlockHash(2)]);
        let json = serde_json::to_string(&e).unwrap_or_default();
        assert_eq!(
            json,
            r#"{"seq":3,"kind":{"type":"stored","parent_hash":null,"block_hashes":[1,2]}}"#
        );
        let back: KvEvent = serde_json::from_str(&json).unwrap_or(KvEvent::cleared(0));
        assert_eq!(back, e);
        let c = serde_json::to_string(&KvEvent::cleared(9)).unwrap_or_default();
        assert_eq!(c, r#"{"seq":9,"kind":{"type":"cleared"}}"#);
    }
}
