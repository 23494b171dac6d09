//! Tiers below the device block pool: host memory, then disk.
//!
//! A block the pool is about to hand out again is *demoted* instead of dropped: the
//! engine copies it here before the pool can evict it (write-behind: on a thread of
//! its own while the engine steps where the backend allows, else between steps),
//! the host tier keeps it in an LRU bounded in bytes, and what the host tier pushes
//! out goes to the disk tier. A later request whose prefix continues in a lower tier
//! gets those blocks *promoted* back into the pool before it is admitted, so they
//! count as cached instead of being recomputed.
//!
//! Each tier reports its own `Stored`/`Removed` events with its [`Medium`]; a block
//! may be in several tiers at once (the host copy outlives a promotion).
//!
//! - [`host_tier`]: the in-memory LRU.
//! - [`disk_tier`]: block files, written and read on the tier's own threads.
//! - [`block_file`]: the checksummed file format.
//! - [`write_out`]: the thread that copies blocks down while the engine steps.

pub mod block_file;
pub mod disk_tier;
pub mod host_tier;
pub mod write_out;

use crate::kv_events::{push_coalesced, KvEventKind, Medium};
use disk_tier::{DiskChange, DiskCounters, DiskTier, ReadResult};
use host_tier::HostTier;
use kvfleet_core::BlockHash;
use std::sync::Arc;
use std::time::Duration;

pub use disk_tier::{DiskTierConfig, ReadFailure};

/// How the tiers below the pool are sized.
#[derive(Clone, Debug, Default)]
pub struct TierConfig {
    /// Bytes of host memory for demoted blocks (0: no host tier, and so no tiers).
    pub host_bytes: usize,
    /// The disk tier, if any (it takes what the host tier pushes out).
    pub disk: Option<DiskTierConfig>,
}

impl TierConfig {
    /// Whether any tier is configured.
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0
    }
}

/// One block's K/V outside the device pool: its chain position and its bytes in the
/// backend's block format.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBlockPayload {
    /// The block's chained hash.
    pub hash: BlockHash,
    /// The block before it; `None` for a first block.
    pub parent: Option<BlockHash>,
    /// K/V of every layer ([`crate::ModelBackend::read_block`]'s format).
    pub bytes: Arc<[u8]>,
}

/// Where a block promoted into the pool came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromotionSource {
    /// The host-memory tier.
    Host,
    /// The disk tier.
    Disk,
    /// A peer worker (`FetchBlocks`).
    Peer,
}

/// Running totals of the tiers, for metrics and benchmarks.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TierStats {
    /// Blocks copied from the pool into the host tier.
    pub demoted_blocks: u64,
    /// Bytes of those copies.
    pub demoted_bytes: u64,
    /// Of `demoted_blocks`, those the write-out thread copied while the engine stepped
    /// (the rest were copied on the engine thread, between steps).
    pub demoted_off_thread: u64,
    /// Cached blocks the pool evicted before they were copied down (lost to the tiers).
    pub demotion_misses: u64,
    /// Blocks promoted from the host tier into the pool.
    pub promoted_host: u64,
    /// Blocks promoted from the disk tier into the pool.
    pub promoted_disk: u64,
    /// Blocks imported from a peer worker.
    pub promoted_peer: u64,
    /// Bytes promoted (all sources).
    pub promoted_bytes: u64,
    /// Blocks held in the host tier now.
    pub host_blocks: u64,
    /// Bytes held in the host tier now.
    pub host_bytes: u64,
    /// Blocks held on disk now (written or being written).
    pub disk_blocks: u64,
    /// Bytes held on disk now.
    pub disk_bytes: u64,
    /// The disk tier's trouble counters.
    pub disk: DiskCounters,
}

/// The host and disk tiers of one engine.
pub struct KvTiers {
    host: HostTier,
    disk: Option<DiskTier>,
    events: Vec<KvEventKind>,
    stats: TierStats,
}

impl KvTiers {
    /// Tiers as `cfg` says, for blocks of `block_bytes` in `format`.
    pub fn new(
        cfg: &TierConfig,
        format: &'static str,
        block_bytes: usize,
    ) -> std::io::Result<Self> {
        let disk = match &cfg.disk {
            Some(d) => Some(DiskTier::open(d, format, block_bytes)?),
            None => None,
        };
        Ok(Self {
            host: HostTier::new(cfg.host_bytes),
            disk,
            events: Vec::new(),
            stats: TierStats::default(),
        })
    }

    /// The fastest tier below the pool holding `hash`.
    pub fn holds(&self, hash: BlockHash) -> Option<Medium> {
        if self.host.contains(hash) {
            Some(Medium::Host)
        } else if self.disk.as_ref().is_some_and(|d| d.contains(hash)) {
            Some(Medium::Disk)
        } else {
            None
        }
    }

    /// Takes a copy of a block leaving the pool into the host tier; what that pushes
    /// out goes to disk.
    pub fn demote(&mut self, block: KvBlockPayload) {
        if self.host.contains(block.hash) {
            self.host.get(block.hash);
            return;
        }
        self.stats.demoted_blocks += 1;
        self.stats.demoted_bytes += block.bytes.len() as u64;
        let (hash, parent) = (block.hash, block.parent);
        let (kept, pushed_out) = self.host.insert(block);
        for old in pushed_out {
            self.push(KvEventKind::Removed {
                block_hashes: vec![old.hash],
                medium: Medium::Host,
            });
            if let Some(d) = self.disk.as_mut() {
                d.demote(old);
            }
            self.disk_events();
        }
        if kept {
            self.push(KvEventKind::Stored {
                parent_hash: parent,
                block_hashes: vec![hash],
                medium: Medium::Host,
            });
        }
    }

    /// The host tier's copy of `hash` (or a disk block still in memory on its way
    /// out), for a promotion now.
    pub fn take_now(&mut self, hash: BlockHash) -> Option<KvBlockPayload> {
        if let Some(b) = self.host.get(hash) {
            return Some(b);
        }
        self.disk.as_mut().and_then(|d| d.pending(hash))
    }

    /// Asks the disk tier for `hash`; the block arrives through [`KvTiers::poll`].
    pub fn request_disk(&mut self, hash: BlockHash) -> bool {
        self.disk.as_mut().is_some_and(|d| d.request(hash))
    }

    /// Disk reads in flight.
    pub fn reads_in_flight(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.reads_in_flight())
    }

    /// Finished disk reads (and writes, which only update bookkeeping); may wait up to
    /// `wait` for the first when a read is in flight.
    pub fn poll(&mut self, wait: Duration) -> Vec<ReadResult> {
        let Some(d) = self.disk.as_mut() else {
            return Vec::new();
        };
        let out = d.poll(wait);
        self.disk_events();
        out
    }

    /// Turns the disk tier's changes into events, in the order they happened.
    fn disk_events(&mut self) {
        let Some(d) = self.disk.as_mut() else {
            return;
        };
        for c in d.take_changes() {
            let kind = match c {
                DiskChange::Stored(h, parent) => KvEventKind::Stored {
                    parent_hash: parent,
                    block_hashes: vec![h],
                    medium: Medium::Disk,
                },
                DiskChange::Removed(h) => KvEventKind::Removed {
                    block_hashes: vec![h],
                    medium: Medium::Disk,
                },
            };
            push_coalesced(&mut self.events, kind);
        }
    }

    /// Waits up to `timeout` for queued disk writes to land (see [`DiskTier::flush`]).
    pub fn flush(&mut self, timeout: Duration) -> bool {
        let ok = self.disk.as_mut().is_none_or(|d| d.flush(timeout));
        // Report what landed (reads that landed wait for the next poll).
        self.disk_events();
        ok
    }

    /// Counts a block promoted into the pool from `from`.
    pub fn count_promotion(&mut self, from: PromotionSource, bytes: usize) {
        match from {
            PromotionSource::Host => self.stats.promoted_host += 1,
            PromotionSource::Disk => self.stats.promoted_disk += 1,
            PromotionSource::Peer => self.stats.promoted_peer += 1,
        }
        self.stats.promoted_bytes += bytes as u64;
    }

    /// Takes the copies the write-out thread made (see [`write_out`]) into the host
    /// tier, except those a tier holds already (the engine thread copied them meanwhile).
    pub fn demote_written_out(&mut self, blocks: impl IntoIterator<Item = KvBlockPayload>) {
        for block in blocks {
            if self.holds(block.hash).is_none() {
                self.stats.demoted_off_thread += 1;
                self.demote(block);
            }
        }
    }

    /// Counts a cached block the pool evicted before it could be copied down.
    pub fn count_miss(&mut self) {
        self.stats.demotion_misses += 1;
    }

    /// Every block held below the pool, with its tier, for a cache dump.
    pub fn blocks(&self) -> Vec<(BlockHash, Option<BlockHash>, Medium)> {
        let mut out: Vec<_> = self
            .host
            .blocks()
            .into_iter()
            .map(|(h, p)| (h, p, Medium::Host))
            .collect();
        if let Some(d) = &self.disk {
            out.extend(d.blocks().into_iter().map(|(h, p)| (h, p, Medium::Disk)));
        }
        out
    }

    /// Drops every tier's blocks (the pool's `Cleared` event tells routers to forget
    /// every tier, so none is reported one by one).
    pub fn clear(&mut self) {
        self.host.clear();
        if let Some(d) = self.disk.as_mut() {
            d.clear();
        }
        self.events.clear();
    }

    /// Events recorded since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEventKind> {
        std::mem::take(&mut self.events)
    }

    /// Totals, with the current occupancy filled in.
    pub fn stats(&self) -> TierStats {
        let mut s = self.stats.clone();
        s.host_blocks = self.host.len() as u64;
        s.host_bytes = self.host.bytes() as u64;
        if let Some(d) = &self.disk {
            s.disk_blocks = d.len() as u64;
            s.disk_bytes = d.bytes() as u64;
            s.disk = d.counters().clone();
        }
        s
    }

    fn push(&mut self, kind: KvEventKind) {
        push_coalesced(&mut self.events, kind);
    }
}
