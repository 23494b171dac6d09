//! A worker's KV-tier totals as the router keeps them from its `Load` answers: where
//! its cached prompt tokens came from (device pool, host tier, disk tier, a peer),
//! what its host and disk tiers hold, and the bytes moved between them and the pool
//! or pulled from peers. Shown by `/dashboard` and `/fleet`, never scored (the policies
//! see the tiers through the prefix index instead).
//!
//! [`crate::supervision::worker_tiers`] is the one conversion from the wire.

use serde::Serialize;
use std::ops::AddAssign;

/// One worker's tier totals since it started (or the sum over workers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WorkerTiers {
    /// Workers (of those summed) with host/disk tiers below the device pool: 0 or 1
    /// for one worker.
    pub tiered_workers: u64,
    /// Prompt tokens the worker received.
    pub prompt_tokens: u64,
    /// Prompt tokens it reported cached, from any tier.
    pub cached_tokens: u64,
    /// The part of `cached_tokens` promoted from the host tier.
    pub host_cached_tokens: u64,
    /// ... from the disk tier.
    pub disk_cached_tokens: u64,
    /// ... from a peer worker.
    pub peer_cached_tokens: u64,
    /// Blocks held in host memory now.
    pub host_blocks: u64,
    /// Their bytes.
    pub host_bytes: u64,
    /// Blocks held on disk now.
    pub disk_blocks: u64,
    /// Their bytes.
    pub disk_bytes: u64,
    /// Blocks copied from the device pool into the host tier.
    pub demoted_blocks: u64,
    /// Their bytes.
    pub demoted_bytes: u64,
    /// Of `demoted_blocks`, those the write-out thread copied while the engine stepped.
    pub demoted_off_thread_blocks: u64,
    /// Blocks promoted into the pool from the host tier.
    pub promoted_host_blocks: u64,
    /// ... from the disk tier.
    pub promoted_disk_blocks: u64,
    /// ... from a peer.
    pub promoted_peer_blocks: u64,
    /// Bytes of all promotions.
    pub promoted_bytes: u64,
    /// Blocks received whole from peers.
    pub peer_pulled_blocks: u64,
    /// Their bytes.
    pub peer_pulled_bytes: u64,
    /// Cached blocks evicted from the pool before they were copied down.
    pub demotion_misses: u64,
    /// Disk-tier faults of all kinds (each a recompute).
    pub disk_faults: u64,
}

impl WorkerTiers {
    /// Cached prompt tokens that were already in the device pool: the ones not
    /// promoted from a lower tier or a peer.
    pub fn device_cached_tokens(&self) -> u64 {
        self.cached_tokens.saturating_sub(
            self.host_cached_tokens
                .saturating_add(self.disk_cached_tokens)
                .saturating_add(self.peer_cached_tokens),
        )
    }
}

impl AddAssign<&WorkerTiers> for WorkerTiers {
    fn add_assign(&mut self, o: &WorkerTiers) {
        // Destructured, so a new field cannot be left out of the fleet's totals.
        let WorkerTiers {
            tiered_workers,
            prompt_tokens,
            cached_tokens,
            host_cached_tokens,
            disk_cached_tokens,
            peer_cached_tokens,
            host_blocks,
            host_bytes,
            disk_blocks,
            disk_bytes,
            demoted_blocks,
            demoted_bytes,
            demoted_off_thread_blocks,
            promoted_host_blocks,
            promoted_disk_blocks,
            promoted_peer_blocks,
            promoted_bytes,
            peer_pulled_blocks,
            peer_pulled_bytes,
            demotion_misses,
            disk_faults,
        } = *o;
        let add = |a: &mut u64, b: u64| *a = a.saturating_add(b);
        add(&mut self.tiered_workers, tiered_workers);
        add(&mut self.prompt_tokens, prompt_tokens);
        add(&mut self.cached_tokens, cached_tokens);
        add(&mut self.host_cached_tokens, host_cached_tokens);
        add(&mut self.disk_cached_tokens, disk_cached_tokens);
        add(&mut self.peer_cached_tokens, peer_cached_tokens);
        add(&mut self.host_blocks, host_blocks);
        add(&mut self.host_bytes, host_bytes);
        add(&mut self.disk_blocks, disk_blocks);
        add(&mut self.disk_bytes, disk_bytes);
        add(&mut self.demoted_blocks, demoted_blocks);
        add(&mut self.demoted_bytes, demoted_bytes);
        add(
            &mut self.demoted_off_thread_blocks,
            demoted_off_thread_blocks,
        );
        add(&mut self.promoted_host_blocks, promoted_host_blocks);
        add(&mut self.promoted_disk_blocks, promoted_disk_blocks);
        add(&mut self.promoted_peer_blocks, promoted_peer_blocks);
        add(&mut self.promoted_bytes, promoted_bytes);
        add(&mut self.peer_pulled_blocks, peer_pulled_blocks);
        add(&mut self.peer_pulled_bytes, peer_pulled_bytes);
        add(&mut self.demotion_misses, demotion_misses);
        add(&mut self.disk_faults, disk_faults);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_hits_are_the_cached_tokens_no_lower_tier_supplied() {
        let mut a = WorkerTiers {
            tiered_workers: 1,
            cached_tokens: 1_000,
            host_cached_tokens: 640,
            disk_cached_tokens: 32,
            peer_cached_tokens: 16,
            demoted_bytes: 5,
            ..WorkerTiers::default()
        };
        assert_eq!(a.device_cached_tokens(), 312);
        let b = WorkerTiers {
            cached_tokens: 48,
            demoted_bytes: 7,
            ..WorkerTiers::default()
        };
        a += &b;
        assert_eq!((a.tiered_workers, a.cached_tokens), (1, 1_048));
        assert_eq!((a.demoted_bytes, a.device_cached_tokens()), (12, 360));
        // Counters read at different instants never make the device share negative.
        let skewed = WorkerTiers {
            cached_tokens: 10,
            host_cached_tokens: 16,
            ..WorkerTiers::default()
        };
        assert_eq!(skewed.device_cached_tokens(), 0);
    }
}
