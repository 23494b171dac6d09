//! Pinned prefix blocks: prompt caching with a retention guarantee (Anthropic's
//! `cache_control.ttl`).
//!
//! A pin holds one pool reference on each block of a prompt's leading full blocks
//! until its expiry, so the pool never hands those blocks out (never evicts them)
//! while it lasts. A block is pinned at most once however many requests pin it: a
//! re-pin of the same prefix only moves the expiry later, it never counts twice.
//! The total is capped (a fraction of the pool, [`PinSet::set_capacity`]) so that
//! pins can never take the blocks running sequences need: a pin that would pass the
//! cap is refused whole, and the request is served unpinned.
//!
//! Expiry is checked once per engine step against a min-heap of expiries: a step with
//! nothing expired costs one peek. Expired blocks are released deepest first, so a
//! prefix whose pin ends stays cached (LRU) longest at its root, as released
//! sequences do.

use crate::block_pool::{BlockId, BlockPool, OwnerId};
use kvfleet_core::{BlockHash, BlockHashMap};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// The longest pin a request may ask for (Anthropic's longest cache TTL, `1h`).
pub const MAX_PIN_TTL: Duration = Duration::from_secs(3600);

/// The owner id pins release their references under (never a request's id: ids are
/// handed out from 1 by the worker, and fork prefixes use their own).
const PIN_HOLDER: OwnerId = OwnerId::MAX - 1;

/// What a request asks to pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinSpec {
    /// Leading full blocks of the prompt to pin (fewer are pinned when the prompt's
    /// cacheable part has fewer).
    pub blocks: usize,
    /// How long from the moment the prompt is computed.
    pub ttl: Duration,
}

/// Why a pin was refused; the request is served either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinRefusal {
    /// The pinned blocks would pass the worker's cap on pinned blocks.
    Capacity,
}

/// What became of a request's pin, reported once its prompt is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinOutcome {
    /// The prompt's first `blocks` blocks are pinned until `expires`.
    Pinned {
        /// Leading blocks pinned (already pinned ones included).
        blocks: usize,
        /// When the pin ends.
        expires: Instant,
    },
    /// Not pinned.
    Refused(PinRefusal),
}

#[derive(Clone, Copy, Debug)]
struct Pinned {
    id: BlockId,
    expires: Instant,
    /// Position in its prefix chain: deeper blocks are released first.
    depth: usize,
}

/// The pinned blocks of one pool.
#[derive(Debug, Default)]
pub struct PinSet {
    pinned: BlockHashMap<Pinned>,
    /// (expiry, deepest first, hash); entries whose expiry was moved later are stale
    /// and skipped when popped.
    heap: BinaryHeap<Reverse<(Instant, Reverse<usize>, BlockHash)>>,
    capacity: usize,
}

impl PinSet {
    /// No pins, room for none until [`PinSet::set_capacity`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Most blocks pinned at once.
    pub fn set_capacity(&mut self, blocks: usize) {
        self.capacity = blocks;
    }

    /// Most blocks pinned at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks pinned now.
    pub fn len(&self) -> usize {
        self.pinned.len()
    }

    /// Whether nothing is pinned.
    pub fn is_empty(&self) -> bool {
        self.pinned.is_empty()
    }

    /// Whether the block cached under `hash` is pinned.
    pub fn is_pinned(&self, hash: BlockHash) -> bool {
        self.pinned.contains_key(&hash)
    }

    /// Pins the ready blocks cached under `hashes` (a prefix chain, in order) until
    /// `now + ttl`. Pinning stops at the first block that is not cached and ready (a
    /// pin is always a prefix). Blocks already pinned keep their one reference and get
    /// the later of both expiries; the new ones must fit under the cap, or nothing is
    /// pinned.
    pub fn pin(
        &mut self,
        pool: &mut BlockPool,
        hashes: &[BlockHash],
        ttl: Duration,
        now: Instant,
    ) -> PinOutcome {
        let ttl = ttl.min(MAX_PIN_TTL);
        let expires = now + ttl;
        let mut chain = 0;
        let mut new = 0;
        for h in hashes {
            let ready = pool.lookup(*h).is_some_and(|id| pool.is_ready(id));
            if !ready {
                break;
            }
            if !self.pinned.contains_key(h) {
                new += 1;
            }
            chain += 1;
        }
        if self.pinned.len() + new > self.capacity {
            return PinOutcome::Refused(PinRefusal::Capacity);
        }
        for (depth, h) in hashes[..chain].iter().enumerate() {
            match self.pinned.get_mut(h) {
                Some(p) => {
                    if p.expires < expires {
                        p.expires = expires;
                        self.heap.push(Reverse((expires, Reverse(depth), *h)));
                    }
                }
                None => {
                    let Some(id) = pool.acquire(*h) else {
                        break;
                    };
                    self.pinned.insert(*h, Pinned { id, expires, depth });
                    self.heap.push(Reverse((expires, Reverse(depth), *h)));
                }
            }
        }
        self.compact();
        PinOutcome::Pinned {
            blocks: chain,
            expires,
        }
    }

    /// Releases every pin that ended by `now` (their blocks stay cached, now
    /// evictable). Returns how many blocks were released.
    pub fn expire(&mut self, pool: &mut BlockPool, now: Instant) -> usize {
        let mut released = 0;
        while let Some(Reverse((at, _, h))) = self.heap.peek().copied() {
            if at > now {
                break;
            }
            self.heap.pop();
            let live = self.pinned.get(&h).is_some_and(|p| p.expires == at);
            if !live {
                continue;
            }
            if let Some(p) = self.pinned.remove(&h) {
                pool.release(p.id, PIN_HOLDER);
                released += 1;
            }
        }
        released
    }

    /// Releases every pin (the cache is being cleared).
    pub fn clear(&mut self, pool: &mut BlockPool) {
        let mut all: Vec<Pinned> = self.pinned.drain().map(|(_, p)| p).collect();
        all.sort_by_key(|p| Reverse(p.depth));
        for p in all {
            pool.release(p.id, PIN_HOLDER);
        }
        self.heap.clear();
    }

    /// Rebuilds the heap from the live pins once re-pins have left it mostly stale:
    /// memory stays proportional to the pinned blocks, not to how often they are
    /// re-pinned.
    fn compact(&mut self) {
        if self.heap.len() <= 2 * self.pinned.len() + 64 {
            return;
        }
        self.heap = self
            .pinned
            .iter()
            .map(|(h, p)| Reverse((p.expires, Reverse(p.depth), *h)))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool whose first `n` blocks hold a ready chain 1..=n, released (idle, cached).
    fn chain(pool: &mut BlockPool, n: u64, base: u64) -> Vec<BlockHash> {
        let mut ids = Vec::new();
        let mut hashes = Vec::new();
        let mut parent = None;
        for i in 0..n {
            let id = pool.allocate().expect("block");
            let h = BlockHash(base + i);
            assert!(pool.publish_ready(id, h, parent));
            parent = Some(h);
            ids.push(id);
            hashes.push(h);
        }
        for id in ids.into_iter().rev() {
            pool.release(id, 1);
        }
        hashes
    }

    #[test]
    fn pinned_blocks_survive_pressure_and_are_released_at_expiry() {
        let mut pool = BlockPool::new(8);
        let mut pins = PinSet::new();
        pins.set_capacity(4);
        let t0 = Instant::now();
        let pinned = chain(&mut pool, 3, 100);
        let other = chain(&mut pool, 3, 200);
        let out = pins.pin(&mut pool, &pinned, Duration::from_millis(50), t0);
        assert!(
            matches!(out, PinOutcome::Pinned { blocks: 3, .. }),
            "{out:?}"
        );
        assert_eq!(pool.num_free(), 5);
        // Pressure: every block that can be handed out is, evicting the unpinned chain.
        let taken: Vec<_> = std::iter::from_fn(|| pool.allocate()).collect();
        assert_eq!(taken.len(), 5);
        assert!(other.iter().all(|h| pool.lookup(*h).is_none()));
        assert!(pinned.iter().all(|h| pool.lookup(*h).is_some()));
        for id in taken {
            pool.release(id, 0);
        }
        assert_eq!(pins.expire(&mut pool, t0 + Duration::from_millis(49)), 0);
        assert_eq!(pins.expire(&mut pool, t0 + Duration::from_millis(50)), 3);
        assert!(pins.is_empty());
        assert_eq!(pool.num_free(), 8);
        // Released, still cached, but evictable now: after the five private blocks,
        // the deepest pinned block goes first and the root last.
        for _ in 0..6 {
            pool.allocate().expect("block");
        }
        let left: Vec<bool> = pinned.iter().map(|h| pool.lookup(*h).is_some()).collect();
        assert_eq!(left, [true, true, false]);
        pool.check_invariants().expect("invariants");
    }

    #[test]
    fn a_repin_extends_without_counting_twice_and_the_cap_refuses_whole_pins() {
        let mut pool = BlockPool::new(8);
        let mut pins = PinSet::new();
        pins.set_capacity(4);
        let t0 = Instant::now();
        let a = chain(&mut pool, 3, 100);
        let b = chain(&mut pool, 2, 200);
        pins.pin(&mut pool, &a, Duration::from_millis(10), t0);
        let again = pins.pin(&mut pool, &a, Duration::from_millis(30), t0);
        assert!(matches!(again, PinOutcome::Pinned { blocks: 3, .. }));
        assert_eq!(pins.len(), 3);
        assert_eq!(
            pool.ref_count(pool.lookup(a[0]).unwrap()),
            1,
            "one reference"
        );
        // Two more would pass the cap of four: refused, nothing of it pinned.
        let out = pins.pin(&mut pool, &b, Duration::from_millis(10), t0);
        assert_eq!(out, PinOutcome::Refused(PinRefusal::Capacity));
        assert!(!pins.is_pinned(b[0]));
        // The first expiry is stale: the pin lives until the later one.
        assert_eq!(pins.expire(&mut pool, t0 + Duration::from_millis(10)), 0);
        assert_eq!(pins.len(), 3);
        assert_eq!(pins.expire(&mut pool, t0 + Duration::from_millis(30)), 3);
        pool.check_invariants().expect("invariants");
    }

    #[test]
    fn a_pin_stops_at_the_first_block_not_cached() {
        let mut pool = BlockPool::new(4);
        let mut pins = PinSet::new();
        pins.set_capacity(4);
        let mut a = chain(&mut pool, 2, 100);
        a.push(BlockHash(999));
        let out = pins.pin(&mut pool, &a, Duration::from_secs(1), Instant::now());
        assert!(
            matches!(out, PinOutcome::Pinned { blocks: 2, .. }),
            "{out:?}"
        );
        pins.clear(&mut pool);
        assert_eq!(pool.num_free(), 4);
        pool.check_invariants().expect("invariants");
    }

    #[test]
    fn repins_do_not_grow_the_heap_without_bound() {
        let mut pool = BlockPool::new(4);
        let mut pins = PinSet::new();
        pins.set_capacity(4);
        let a = chain(&mut pool, 2, 100);
        let t0 = Instant::now();
        for i in 1..1000 {
            pins.pin(&mut pool, &a, Duration::from_millis(i), t0);
        }
        assert!(pins.heap.len() <= 2 * pins.len() + 64 + 2);
    }
}
