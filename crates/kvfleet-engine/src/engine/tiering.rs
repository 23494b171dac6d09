//! The engine's side of the KV tiers (see [`crate::kv_tiers`]): write-behind of the
//! blocks the pool will evict next, promotion of a waiting request's prefix from the
//! host or disk tier (or a peer's blocks) into the pool, and the events of both.

use super::Engine;
use crate::block_export::{BlockExporter, KvBlockReader};
use crate::block_pool::BlockId;
use crate::error::{EngineError, Result};
use crate::kv_events::Medium;
use crate::kv_tiers::write_out::WriteOut;
use crate::kv_tiers::{KvBlockPayload, KvTiers, PromotionSource, TierConfig, TierStats};
use crate::sequence::RequestId;
use kvfleet_core::BlockHash;
use std::sync::Arc;
use std::time::Duration;

/// How long an engine with nothing to schedule waits for a disk read to land.
pub(super) const DISK_WAIT: Duration = Duration::from_millis(20);

impl Engine {
    /// Puts a host tier (and optionally a disk tier) below the pool. Fails if the
    /// backend cannot copy blocks out, or the disk directory cannot be used.
    pub fn set_kv_tiers(&mut self, cfg: &TierConfig) -> Result<()> {
        if !cfg.enabled() {
            if cfg.disk.is_some() {
                return Err(EngineError::Config(
                    "a disk KV tier needs a host tier above it (--host-cache-gib)".into(),
                ));
            }
            self.tiers = None;
            self.write_out = None;
            return Ok(());
        }
        let bytes = self.backend.block_bytes();
        if bytes == 0 {
            return Err(EngineError::Config(format!(
                "the {} backend has no host/disk KV tier support",
                self.backend.device_name()
            )));
        }
        // Probe the copy-out path once so a backend without it fails at start.
        self.backend.read_block(0)?;
        let format = self.backend.block_format();
        let tiers = KvTiers::new(cfg, format, bytes).map_err(|e| EngineError::Io {
            path: cfg
                .disk
                .as_ref()
                .map_or_else(String::new, |d| d.dir.display().to_string()),
            source: e,
        })?;
        self.tiers = Some(tiers);
        let reader = self.backend.block_reader();
        self.set_write_out(reader)
    }

    /// Where write-behind copies blocks down: on a thread of its own through `reader`
    /// (what [`Engine::set_kv_tiers`] sets up when the backend has one), or with
    /// `None` on the engine thread between steps. Benchmarks compare the two.
    pub fn set_write_out(&mut self, reader: Option<Arc<dyn KvBlockReader>>) -> Result<()> {
        self.write_out = None;
        let (Some(reader), true) = (reader, self.tiers.is_some()) else {
            return Ok(());
        };
        let exporter = BlockExporter::new(self.scheduler.pool.ready_index(), reader);
        let w = WriteOut::spawn(exporter).map_err(|e| EngineError::Io {
            path: "kv-write-out thread".into(),
            source: e,
        })?;
        self.write_out = Some(w);
        Ok(())
    }

    /// Waits up to `timeout` for the write-out thread's copies to land in the host
    /// tier and for blocks on their way to disk to land there, and publishes their
    /// events; returns whether all did. For tests, benchmarks and shutdown.
    pub fn flush_tiers(&mut self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut ok = true;
        if let (Some(w), Some(tiers)) = (self.write_out.as_mut(), self.tiers.as_mut()) {
            let (landed, all) = w.wait_idle(timeout);
            ok &= all;
            tiers.demote_written_out(landed);
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        ok &= self.tiers.as_mut().is_none_or(|t| t.flush(left));
        self.publish_events();
        ok
    }

    /// The tiers' totals, when tiers are on.
    pub fn tier_stats(&self) -> Option<TierStats> {
        self.tiers.as_ref().map(|t| t.stats())
    }

    /// The format and size of the blocks [`Engine::export_blocks`] returns.
    pub fn block_format(&self) -> (&'static str, usize) {
        (self.backend.block_format(), self.backend.block_bytes())
    }

    /// An exporter of the device pool's ready blocks for other threads, when the
    /// backend's KV memory can be read from them (see [`crate::block_export`]).
    pub fn block_exporter(&mut self) -> Option<BlockExporter> {
        let reader = self.backend.block_reader()?;
        Some(BlockExporter::new(
            self.scheduler.pool.ready_index(),
            reader,
        ))
    }

    /// The leading run of `hashes` this engine holds (device pool first, then the host
    /// tier), as payloads a peer can import; stops at the first block it lacks.
    pub fn export_blocks(&mut self, hashes: &[BlockHash]) -> Result<Vec<KvBlockPayload>> {
        let mut out = Vec::new();
        for &h in hashes {
            let in_pool = self
                .scheduler
                .pool
                .lookup(h)
                .filter(|&id| self.scheduler.pool.is_ready(id));
            let block = match in_pool {
                Some(id) => KvBlockPayload {
                    hash: h,
                    parent: self.scheduler.pool.parent_of(id),
                    bytes: self.backend.read_block(id)?.into(),
                },
                None => match self.tiers.as_mut().and_then(|t| t.take_now(h)) {
                    Some(b) => b,
                    None => break,
                },
            };
            out.push(block);
        }
        Ok(out)
    }

    /// Imports a peer's blocks of request `id`'s prefix and holds them for it until it
    /// is admitted, so they count as cached (`promoted.peer`) instead of being
    /// recomputed. Stops at the first block that cannot be imported; returns how many
    /// were. The request must have been added.
    pub fn stage_peer_blocks(&mut self, id: RequestId, blocks: &[KvBlockPayload]) -> usize {
        if !self.scheduler.seqs.contains_key(&id) {
            return 0;
        }
        // The imports allocate: what they may evict is copied down first.
        self.write_behind(blocks.len());
        let mut n = 0;
        for b in blocks {
            let Some(blk) = self.import_block(b, id) else {
                break;
            };
            self.stage(id, blk, PromotionSource::Peer, b.bytes.len());
            n += 1;
        }
        self.publish_events();
        n
    }

    /// Puts one block into the pool as ready and cached, holding one reference for
    /// `holder`; an already cached block just gains the reference.
    fn import_block(&mut self, b: &KvBlockPayload, holder: RequestId) -> Option<BlockId> {
        let pool = &mut self.scheduler.pool;
        if pool.lookup(b.hash).is_some() {
            return pool.acquire(b.hash);
        }
        if b.bytes.len() != self.backend.block_bytes() {
            return None;
        }
        let id = pool.allocate()?;
        if self.backend.write_block(id, &b.bytes).is_err()
            || !self.scheduler.pool.publish_ready(id, b.hash, b.parent)
        {
            self.scheduler.pool.release(id, holder);
            return None;
        }
        Some(id)
    }

    /// Makes sure the host tier holds every cached block that the next step, plus
    /// `extra` more allocations, could evict, so an eviction never drops a prefix.
    ///
    /// It runs at the start of a step, before anything in it allocates. It lands the
    /// copies the write-out thread made while the last step ran, copies on this thread
    /// whatever within the horizon no tier holds yet, and asks the write-out thread for
    /// the next horizon's blocks, so that in steady state the engine thread only moves
    /// finished copies (see [`crate::kv_tiers::write_out`]). No block can be evicted
    /// while it is being copied here, and a copy being made off-thread is discarded if
    /// its block is evicted meanwhile. Its time is counted in
    /// [`EngineStats::demotion_ns`](super::EngineStats::demotion_ns).
    pub(super) fn write_behind(&mut self, extra: usize) {
        let Some(tiers) = self.tiers.as_mut() else {
            return;
        };
        let started = std::time::Instant::now();
        let bs = self.config.block_size;
        // The most blocks one step can allocate: its token budget in blocks, one
        // partial block per sequence, and the promotions staged before it.
        let horizon =
            self.config.max_batched_tokens / bs + 2 * self.config.max_num_seqs + 1 + extra;
        // One walk covers both horizons: the write-out thread is asked for the second.
        let lookahead = if self.write_out.is_some() {
            2 * horizon
        } else {
            horizon
        };
        let evictions = self.scheduler.pool.next_evictions(lookahead);
        if let Some(w) = self.write_out.as_mut() {
            tiers.demote_written_out(w.land());
        }
        for e in evictions.iter().take_while(|e| e.position < horizon) {
            if tiers.holds(e.hash).is_some() {
                continue;
            }
            match self.backend.read_block(e.id) {
                Ok(bytes) => tiers.demote(KvBlockPayload {
                    hash: e.hash,
                    parent: e.parent,
                    bytes: bytes.into(),
                }),
                Err(_) => break,
            }
        }
        if let Some(w) = self.write_out.as_mut() {
            w.request(
                evictions
                    .iter()
                    .filter(|e| e.position >= horizon && tiers.holds(e.hash).is_none())
                    .map(|e| e.hash),
            );
        }
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.stats.demotion_ns = self.stats.demotion_ns.saturating_add(ns);
    }

    /// Lands finished disk reads (waiting up to `wait` for one when a read is in
    /// flight), then looks up the prefixes of newly waiting requests in the tiers:
    /// host blocks are promoted now, disk blocks are requested.
    pub(super) fn promote(&mut self, wait: Duration) -> usize {
        let Some(tiers) = self.tiers.as_mut() else {
            return 0;
        };
        let landed = tiers.poll(wait);
        let n = landed.len();
        for (hash, r) in landed {
            let waiters = self.awaiting.remove(&hash).unwrap_or_default();
            for sid in waiters {
                let Some(seq) = self.scheduler.seqs.get_mut(&sid) else {
                    continue;
                };
                seq.awaiting_loads = seq.awaiting_loads.saturating_sub(1);
                if let Ok(b) = &r {
                    if let Some(id) = self.import_block(b, sid) {
                        self.stage(sid, id, PromotionSource::Disk, b.bytes.len());
                    }
                }
            }
        }
        self.stage_waiting();
        n
    }

    /// Whether a disk read is in flight (a step with nothing to run should wait).
    pub(super) fn disk_reads_pending(&self) -> bool {
        self.tiers.as_ref().is_some_and(|t| t.reads_in_flight() > 0)
    }

    fn stage(&mut self, sid: RequestId, id: BlockId, from: PromotionSource, bytes: usize) {
        let bs = self.config.block_size;
        if let Some(seq) = self.scheduler.seqs.get_mut(&sid) {
            seq.staged.push(id);
            seq.staged_free += 1;
            if seq.cached_tokens.is_none() {
                match from {
                    PromotionSource::Host => seq.promoted.host += bs,
                    PromotionSource::Disk => seq.promoted.disk += bs,
                    PromotionSource::Peer => seq.promoted.peer += bs,
                }
            }
        } else {
            self.scheduler.pool.release(id, sid);
        }
        if let Some(t) = self.tiers.as_mut() {
            t.count_promotion(from, bytes);
        }
    }

    /// Looks up each newly waiting request's prefix past what the pool holds.
    fn stage_waiting(&mut self) {
        let bs = self.config.block_size;
        let ids: Vec<RequestId> = self
            .scheduler
            .waiting
            .iter()
            .take(self.config.max_num_seqs)
            .copied()
            .collect();
        // Staged blocks are pinned until admission (they are blocks the request needs
        // anyway); leave every running sequence a block to grow into.
        let mut room = self
            .scheduler
            .pool
            .num_free()
            .saturating_sub(self.scheduler.running.len());
        for sid in ids {
            let Some(seq) = self.scheduler.seqs.get_mut(&sid) else {
                continue;
            };
            if seq.tier_staged || !seq.block_table.is_empty() {
                continue;
            }
            seq.tier_staged = true;
            let max_blocks = seq.reusable_blocks(bs);
            let hashes: Vec<BlockHash> = seq.hashes[..max_blocks].to_vec();
            let mut i = 0;
            while i < hashes.len() && self.scheduler.pool.lookup(hashes[i]).is_some() {
                i += 1;
            }
            while i < hashes.len() && room > 0 {
                let h = hashes[i];
                let Some(tiers) = self.tiers.as_mut() else {
                    return;
                };
                let Some(medium) = tiers.holds(h) else {
                    break;
                };
                if let Some(b) = tiers.take_now(h) {
                    let Some(id) = self.import_block(&b, sid) else {
                        break;
                    };
                    // A disk block still on its way out is served from memory.
                    let from = match medium {
                        Medium::Disk => PromotionSource::Disk,
                        _ => PromotionSource::Host,
                    };
                    self.stage(sid, id, from, b.bytes.len());
                } else if tiers.request_disk(h) {
                    self.awaiting.entry(h).or_default().push(sid);
                    if let Some(seq) = self.scheduler.seqs.get_mut(&sid) {
                        seq.awaiting_loads += 1;
                    }
                } else {
                    break;
                }
                room -= 1;
                i += 1;
            }
        }
    }

    /// Tier events after the pool's, and a count of cached blocks the pool evicted
    /// before they were copied down.
    pub(super) fn tier_events(
        &mut self,
        pool_events: &[crate::kv_events::KvEventKind],
    ) -> Vec<crate::kv_events::KvEventKind> {
        let Some(tiers) = self.tiers.as_mut() else {
            return Vec::new();
        };
        for e in pool_events {
            if let crate::kv_events::KvEventKind::Removed {
                block_hashes,
                medium: Medium::Device,
            } = e
            {
                for h in block_hashes {
                    if tiers.holds(*h).is_none() {
                        tiers.count_miss();
                    }
                }
            }
        }
        tiers.drain_events()
    }

    /// Drops the tiers' contents with the pool's (the pool's `Cleared` covers them).
    pub(super) fn clear_tiers(&mut self) {
        if let Some(t) = self.tiers.as_mut() {
            t.clear();
        }
        if let Some(w) = self.write_out.as_mut() {
            w.reset();
        }
        self.awaiting.clear();
    }

    /// Every block below the pool, for the cache dump.
    pub(super) fn tier_blocks(&self) -> Vec<(BlockHash, Option<BlockHash>, Medium)> {
        self.tiers.as_ref().map(|t| t.blocks()).unwrap_or_default()
    }
}
