//! Pending reservations: prefixes a worker *will* hold because this router just sent
//! it a request, before the worker's `Stored` events say so.
//!
//! Without them, fork siblings that arrive microseconds apart all see an empty index
//! and scatter over the fleet, each paying the full prefill (a known failure of
//! routers that only trust KV events). When the router routes a request to worker `W`,
//! it reserves the request's block-hash chain for `W`; lookups then count `W` as a
//! holder of that chain's prefixes. A reservation ends when `W`'s events confirm its
//! deepest block ([`Reservations::confirm`]), when the caller releases it (the request
//! failed), a grace period after its request ends unconfirmed ([`Reservations::finish`]),
//! or when its TTL passes ([`Reservations::expire`], lazy: FIFOs of expiry times are
//! popped from the front, so each reservation costs O(1) to expire). The TTL is long
//! because a request may queue for minutes on a slow or overloaded fleet, and its
//! siblings must still find the prefix it will compute; the grace after its end is
//! short, since by then the worker's events are due. Time is
//! always an argument (milliseconds on any monotonic clock the caller picks), never
//! read here, so behaviour is deterministic.
//!
//! Reservations are stored in a compressed trie of hash chains: each node owns a run
//! of consecutive hashes and counts, per worker, the reservations passing through it.
//! Siblings sharing a 3,000-block prefix therefore share one node, and a lookup walks
//! one node per branching point. Within a node the match length is found by bisection,
//! which relies on block hashes being chained (equal hashes at a depth imply equal
//! hashes at every earlier depth) — true for every chain `hash_blocks` produces.

use crate::prefix_index::Matches;
use crate::registry::WorkerIdx;
use kvfleet_core::{BlockHash, BlockHashMap};
use std::collections::VecDeque;

/// Handle of one reservation, returned by [`Reservations::reserve`]. Stale handles
/// (of reservations already ended) are recognised and ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReservationId {
    slot: u32,
    generation: u32,
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Node {
    parent: u32,
    edge: Vec<BlockHash>,
    // Reservations passing through this whole node, per worker, sorted by worker (one
    // worker's depth is then a search per node on the path, `depth_of`).
    holders: Vec<(WorkerIdx, u32)>,
    total: u32,
}

#[derive(Clone, Debug)]
struct Reservation {
    worker: WorkerIdx,
    leaf: u32,
    deepest: BlockHash,
    generation: u32,
    live: bool,
    // Position in `by_worker[worker]`, for O(1) removal.
    pos: u32,
}

/// Outcome of looking for the child of a node that starts with a given hash.
enum Child {
    Found(u32),
    Absent,
    // The key is taken by an unrelated node (a 64-bit key collision): treat the chain
    // as ending here rather than corrupt the trie.
    Blocked,
}

/// The pending-holder table; see the module docs.
#[derive(Clone, Debug)]
pub struct Reservations {
    ttl_ms: u64,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    // (parent node, first hash of the child's edge) → child node.
    children: BlockHashMap<u32>,
    slots: Vec<Reservation>,
    free_slots: Vec<u32>,
    by_worker: Vec<Vec<u32>>,
    // Deepest block hash → the live reservations ending there (of any worker), so a
    // `Stored` event confirms in time proportional to its blocks, not to the
    // worker's live reservations.
    by_deepest: BlockHashMap<Vec<u32>>,
    expiry: VecDeque<(u64, ReservationId)>,
    /// How long a reservation counts after its request ends.
    grace_ms: u64,
    // Expiry times set by `finish` (uniform grace, so also in order).
    ending: VecDeque<(u64, ReservationId)>,
    live: usize,
}

/// Whether `id` names a reservation still live in `slots`.
fn is_live(slots: &[Reservation], id: ReservationId) -> bool {
    matches!(slots.get(id.slot as usize), Some(r) if r.live && r.generation == id.generation)
}

/// Pops the front of `fifo` if it is due at `now_ms`.
fn pop_due(fifo: &mut VecDeque<(u64, ReservationId)>, now_ms: u64) -> Option<ReservationId> {
    match fifo.front() {
        Some(&(at, id)) if at <= now_ms => {
            fifo.pop_front();
            Some(id)
        }
        _ => None,
    }
}

impl Reservations {
    /// An empty table whose reservations live `ttl_ms` milliseconds unless confirmed.
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            ttl_ms,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            children: BlockHashMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_worker: Vec::new(),
            by_deepest: BlockHashMap::default(),
            expiry: VecDeque::new(),
            grace_ms: ttl_ms,
            ending: VecDeque::new(),
            live: 0,
        }
    }

    /// The same table, whose reservations count at most `grace_ms` after their request
    /// ends ([`finish`](Self::finish)); without it, until their TTL.
    pub fn with_grace(mut self, grace_ms: u64) -> Self {
        self.grace_ms = grace_ms;
        self
    }

    /// The request of reservation `id` ended at `now_ms`: unless the worker's events
    /// confirm it first, it ends `grace_ms` later (or at its TTL, if sooner). Stale
    /// handles are ignored.
    pub fn finish(&mut self, id: ReservationId, now_ms: u64) {
        if is_live(&self.slots, id) && self.grace_ms < self.ttl_ms {
            self.ending
                .push_back((now_ms.saturating_add(self.grace_ms), id));
            Self::compact(&mut self.ending, &self.slots, self.live);
        }
    }

    /// The time to live of new reservations.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms
    }

    /// Number of live reservations.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether there is no live reservation.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Number of live reservations for `worker`.
    pub fn worker_len(&self, worker: WorkerIdx) -> usize {
        self.by_worker.get(worker.index()).map_or(0, Vec::len)
    }

    /// Number of trie nodes in use (for tests and diagnostics).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    /// Reserves the chain `hashes` for `worker` until `now_ms + ttl`. Returns `None`
    /// for an empty chain (a prompt shorter than one block has nothing to reserve).
    pub fn reserve(
        &mut self,
        worker: WorkerIdx,
        hashes: &[BlockHash],
        now_ms: u64,
    ) -> Option<ReservationId> {
        if hashes.is_empty() {
            return None;
        }
        let leaf = self.insert_path(worker, hashes)?;
        let deepest = {
            let node = &self.nodes[leaf as usize];
            *node.edge.last()?
        };
        if worker.index() >= self.by_worker.len() {
            self.by_worker.resize_with(worker.index() + 1, Vec::new);
        }
        let list = &mut self.by_worker[worker.index()];
        let pos = list.len() as u32;
        let expires_at_ms = now_ms.saturating_add(self.ttl_ms);
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Reservation {
                    worker,
                    leaf,
                    deepest,
                    generation: 0,
                    live: false,
                    pos,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let r = &mut self.slots[slot as usize];
        let generation = r.generation.wrapping_add(1);
        *r = Reservation {
            worker,
            leaf,
            deepest,
            generation,
            live: true,
            pos,
        };
        list.push(slot);
        self.by_deepest.entry(deepest).or_default().push(slot);
        self.live += 1;
        let id = ReservationId { slot, generation };
        self.expiry.push_back((expires_at_ms, id));
        Self::compact(&mut self.expiry, &self.slots, self.live);
        Some(id)
    }

    /// Ends a reservation early (the request failed or was cancelled). Returns whether
    /// it was still live.
    pub fn release(&mut self, id: ReservationId) -> bool {
        if is_live(&self.slots, id) {
            self.end(id.slot);
            true
        } else {
            false
        }
    }

    /// Ends every reservation whose TTL, or grace after its request's end, has passed
    /// at `now_ms`; returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let mut ended = 0;
        while let Some(id) =
            pop_due(&mut self.expiry, now_ms).or_else(|| pop_due(&mut self.ending, now_ms))
        {
            ended += usize::from(self.release(id));
        }
        ended
    }

    /// Drops the entries of ended reservations from `fifo` once they outnumber the live
    /// ones: with a long TTL most entries outlive their reservation, and the FIFO must
    /// stay proportional to what is live, not to the requests of the last TTL.
    fn compact(fifo: &mut VecDeque<(u64, ReservationId)>, slots: &[Reservation], live: usize) {
        if fifo.len() > 2 * live + 64 {
            fifo.retain(|&(_, id)| is_live(slots, id));
        }
    }

    /// Ends `worker`'s reservations whose deepest block `holds` reports as cached —
    /// its events have caught up with them. Returns how many ended.
    pub fn confirm(&mut self, worker: WorkerIdx, holds: impl Fn(BlockHash) -> bool) -> usize {
        let Some(list) = self.by_worker.get(worker.index()) else {
            return 0;
        };
        let done: Vec<u32> = list
            .iter()
            .copied()
            .filter(|&s| holds(self.slots[s as usize].deepest))
            .collect();
        for &s in &done {
            self.end(s);
        }
        done.len()
    }

    /// Ends `worker`'s reservations whose deepest block is one of `stored` (the blocks
    /// of a `Stored` event): O(blocks) whatever the number of live reservations.
    /// Returns how many ended. A reservation whose deepest block was already cached
    /// when it was made is never created (see `KvRouter::route`), so every live one
    /// ends through the event that stores its deepest block, a rebuild, or its TTL.
    pub fn confirm_stored(&mut self, worker: WorkerIdx, stored: &[BlockHash]) -> usize {
        if self.worker_len(worker) == 0 {
            return 0;
        }
        let mut ended = 0;
        for h in stored {
            while let Some(slot) = self.by_deepest.get(h).and_then(|v| {
                v.iter()
                    .copied()
                    .find(|&s| self.slots[s as usize].worker == worker)
            }) {
                self.end(slot);
                ended += 1;
            }
        }
        ended
    }

    /// Ends every reservation of `worker` (it left the fleet).
    pub fn remove_worker(&mut self, worker: WorkerIdx) -> usize {
        let Some(list) = self.by_worker.get_mut(worker.index()) else {
            return 0;
        };
        let all = std::mem::take(list);
        for &s in &all {
            self.end(s);
        }
        all.len()
    }

    /// Raises each worker's depth in `out` to the deepest prefix of `hashes` that one
    /// of its live reservations covers. Expired reservations still count until
    /// [`expire`](Self::expire) runs; the router runs it before every lookup.
    pub fn pending_into(&self, hashes: &[BlockHash], out: &mut Matches) {
        if self.live == 0 || hashes.is_empty() {
            return;
        }
        let mut parent = NIL;
        let mut pos = 0;
        while pos < hashes.len() {
            let Child::Found(id) = self.child(parent, hashes[pos]) else {
                break;
            };
            let node = &self.nodes[id as usize];
            let m = common_prefix(&node.edge, &hashes[pos..]);
            let depth = pos + m;
            for &(w, _) in &node.holders {
                out.queue_raise(w, depth);
            }
            if m < node.edge.len() {
                break;
            }
            parent = id;
            pos = depth;
        }
        out.apply_raises();
    }

    /// The deepest prefix of `hashes` that one of `worker`'s live reservations covers
    /// ([`pending_into`](Self::pending_into) for one worker): a search of each node's
    /// holders along the path, however many other workers share it.
    pub fn depth_of(&self, worker: WorkerIdx, hashes: &[BlockHash]) -> usize {
        if self.live == 0 {
            return 0;
        }
        let (mut parent, mut pos) = (NIL, 0);
        while pos < hashes.len() {
            let Child::Found(id) = self.child(parent, hashes[pos]) else {
                break;
            };
            let node = &self.nodes[id as usize];
            // A reservation passing through a node passes through its ancestors.
            if node.holders.binary_search_by_key(&worker, |h| h.0).is_err() {
                break;
            }
            let m = common_prefix(&node.edge, &hashes[pos..]);
            pos += m;
            if m < node.edge.len() {
                break;
            }
            parent = id;
        }
        pos
    }

    /// Matched depth per worker from reservations alone.
    pub fn pending(&self, hashes: &[BlockHash]) -> Matches {
        let mut m = Matches::new();
        self.pending_into(hashes, &mut m);
        m
    }

    // --- internals -------------------------------------------------------------

    fn key(parent: u32, first: BlockHash) -> BlockHash {
        // Block hashes are uniform, so xor with a mixed parent id stays uniform for the
        // pass-through hasher; `child` verifies the node it finds.
        BlockHash(first.0 ^ (u64::from(parent) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn child(&self, parent: u32, first: BlockHash) -> Child {
        match self.children.get(&Self::key(parent, first)) {
            None => Child::Absent,
            Some(&id) => {
                let n = &self.nodes[id as usize];
                if n.parent == parent && n.edge.first() == Some(&first) {
                    Child::Found(id)
                } else {
                    Child::Blocked
                }
            }
        }
    }

    fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn add_holder(&mut self, id: u32, worker: WorkerIdx) {
        let n = &mut self.nodes[id as usize];
        n.total += 1;
        match n.holders.binary_search_by_key(&worker, |h| h.0) {
            Ok(i) => n.holders[i].1 += 1,
            Err(i) => n.holders.insert(i, (worker, 1)),
        }
    }

    /// A new node for `edge` under `parent`, held once by `worker`; `None` if its key
    /// is blocked by a collision.
    fn new_leaf(&mut self, parent: u32, edge: &[BlockHash], worker: WorkerIdx) -> Option<u32> {
        let first = *edge.first()?;
        let key = Self::key(parent, first);
        if self.children.contains_key(&key) {
            return None;
        }
        let id = self.alloc_node(Node {
            parent,
            edge: edge.to_vec(),
            holders: vec![(worker, 1)],
            total: 1,
        });
        self.children.insert(key, id);
        Some(id)
    }

    /// Splits node `x` after `m` hashes: a new node takes the first `m` and becomes
    /// `x`'s parent. `x` keeps its id so reservations ending at it stay valid.
    fn split(&mut self, x: u32, m: usize) -> u32 {
        let (parent, upper, holders, total) = {
            let n = &mut self.nodes[x as usize];
            let upper: Vec<BlockHash> = n.edge.drain(..m).collect();
            (n.parent, upper, n.holders.clone(), n.total)
        };
        let first = upper[0];
        let p = self.alloc_node(Node {
            parent,
            edge: upper,
            holders,
            total,
        });
        self.children.insert(Self::key(parent, first), p);
        self.nodes[x as usize].parent = p;
        let lower_first = self.nodes[x as usize].edge[0];
        self.children.insert(Self::key(p, lower_first), x);
        p
    }

    /// Adds one pass of `worker` along `hashes`, creating and splitting nodes as
    /// needed; returns the node where the chain ends.
    fn insert_path(&mut self, worker: WorkerIdx, hashes: &[BlockHash]) -> Option<u32> {
        let mut parent = NIL;
        let mut pos = 0;
        loop {
            match self.child(parent, hashes[pos]) {
                Child::Absent => {
                    return match self.new_leaf(parent, &hashes[pos..], worker) {
                        Some(id) => Some(id),
                        None => Self::nonroot(parent),
                    };
                }
                Child::Blocked => return Self::nonroot(parent),
                Child::Found(id) => {
                    let edge_len = self.nodes[id as usize].edge.len();
                    let m = common_prefix(&self.nodes[id as usize].edge, &hashes[pos..]);
                    let node = if m < edge_len { self.split(id, m) } else { id };
                    self.add_holder(node, worker);
                    pos += m;
                    if pos == hashes.len() {
                        return Some(node);
                    }
                    if m < edge_len {
                        return match self.new_leaf(node, &hashes[pos..], worker) {
                            Some(leaf) => Some(leaf),
                            None => Some(node),
                        };
                    }
                    parent = node;
                }
            }
        }
    }

    fn nonroot(node: u32) -> Option<u32> {
        (node != NIL).then_some(node)
    }

    /// Ends the live reservation in `slot`: unwinds its path and unlists it.
    fn end(&mut self, slot: u32) {
        let (worker, leaf, pos, deepest) = {
            let r = &mut self.slots[slot as usize];
            r.live = false;
            (r.worker, r.leaf, r.pos, r.deepest)
        };
        self.live -= 1;
        self.free_slots.push(slot);
        if let Some(v) = self.by_deepest.get_mut(&deepest) {
            if let Some(i) = v.iter().position(|&s| s == slot) {
                v.swap_remove(i);
            }
            if v.is_empty() {
                self.by_deepest.remove(&deepest);
            }
        }
        if let Some(list) = self.by_worker.get_mut(worker.index()) {
            let pos = pos as usize;
            if pos < list.len() && list[pos] == slot {
                list.swap_remove(pos);
                if let Some(&moved) = list.get(pos) {
                    self.slots[moved as usize].pos = pos as u32;
                }
            }
        }
        let mut id = leaf;
        while id != NIL {
            let n = &mut self.nodes[id as usize];
            n.total -= 1;
            if let Ok(i) = n.holders.binary_search_by_key(&worker, |h| h.0) {
                n.holders[i].1 -= 1;
                if n.holders[i].1 == 0 {
                    n.holders.remove(i);
                }
            }
            let parent = n.parent;
            if n.total == 0 {
                // Nothing passes through it, so nothing passes through its children
                // either: they were freed on the way up.
                let key = Self::key(parent, n.edge[0]);
                n.edge = Vec::new();
                if self.children.get(&key) == Some(&id) {
                    self.children.remove(&key);
                }
                self.free_nodes.push(id);
            }
            id = parent;
        }
    }
}

/// Length of the common prefix of two hash chains that agree on their first element.
/// Chained hashes agree on a prefix and then never again, so test the last position
/// first (the common case: the whole run matches) and bisect otherwise.
fn common_prefix(edge: &[BlockHash], hashes: &[BlockHash]) -> usize {
    let len = edge.len().min(hashes.len());
    if len == 0 || edge[0] != hashes[0] {
        return 0;
    }
    if edge[len - 1] == hashes[len - 1] {
        return len;
    }
    // Invariant: edge[lo - 1] matches, edge[hi - 1] does not.
    let (mut lo, mut hi) = (1, len);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if edge[mid - 1] == hashes[mid - 1] {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A prompt shorter than one block has no chain: reserving it is a no-op that
    /// says so, as documented, not an out-of-bounds panic on a request path.
    #[test]
    fn an_empty_chain_reserves_nothing() {
        let mut r = Reservations::new(1_000);
        assert_eq!(r.reserve(WorkerIdx(0), &[], 0), None);
        assert!(r.is_empty());
        assert_eq!(r.pending(&[]).deepest(), 0);
    }

    fn chain_from(prefix: &[BlockHash], salt: u64, n: usize) -> Vec<BlockHash> {
        let mut out = prefix.to_vec();
        let mut h = prefix.last().map_or(salt, |b| b.0 ^ salt.rotate_left(23));
        for _ in 0..n {
            h = (h ^ 0x5bd1_e995)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(27);
            out.push(BlockHash(h));
        }
        out
    }

    fn w(i: u32) -> WorkerIdx {
        WorkerIdx(i)
    }

    #[test]
    fn common_prefix_of_chains() {
        let a = chain_from(&[], 1, 10);
        let b = chain_from(&a[..6], 2, 4);
        assert_eq!(common_prefix(&a, &b), 6);
        assert_eq!(common_prefix(&a, &a), 10);
        assert_eq!(common_prefix(&a[..3], &b), 3);
        assert_eq!(common_prefix(&a, &chain_from(&[], 3, 4)), 0);
        for k in 1..10 {
            let c = chain_from(&a[..k], 9, 3);
            assert_eq!(common_prefix(&a, &c), k);
        }
    }

    #[test]
    fn siblings_see_a_pending_holder() {
        let mut r = Reservations::new(1_000);
        let prefix = chain_from(&[], 7, 100);
        let a = chain_from(&prefix, 1, 3);
        let b = chain_from(&prefix, 2, 3);
        let id = r.reserve(w(2), &a, 0).unwrap();
        let m = r.pending(&b);
        assert_eq!(m.depth(w(2)), 100);
        assert_eq!(r.pending(&a).depth(w(2)), 103);
        assert_eq!(r.pending(&prefix[..40]).depth(w(2)), 40);
        r.reserve(w(3), &b, 0).unwrap();
        let m = r.pending(&b);
        assert_eq!((m.depth(w(2)), m.depth(w(3))), (100, 103));
        assert!(r.release(id));
        assert!(!r.release(id), "stale ids are ignored");
        assert_eq!(r.pending(&b).depth(w(2)), 0);
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn expiry_is_lazy_and_exact() {
        let mut r = Reservations::new(100);
        let a = chain_from(&[], 1, 5);
        r.reserve(w(0), &a, 10).unwrap();
        r.reserve(w(1), &a[..2], 50).unwrap();
        assert_eq!(r.expire(109), 0);
        assert_eq!(r.expire(110), 1);
        assert_eq!(r.pending(&a).depth(w(0)), 0);
        assert_eq!(r.pending(&a).depth(w(1)), 2);
        assert_eq!(r.expire(1_000), 1);
        assert!(r.is_empty());
        assert_eq!(r.node_count(), 0);
    }

    #[test]
    fn a_reservation_lasts_while_its_request_runs_and_a_grace_after_it_ends() {
        let mut r = Reservations::new(600_000).with_grace(30_000);
        let a = chain_from(&[], 1, 5);
        let b = chain_from(&[], 2, 5);
        let queued = r.reserve(w(0), &a, 0).unwrap();
        let done = r.reserve(w(1), &b, 0).unwrap();
        // A request queued for minutes keeps its prefix findable.
        assert_eq!(r.expire(300_000), 0);
        assert_eq!(r.pending(&a).depth(w(0)), 5);
        // One that ended unconfirmed counts for the grace only.
        r.finish(done, 300_000);
        assert_eq!(r.expire(329_999), 0);
        assert_eq!(r.expire(330_000), 1);
        assert_eq!(r.pending(&b).depth(w(1)), 0);
        // Finishing an ended reservation, or twice, changes nothing.
        r.finish(done, 330_000);
        r.finish(queued, 590_000);
        r.finish(queued, 595_000);
        assert_eq!(r.expire(599_999), 0);
        assert_eq!(r.expire(600_000), 1);
        assert!(r.is_empty());
    }

    #[test]
    fn expiry_queues_stay_proportional_to_live_reservations() {
        let mut r = Reservations::new(600_000).with_grace(30_000);
        for i in 0..10_000u64 {
            let c = chain_from(&[], i, 2);
            let id = r.reserve(w(0), &c, i).unwrap();
            r.finish(id, i);
            assert!(r.release(id));
        }
        assert!(r.is_empty());
        assert!(r.expiry.len() <= 2 * r.len() + 66, "{}", r.expiry.len());
        assert!(r.ending.len() <= 2 * r.len() + 66, "{}", r.ending.len());
    }

    #[test]
    fn confirm_and_remove_worker() {
        let mut r = Reservations::new(100);
        let a = chain_from(&[], 1, 5);
        let b = chain_from(&a[..2], 2, 5);
        r.reserve(w(0), &a, 0).unwrap();
        r.reserve(w(0), &b, 0).unwrap();
        r.reserve(w(1), &b, 0).unwrap();
        assert_eq!(r.confirm(w(0), |h| h == a[4]), 1);
        assert_eq!(r.worker_len(w(0)), 1);
        // A `Stored` event confirms only the storing worker's reservations.
        let c = chain_from(&a[..2], 3, 2);
        r.reserve(w(0), &c, 0).unwrap();
        r.reserve(w(1), &c, 0).unwrap();
        assert_eq!(r.confirm_stored(w(0), &c[2..]), 1);
        assert_eq!(r.confirm_stored(w(0), &c[2..]), 0);
        assert_eq!(r.pending(&c).depth(w(1)), 4);
        assert_eq!(r.confirm_stored(w(1), &c[3..]), 1);
        assert_eq!(r.remove_worker(w(1)), 1);
        assert_eq!(r.pending(&b).depth(w(0)), 7);
        assert_eq!(r.pending(&b).depth(w(1)), 0);
        assert_eq!(r.remove_worker(w(0)), 1);
        assert!(r.is_empty());
        assert_eq!(r.node_count(), 0);
        // Expiry entries of ended reservations are skipped.
        assert_eq!(r.expire(u64::MAX), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The trie agrees with a plain list of reserved chains.
        #[test]
        fn trie_matches_naive_list(
            ops in proptest::collection::vec((0u32..4, 0usize..5, 1usize..30, 0usize..4), 1..40)
        ) {
            // A small family of chains sharing prefixes of various lengths.
            let root = chain_from(&[], 99, 40);
            let family: Vec<Vec<BlockHash>> = vec![
                root.clone(),
                chain_from(&root[..10], 1, 20),
                chain_from(&root[..25], 2, 10),
                chain_from(&root[..10], 3, 5),
                chain_from(&[], 4, 30),
            ];
            let mut r = Reservations::new(1_000);
            let mut live: Vec<(ReservationId, WorkerIdx, Vec<BlockHash>)> = Vec::new();
            for (worker, c, len, action) in ops {
                if action == 2 && !live.is_empty() {
                    let (id, _, _) = live.remove(len % live.len());
                    prop_assert!(r.release(id));
                } else if action == 3 {
                    // A `Stored` event of `worker` for a slice of a chain ends exactly
                    // that worker's reservations whose deepest block is in it.
                    let ch = &family[c];
                    let stored = &ch[len.min(ch.len()) / 2..len.min(ch.len())];
                    let before = live.len();
                    live.retain(|(_, wk, chain)| {
                        !(*wk == WorkerIdx(worker) && chain.last().is_some_and(|h| stored.contains(h)))
                    });
                    prop_assert_eq!(r.confirm_stored(WorkerIdx(worker), stored), before - live.len());
                } else {
                    let ch = &family[c];
                    let chain = ch[..len.min(ch.len())].to_vec();
                    let id = r.reserve(WorkerIdx(worker), &chain, 0).unwrap();
                    live.push((id, WorkerIdx(worker), chain));
                }
                prop_assert_eq!(r.len(), live.len());
                for q in &family {
                    for n in [1, 5, 10, 11, 25, 26, q.len()] {
                        let q = &q[..n.min(q.len())];
                        let got = r.pending(q);
                        for wk in 0..4u32 {
                            let want = live
                                .iter()
                                .filter(|(_, w, _)| *w == WorkerIdx(wk))
                                .map(|(_, _, ch)| common_prefix(ch, q))
                                .max()
                                .unwrap_or(0);
                            prop_assert_eq!(got.depth(WorkerIdx(wk)), want);
                            prop_assert_eq!(r.depth_of(WorkerIdx(wk), q), want);
                        }
                    }
                }
            }
            for (id, _, _) in live {
                prop_assert!(r.release(id));
            }
            prop_assert_eq!(r.node_count(), 0);
            prop_assert!(r.children.is_empty());
            prop_assert!(r.by_deepest.is_empty());
        }
    }
}
