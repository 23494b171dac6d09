//! The wire form of KV events into the shared vocabulary (`kvfleet_core::kv_events`):
//! one conversion, used by the serving router's event followers, its benchmarks and the
//! fuzz targets alike.

use crate::v1 as pb;
use kvfleet_core::kv_events::{DumpedBlock, KvEvent, KvEventKind, Medium};
use kvfleet_core::BlockHash;

/// A wire tier as the core names it; a value this reader does not know reads as the
/// device pool, the tier every older worker meant.
pub fn medium_from_wire(m: i32) -> Medium {
    match pb::Medium::try_from(m) {
        Ok(pb::Medium::Host) => Medium::Host,
        Ok(pb::Medium::Disk) => Medium::Disk,
        Ok(pb::Medium::Device) | Err(_) => Medium::Device,
    }
}

/// The wire value of a tier.
pub fn medium_to_wire(m: Medium) -> i32 {
    match m {
        Medium::Device => pb::Medium::Device as i32,
        Medium::Host => pb::Medium::Host as i32,
        Medium::Disk => pb::Medium::Disk as i32,
    }
}

/// A cache-dump entry as the routing core rebuilds from it.
pub fn dumped_block_from_wire(b: &pb::CachedBlock) -> DumpedBlock {
    DumpedBlock {
        hash: BlockHash(b.hash),
        parent: b.parent_hash.map(BlockHash),
        medium: medium_from_wire(b.medium),
    }
}

/// A wire event as the routing core applies it.
pub fn from_wire(e: &pb::KvEvent) -> KvEvent {
    use pb::kv_event::Kind;
    let kind = match &e.kind {
        Some(Kind::Stored(s)) => KvEventKind::Stored {
            parent_hash: s.parent_hash.map(BlockHash),
            block_hashes: s.block_hashes.iter().map(|h| BlockHash(*h)).collect(),
            medium: medium_from_wire(s.medium),
        },
        Some(Kind::Removed(r)) => KvEventKind::Removed {
            block_hashes: r.block_hashes.iter().map(|h| BlockHash(*h)).collect(),
            medium: medium_from_wire(r.medium),
        },
        // A kind this reader does not know: treat as losing track of the worker's
        // cache, the safe reading.
        Some(Kind::Cleared(_)) | None => KvEventKind::Cleared,
    };
    KvEvent { seq: e.seq, kind }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::kv_event::{Cleared, Kind, Removed, Stored};

    #[test]
    fn every_kind_converts_and_an_unknown_one_reads_as_cleared() {
        let stored = pb::KvEvent {
            seq: 4,
            kind: Some(Kind::Stored(Stored {
                parent_hash: Some(9),
                block_hashes: vec![10, 11],
                medium: pb::Medium::Host as i32,
            })),
        };
        assert_eq!(
            from_wire(&stored),
            KvEvent {
                seq: 4,
                kind: KvEventKind::Stored {
                    parent_hash: Some(BlockHash(9)),
                    block_hashes: vec![BlockHash(10), BlockHash(11)],
                    medium: Medium::Host,
                },
            }
        );
        let removed = pb::KvEvent {
            seq: 5,
            kind: Some(Kind::Removed(Removed {
                block_hashes: vec![11],
                medium: 7,
            })),
        };
        assert_eq!(
            from_wire(&removed).kind,
            KvEventKind::Removed {
                block_hashes: vec![BlockHash(11)],
                medium: Medium::Device,
            },
            "an unknown tier reads as the device pool"
        );
        let cleared = pb::KvEvent {
            seq: 6,
            kind: Some(Kind::Cleared(Cleared {})),
        };
        assert_eq!(from_wire(&cleared).kind, KvEventKind::Cleared);
        let unknown = pb::KvEvent { seq: 7, kind: None };
        assert_eq!(from_wire(&unknown).kind, KvEventKind::Cleared);
    }
}
