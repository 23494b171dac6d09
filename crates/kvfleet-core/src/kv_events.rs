//! KV events: what a worker tells routers about the blocks it caches.
//!
//! Every time a full block becomes reusable (`Stored`) or its memory is reused for
//! something else (`Removed`), a worker's engine emits an event with a per-worker
//! sequence number that only ever increases by one, so a consumer can detect a gap and
//! resync. Engine and router share these types; they live here because both must agree
//! on them field for field.

use crate::block_hash::BlockHash;
use serde::{Deserialize, Serialize};

/// Which tier of a worker's KV memory holds a block. A block may sit in several at
/// once (a device block is written behind to host before it is evicted); each tier
/// reports its own `Stored`/`Removed`, so a router can price a hit by where it lives.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Medium {
    /// The engine's block pool (GPU memory, or host memory on the CPU backend).
    #[default]
    Device,
    /// The worker's host-memory tier below the pool (`--host-cache-gib`).
    Host,
    /// The worker's disk tier (`--disk-cache-dir`).
    Disk,
}

impl Medium {
    /// Every tier, fastest first.
    pub const ALL: [Medium; 3] = [Medium::Device, Medium::Host, Medium::Disk];

    /// Whether this is the device pool (the default, left out of serialized events).
    pub fn is_device(&self) -> bool {
        *self == Medium::Device
    }

    /// Lower-case name for metrics labels and usage records.
    pub fn as_str(&self) -> &'static str {
        match self {
            Medium::Device => "device",
            Medium::Host => "host",
            Medium::Disk => "disk",
        }
    }
}

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
        /// The tier that now holds them.
        #[serde(default, skip_serializing_if = "Medium::is_device")]
        medium: Medium,
    },
    /// These blocks are no longer cached in `medium` (they may remain in another tier).
    Removed {
        /// The evicted blocks.
        block_hashes: Vec<BlockHash>,
        /// The tier that dropped them.
        #[serde(default, skip_serializing_if = "Medium::is_device")]
        medium: Medium,
    },
    /// Every cached block of the worker was dropped.
    Cleared,
}

/// Prompt tokens a request found cached below a worker's device pool, by where they
/// came from; they are part of its `cached_tokens`. Usage records carry it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromotedTokens {
    /// From the host-memory tier.
    #[serde(default)]
    pub host: usize,
    /// From the disk tier.
    #[serde(default)]
    pub disk: usize,
    /// From a peer worker.
    #[serde(default)]
    pub peer: usize,
}

impl PromotedTokens {
    /// All promoted tokens.
    pub fn total(&self) -> usize {
        self.host + self.disk + self.peer
    }

    /// Whether nothing was promoted (usage records then leave the field out).
    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }
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
    /// A `Stored` event in the device pool.
    pub fn stored(seq: u64, parent_hash: Option<BlockHash>, block_hashes: Vec<BlockHash>) -> Self {
        Self {
            seq,
            kind: KvEventKind::Stored {
                parent_hash,
                block_hashes,
                medium: Medium::Device,
            },
        }
    }

    /// A `Removed` event from the device pool.
    pub fn removed(seq: u64, block_hashes: Vec<BlockHash>) -> Self {
        Self {
            seq,
            kind: KvEventKind::Removed {
                block_hashes,
                medium: Medium::Device,
            },
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

/// One block of a worker's cache dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DumpedBlock {
    /// The block's chained hash.
    pub hash: BlockHash,
    /// The block before it in its prefix chain; `None` for a first block.
    pub parent: Option<BlockHash>,
    /// The tier holding it (a block in two tiers is listed once per tier).
    pub medium: Medium,
}

impl DumpedBlock {
    /// A block in the device pool.
    pub fn device(hash: BlockHash, parent: Option<BlockHash>) -> Self {
        Self {
            hash,
            parent,
            medium: Medium::Device,
        }
    }
}

/// A worker's full cache dump: every cached block with its parent and tier, in any
/// order. Used to resync a worker after an event gap, together with the sequence
/// number of the last event the dump reflects.
pub type CacheDump = [DumpedBlock];

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
        let host = KvEvent {
            seq: 4,
            kind: KvEventKind::Removed {
                block_hashes: vec![BlockHash(2)],
                medium: Medium::Host,
            },
        };
        let json = serde_json::to_string(&host).unwrap_or_default();
        assert_eq!(
            json,
            r#"{"seq":4,"kind":{"type":"removed","block_hashes":[2],"medium":"host"}}"#
        );
        let back: KvEvent = serde_json::from_str(&json).unwrap_or(KvEvent::cleared(0));
        assert_eq!(back, host);
        let c = serde_json::to_string(&KvEvent::cleared(9)).unwrap_or_default();
        assert_eq!(c, r#"{"seq":9,"kind":{"type":"cleared"}}"#);
    }
}
