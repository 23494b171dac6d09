//! The fleet prefix index: which workers hold which KV blocks.
//!
//! Every cached block is keyed by its chained hash and carries a bitset of the workers
//! holding it (one bit per [`WorkerIdx`], `stride` 64-bit words wide) plus its parent
//! link. Workers report changes as [`RouterKvEvent`]s with gap-free sequence numbers;
//! the index applies them in order and reports a gap instead of guessing, so the caller
//! can resync the worker from a [`CacheDump`].
//!
//! # Lookup and the prefix-closure assumption
//!
//! A worker's *matched depth* for a request is the length of the longest prefix of the
//! request's block hashes that the worker holds. Workers free blocks tail-first and
//! evict least-recently-used leaves, so a worker's cached set is prefix-closed: holding
//! block `i` of a chain implies holding blocks `0..i`. Then the holder set `S(i)` of the
//! request's `i`-th hash shrinks monotonically with `i`, and it changes only where some
//! worker's match ends. [`PrefixIndex::find_matches`] exploits this: it probes the first
//! and last hash and bisects only intervals whose ends differ, so a request that is
//! cached to full depth costs two probes, and one with `k` distinct match depths costs
//! about `k·log2(n)` probes instead of `n`. Since `S(lo) ⊇ S(hi)`, the ends are
//! compared by holder *count*, which the hash table stores next to each key; a
//! worker bitset is read only where the set actually changes.
//!
//! If a worker's set is *not* prefix-closed (it holds block `i` but lost an earlier
//! one — the engine does not do this, but a lost `Removed` event could), bisection may
//! miss that worker's exit inside an interval, so its depth is *overestimated*, never
//! underestimated: a depth is recorded only at a position where the worker's bit is
//! actually clear, which is at or after its first miss. An overestimate costs at most
//! one misrouted request, whose prefill the worker then redoes and re-announces.
//! [`PrefixIndex::find_matches_exact`] walks every hash and is exact in all cases.
//!
//! # Costs
//!
//! Applying an event costs one probe of an open-addressing table per block. Each worker also keeps an
//! append-only log of the slots it set, compacted when it grows past twice the worker's
//! block count, so `Cleared`, [`PrefixIndex::remove_worker`] and
//! [`PrefixIndex::rebuild_worker`] cost time proportional to that worker's blocks, not
//! to the whole index.
//!
//! # Tiers
//!
//! Workers with host and disk tiers below the device pool report each tier's own
//! `Stored`/`Removed` (tagged with its [`Medium`]); a block may sit in several tiers at
//! once. The device tier is this index's own table, so [`PrefixIndex::find_matches`]
//! and its cost are unchanged; each lower tier is a nested index of the same shape,
//! created on its first event. [`PrefixIndex::find_tiered_matches`] adds, per worker,
//! how many blocks after its device match it can load from host and then disk: it
//! walks each such worker's tail only, with each position's tier probes shared by every
//! worker, and when no lower-tier block exists it is `find_matches` plus a copy.

use crate::events::{CacheDump, DumpedBlock, Medium, RouterKvEvent, RouterKvEventKind};
use crate::registry::WorkerIdx;
use kvfleet_core::BlockHash;
use std::ops::Range;
use table::BlockTable;

mod table;

/// Why an event could not be applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The event's sequence number skips ahead: events in between were lost. The event
    /// was not applied; resync the worker with a cache dump (`rebuild_worker`).
    #[error("KV event gap for worker {worker}: expected seq {expected}, got {got}; resync it from a cache dump")]
    Gap {
        /// The worker whose stream has a gap.
        worker: WorkerIdx,
        /// The sequence number that should have come next.
        expected: u64,
        /// The sequence number that came.
        got: u64,
    },
    /// The event names a worker the router does not know.
    #[error("unknown worker {0:?}")]
    UnknownWorker(String),
}

/// Blocks `part` of an event of kind `kind`, clipped to the event's blocks (none for
/// `Cleared`): what one part of [`PrefixIndex::apply_part`] applies.
pub fn event_blocks(kind: &RouterKvEventKind, part: Range<usize>) -> &[BlockHash] {
    match kind {
        RouterKvEventKind::Stored { block_hashes, .. }
        | RouterKvEventKind::Removed { block_hashes, .. } => {
            let end = part.end.min(block_hashes.len());
            block_hashes
                .get(part.start.min(end)..end)
                .unwrap_or_default()
        }
        RouterKvEventKind::Cleared => &[],
    }
}

/// One worker's matched depth, in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerMatch {
    /// The worker.
    pub worker: WorkerIdx,
    /// Length of the longest prefix of the request's hashes the worker holds (≥ 1).
    pub depth: usize,
}

/// The result of a prefix lookup: every worker that matches at least one block, with
/// its depth, sorted by worker index, and the deepest depth overall.
#[derive(Clone, Debug, Default)]
pub struct Matches {
    entries: Vec<WorkerMatch>,
    deepest: usize,
    // Scratch kept between lookups to avoid allocating: the holders of the first
    // block, those of them still matching, and each one's depth by worker index.
    first: Vec<u64>,
    remaining: Vec<u64>,
    depth_of: Vec<usize>,
    // Raises queued by `queue_raise`: the depth by worker index (0: none queued), the
    // workers queued, and room to merge the new ones in.
    raise_to: Vec<usize>,
    raised: Vec<WorkerIdx>,
    merged: Vec<WorkerMatch>,
}

impl PartialEq for Matches {
    fn eq(&self, other: &Self) -> bool {
        self.entries == other.entries && self.deepest == other.deepest
    }
}

impl Eq for Matches {}

impl Matches {
    /// An empty result.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every match.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.deepest = 0;
        for w in self.raised.drain(..) {
            self.raise_to[w.index()] = 0;
        }
    }

    /// The deepest match over all workers, in blocks (0 when nothing matches).
    pub fn deepest(&self) -> usize {
        self.deepest
    }

    /// `worker`'s matched depth in blocks (0 when it matches nothing).
    pub fn depth(&self, worker: WorkerIdx) -> usize {
        match self.entries.binary_search_by_key(&worker, |m| m.worker) {
            Ok(i) => self.entries[i].depth,
            Err(_) => 0,
        }
    }

    /// The matching workers, sorted by index.
    pub fn as_slice(&self) -> &[WorkerMatch] {
        &self.entries
    }

    /// Iterates the matching workers, sorted by index.
    pub fn iter(&self) -> impl Iterator<Item = WorkerMatch> + '_ {
        self.entries.iter().copied()
    }

    /// Number of matching workers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no worker matches.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Raises `worker`'s depth to at least `depth`; used to merge in other sources of
    /// "will hold", such as pending reservations.
    pub fn raise(&mut self, worker: WorkerIdx, depth: usize) {
        if depth == 0 {
            return;
        }
        match self.entries.binary_search_by_key(&worker, |m| m.worker) {
            Ok(i) => {
                let e = &mut self.entries[i];
                e.depth = e.depth.max(depth);
            }
            Err(i) => self.entries.insert(i, WorkerMatch { worker, depth }),
        }
        self.deepest = self.deepest.max(depth);
    }

    /// Queues raising `worker`'s depth to at least `depth`, to be merged in with every
    /// other queued raise by [`apply_raises`](Self::apply_raises): O(1) each, where
    /// [`raise`](Self::raise) searches the entries every time.
    pub fn queue_raise(&mut self, worker: WorkerIdx, depth: usize) {
        if depth == 0 {
            return;
        }
        let w = worker.index();
        if w >= self.raise_to.len() {
            self.raise_to.resize(w + 1, 0);
        }
        if self.raise_to[w] == 0 {
            self.raised.push(worker);
        }
        self.raise_to[w] = self.raise_to[w].max(depth);
    }

    /// Merges every raise queued by [`queue_raise`](Self::queue_raise): one pass over
    /// the entries, and a sort of only the workers that were not matching yet.
    pub fn apply_raises(&mut self) {
        if self.raised.is_empty() {
            return;
        }
        for e in &mut self.entries {
            if let Some(d) = self.raise_to.get_mut(e.worker.index()) {
                if *d > 0 {
                    e.depth = e.depth.max(*d);
                    self.deepest = self.deepest.max(e.depth);
                    *d = 0;
                }
            }
        }
        // Those left were not in the entries: new matches.
        let mut fresh = std::mem::take(&mut self.raised);
        fresh.retain(|w| self.raise_to[w.index()] > 0);
        if !fresh.is_empty() {
            fresh.sort_unstable();
            let mut merged = std::mem::take(&mut self.merged);
            merged.clear();
            let mut old = self.entries.iter().copied().peekable();
            for w in &fresh {
                while let Some(e) = old.next_if(|e| e.worker < *w) {
                    merged.push(e);
                }
                let depth = std::mem::take(&mut self.raise_to[w.index()]);
                self.deepest = self.deepest.max(depth);
                merged.push(WorkerMatch { worker: *w, depth });
            }
            merged.extend(old);
            std::mem::swap(&mut self.entries, &mut merged);
            self.merged = merged;
        }
        fresh.clear();
        self.raised = fresh;
    }

    /// Emits every holder of the first block with its recorded depth, in index order
    /// (walking the bitset yields them sorted, so no sort is needed).
    fn finish(&mut self) {
        for (wi, word) in self.first.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let w = wi * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                let depth = self.depth_of[w];
                self.deepest = self.deepest.max(depth);
                self.entries.push(WorkerMatch {
                    worker: WorkerIdx(w as u32),
                    depth,
                });
            }
        }
    }
}

/// One worker's match over every tier: the blocks of the request's longest prefix that
/// the worker holds in *some* tier, each counted at its fastest tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TieredMatch {
    /// The worker.
    pub worker: WorkerIdx,
    /// Blocks in the device pool: the device match of [`PrefixIndex::find_matches`],
    /// plus any device block after a gap that a lower tier fills (rare: the device
    /// set is prefix-closed).
    pub device: usize,
    /// Blocks found in the host tier (and not on the device).
    pub host: usize,
    /// Blocks found on disk only.
    pub disk: usize,
}

impl TieredMatch {
    /// Length of the prefix reachable through every tier, in blocks.
    pub fn depth(&self) -> usize {
        self.device + self.host + self.disk
    }

    /// Blocks counted at tier `m`.
    pub fn blocks(&self, m: Medium) -> usize {
        match m {
            Medium::Device => self.device,
            Medium::Host => self.host,
            Medium::Disk => self.disk,
        }
    }
}

/// The result of a tiered lookup: every worker matching at least one block in some
/// tier, sorted by worker index, plus the plain device [`Matches`].
#[derive(Clone, Debug, Default)]
pub struct TieredMatches {
    entries: Vec<TieredMatch>,
    device: Matches,
    // Scratch: each position's slot in the device, host and disk tables (ABSENT if the
    // hash is not there), filled lazily up to the furthest position a walk reached.
    slots: Vec<[u32; 3]>,
    candidates: Vec<u64>,
}

impl TieredMatches {
    /// An empty result.
    pub fn new() -> Self {
        Self::default()
    }

    /// The matching workers, sorted by index.
    pub fn as_slice(&self) -> &[TieredMatch] {
        &self.entries
    }

    /// `worker`'s tiered match (all zero when it matches nothing).
    pub fn get(&self, worker: WorkerIdx) -> TieredMatch {
        match self.entries.binary_search_by_key(&worker, |m| m.worker) {
            Ok(i) => self.entries[i],
            Err(_) => TieredMatch {
                worker,
                device: 0,
                host: 0,
                disk: 0,
            },
        }
    }

    /// The device-only matches (what [`PrefixIndex::find_matches`] answers).
    pub fn device(&self) -> &Matches {
        &self.device
    }

    /// Mutable device matches, e.g. to merge pending reservations in with
    /// [`Matches::raise`]; the tiered entries are left as they are.
    pub fn device_mut(&mut self) -> &mut Matches {
        &mut self.device
    }
}

#[derive(Clone, Debug)]
struct Slot {
    hash: BlockHash,
    parent: Option<BlockHash>,
}

/// What one probe of the table found: the block's slot and holder count, or
/// `ABSENT` with no holders.
#[derive(Clone, Copy, Debug)]
struct Probe {
    slot: u32,
    holders: u32,
}

/// Sentinel slot for "hash not in the index" during a lookup.
const ABSENT: u32 = u32::MAX;
const MISS: Probe = Probe {
    slot: ABSENT,
    holders: 0,
};

#[derive(Clone, Debug, Default)]
struct WorkerState {
    last_seq: u64,
    blocks: usize,
    // Slots whose bit this worker set, possibly stale or repeated (see module docs).
    log: Vec<u32>,
}

/// Block hash → holding workers, with per-worker event sequence tracking.
#[derive(Clone, Debug)]
pub struct PrefixIndex {
    // hash → (slot, number of holders); a present key always has holders > 0.
    map: BlockTable,
    slots: Vec<Slot>,
    // `stride` words per slot: bit `w` of slot `s` is bit `w % 64` of
    // `bits[s * stride + w / 64]`. Kept apart from `slots` so lookups touch one line.
    bits: Vec<u64>,
    stride: usize,
    zeros: Vec<u64>,
    free: Vec<u32>,
    workers: Vec<WorkerState>,
    // The host and disk tiers, in that order; empty until a lower-tier event arrives.
    // Their sequence numbers are unused (this index tracks them).
    lower: Vec<PrefixIndex>,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    /// An empty index sized for up to 256 workers (it widens itself as needed).
    pub fn new() -> Self {
        Self::with_capacity(0, 256)
    }

    /// An empty index with room for `blocks` blocks and `workers` workers.
    pub fn with_capacity(blocks: usize, workers: usize) -> Self {
        let stride = workers.div_ceil(64).max(1);
        Self {
            map: BlockTable::with_capacity(blocks),
            slots: Vec::with_capacity(blocks),
            bits: Vec::with_capacity(blocks * stride),
            stride,
            zeros: vec![0; stride],
            free: Vec::new(),
            workers: Vec::new(),
            lower: Vec::new(),
        }
    }

    /// Number of distinct blocks cached on some worker's device.
    pub fn num_blocks(&self) -> usize {
        self.map.len()
    }

    /// Number of blocks `worker` holds on its device; O(1).
    pub fn worker_block_count(&self, worker: WorkerIdx) -> usize {
        self.workers.get(worker.index()).map_or(0, |w| w.blocks)
    }

    /// Number of blocks `worker` holds in tier `medium`; O(1).
    pub fn tier_block_count(&self, worker: WorkerIdx, medium: Medium) -> usize {
        self.tier(medium)
            .map_or(0, |t| t.worker_block_count(worker))
    }

    /// Whether any worker holds a block in a host or disk tier.
    pub fn has_lower_tiers(&self) -> bool {
        self.lower.iter().any(|t| t.num_blocks() > 0)
    }

    /// Whether `worker` holds the block `hash` in tier `medium`.
    pub fn holds_in(&self, worker: WorkerIdx, hash: BlockHash, medium: Medium) -> bool {
        self.tier(medium).is_some_and(|t| t.holds(worker, hash))
    }

    /// Sequence number of the last event applied for `worker` (0 before any).
    pub fn last_seq(&self, worker: WorkerIdx) -> u64 {
        self.workers.get(worker.index()).map_or(0, |w| w.last_seq)
    }

    /// Whether `worker` holds the block `hash` on its device.
    pub fn holds(&self, worker: WorkerIdx, hash: BlockHash) -> bool {
        self.map
            .get(hash.0)
            .is_some_and(|e| self.has_bit(e.slot, worker))
    }

    /// Every block `worker` holds, once per tier holding it, in no particular order;
    /// the same shape as a worker's cache dump.
    pub fn worker_blocks(&self, worker: WorkerIdx) -> Vec<DumpedBlock> {
        let mut out = self.device_blocks(worker);
        for (t, medium) in self.lower.iter().zip([Medium::Host, Medium::Disk]) {
            out.extend(
                t.device_blocks(worker)
                    .into_iter()
                    .map(|b| DumpedBlock { medium, ..b }),
            );
        }
        out
    }

    /// The blocks of this table (not of its lower tiers) that `worker` holds.
    fn device_blocks(&self, worker: WorkerIdx) -> Vec<DumpedBlock> {
        let Some(state) = self.workers.get(worker.index()) else {
            return Vec::new();
        };
        let mut slots: Vec<u32> = state
            .log
            .iter()
            .copied()
            .filter(|&s| self.has_bit(s, worker))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        slots
            .into_iter()
            .map(|s| {
                let slot = &self.slots[s as usize];
                DumpedBlock::device(slot.hash, slot.parent)
            })
            .collect()
    }

    /// Applies one event of `worker`. A sequence number at or below the last applied
    /// one is a duplicate and is ignored; one that skips ahead is a [`IndexError::Gap`]
    /// and is not applied.
    pub fn apply(&mut self, worker: WorkerIdx, event: &RouterKvEvent) -> Result<(), IndexError> {
        self.apply_part(worker, event, 0..usize::MAX).map(|_| ())
    }

    /// Applies blocks `part` of one event of `worker` ([`Self::apply`] a part at a
    /// time, so that a caller holding a lock for each part never holds it for a whole
    /// large event). A coalesced event is a run of single-block changes in the order
    /// the worker made them, so each part leaves the index as the worker was at some
    /// moment. The first part (`part.start == 0`) checks the sequence number; the
    /// last one records it. Returns whether to go on with the next part: `false` for
    /// a duplicate, after the last part, or when `worker`'s sequence moved meanwhile
    /// (a rebuild): the event's remaining parts are then dropped. A part that does not
    /// follow its previous one, or lies past the event's blocks, applies nothing.
    pub fn apply_part(
        &mut self,
        worker: WorkerIdx,
        event: &RouterKvEvent,
        part: Range<usize>,
    ) -> Result<bool, IndexError> {
        self.ensure_worker(worker);
        let last = self.workers[worker.index()].last_seq;
        if event.seq <= last {
            return Ok(false);
        }
        if event.seq != last + 1 {
            // On the first part a gap; on a later one the sequence moved meanwhile.
            return if part.start == 0 {
                Err(IndexError::Gap {
                    worker,
                    expected: last + 1,
                    got: event.seq,
                })
            } else {
                Ok(false)
            };
        }
        let len = event_blocks(&event.kind, 0..usize::MAX).len();
        let end = part.end.min(len);
        self.apply_kind(worker, &event.kind, part.start..end);
        if end >= len {
            self.workers[worker.index()].last_seq = event.seq;
            return Ok(false);
        }
        Ok(true)
    }

    /// Replaces everything known about `worker` with a cache dump reflecting its
    /// events up to `seq`; the next event expected is `seq + 1`.
    pub fn rebuild_worker(&mut self, worker: WorkerIdx, dump: &CacheDump, seq: u64) {
        self.begin_rebuild(worker);
        self.insert_dumped(worker, dump);
        self.end_rebuild(worker, seq);
    }

    /// The first step of [`rebuild_worker`](Self::rebuild_worker) in parts: forgets
    /// every block of `worker`, in every tier.
    pub fn begin_rebuild(&mut self, worker: WorkerIdx) {
        self.ensure_worker(worker);
        self.clear_all_tiers(worker);
    }

    /// Adds dumped blocks of `worker` (a part of its dump, parents before children).
    pub fn insert_dumped(&mut self, worker: WorkerIdx, part: &CacheDump) {
        self.ensure_worker(worker);
        for b in part.iter() {
            self.tier_mut(worker, b.medium)
                .insert_block(worker, b.hash, b.parent);
        }
    }

    /// The last step of a rebuild in parts: the dump was taken at event `seq`.
    pub fn end_rebuild(&mut self, worker: WorkerIdx, seq: u64) {
        self.ensure_worker(worker);
        self.workers[worker.index()].last_seq = seq;
    }

    /// Drops every block of `worker` and forgets its sequence number, so that its
    /// index can be given to another worker.
    pub fn remove_worker(&mut self, worker: WorkerIdx) {
        if worker.index() < self.workers.len() {
            self.clear_worker(worker);
            self.workers[worker.index()] = WorkerState::default();
        }
        for t in &mut self.lower {
            t.remove_worker(worker);
        }
    }

    /// Matched depth of every worker for `hashes` (a chain of block hashes), by
    /// bisection over the prefix-closed holder sets; see the module docs.
    pub fn find_matches(&self, hashes: &[BlockHash]) -> Matches {
        let mut out = Matches::new();
        self.find_matches_into(hashes, &mut out);
        out
    }

    /// [`find_matches`](Self::find_matches) into a reused result, without allocating
    /// once `out` has grown to size.
    pub fn find_matches_into(&self, hashes: &[BlockHash], out: &mut Matches) {
        out.clear();
        let Some(s0) = self.start_lookup(hashes, out) else {
            return;
        };
        let last = hashes.len() - 1;
        if last > 0 {
            let p_last = self.probe(hashes[last]);
            self.bisect(hashes, 0, s0, last, p_last, out);
        }
        self.finish_lookup(hashes.len(), out);
    }

    /// Matched depth of every worker for `hashes`, walking every hash until no worker
    /// is left. Exact even when a worker's set is not prefix-closed, but costs one
    /// probe per matched block.
    pub fn find_matches_exact(&self, hashes: &[BlockHash]) -> Matches {
        let mut out = Matches::new();
        if self.start_lookup(hashes, &mut out).is_none() {
            return out;
        }
        for (i, h) in hashes.iter().enumerate().skip(1) {
            let slot = self.probe(*h).slot;
            self.exit_at(slot, i, &mut out);
            if out.remaining.iter().all(|w| *w == 0) {
                break;
            }
        }
        self.finish_lookup(hashes.len(), &mut out);
        out
    }

    /// Every worker's match over all tiers for `hashes`; see [`TieredMatch`].
    pub fn find_tiered_matches(&self, hashes: &[BlockHash]) -> TieredMatches {
        let mut out = TieredMatches::new();
        self.find_tiered_matches_into(hashes, &mut out);
        out
    }

    /// [`find_tiered_matches`](Self::find_tiered_matches) into a reused result. The
    /// device depths come from [`find_matches`](Self::find_matches) (bisection); each
    /// worker's tail after its device depth is then walked block by block, checking
    /// device, host and disk, until it holds a block in none.
    pub fn find_tiered_matches_into(&self, hashes: &[BlockHash], out: &mut TieredMatches) {
        out.entries.clear();
        self.find_matches_into(hashes, &mut out.device);
        if !self.has_lower_tiers() || hashes.is_empty() {
            out.entries.extend(out.device.iter().map(|m| TieredMatch {
                worker: m.worker,
                device: m.depth,
                host: 0,
                disk: 0,
            }));
            return;
        }
        let tiers: [&PrefixIndex; 3] = [
            self,
            self.tier(Medium::Host).unwrap_or(self),
            self.tier(Medium::Disk).unwrap_or(self),
        ];
        // An empty lower table is never probed.
        let nonempty = |m| self.tier(m).is_some_and(|t| t.num_blocks() > 0);
        let present = [true, nonempty(Medium::Host), nonempty(Medium::Disk)];
        // Candidates: every worker holding the first block in some tier.
        let words = tiers.iter().map(|t| t.stride).max().unwrap_or(1);
        out.candidates.clear();
        out.candidates.resize(words, 0);
        for (t, _) in tiers.iter().zip(present).filter(|(_, p)| *p) {
            let set = t.set(t.probe(hashes[0]).slot);
            for (c, w) in out.candidates.iter_mut().zip(set) {
                *c |= w;
            }
        }
        out.slots.clear();
        let TieredMatches {
            entries,
            device,
            slots,
            candidates,
        } = out;
        for (wi, word) in candidates.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let worker = WorkerIdx((wi * 64 + bits.trailing_zeros() as usize) as u32);
                bits &= bits - 1;
                let mut m = TieredMatch {
                    worker,
                    device: device.depth(worker),
                    host: 0,
                    disk: 0,
                };
                for i in m.device..hashes.len() {
                    while slots.len() <= i {
                        let h = hashes[slots.len()];
                        slots.push(std::array::from_fn(|t| {
                            if present[t] {
                                tiers[t].probe(h).slot
                            } else {
                                ABSENT
                            }
                        }));
                    }
                    let at = slots[i];
                    if at[0] != ABSENT && tiers[0].has_bit(at[0], worker) {
                        m.device += 1;
                    } else if at[1] != ABSENT && tiers[1].has_bit(at[1], worker) {
                        m.host += 1;
                    } else if at[2] != ABSENT && tiers[2].has_bit(at[2], worker) {
                        m.disk += 1;
                    } else {
                        break;
                    }
                }
                if m.depth() > 0 {
                    entries.push(m);
                }
            }
        }
    }

    // --- internals -------------------------------------------------------------

    /// The table of tier `medium`, if it exists.
    fn tier(&self, medium: Medium) -> Option<&PrefixIndex> {
        match medium {
            Medium::Device => Some(self),
            Medium::Host => self.lower.first(),
            Medium::Disk => self.lower.get(1),
        }
    }

    /// The table of tier `medium`, created if needed, with room for `worker`.
    fn tier_mut(&mut self, worker: WorkerIdx, medium: Medium) -> &mut PrefixIndex {
        let i = match medium {
            Medium::Device => {
                self.ensure_worker(worker);
                return self;
            }
            Medium::Host => 0,
            Medium::Disk => 1,
        };
        if self.lower.is_empty() {
            let workers = self.stride * 64;
            self.lower = vec![
                PrefixIndex::with_capacity(0, workers),
                PrefixIndex::with_capacity(0, workers),
            ];
        }
        let t = &mut self.lower[i];
        t.ensure_worker(worker);
        t
    }

    /// Drops `worker`'s blocks from every tier.
    fn clear_all_tiers(&mut self, worker: WorkerIdx) {
        self.clear_worker(worker);
        for t in &mut self.lower {
            t.clear_worker(worker);
        }
    }

    /// Probes the first hash and seeds `out.remaining` with its holders.
    fn start_lookup(&self, hashes: &[BlockHash], out: &mut Matches) -> Option<Probe> {
        out.clear();
        let first = *hashes.first()?;
        let p0 = self.probe(first);
        if p0.slot == ABSENT {
            return None;
        }
        let set = self.set(p0.slot);
        out.first.clear();
        out.first.extend_from_slice(set);
        out.remaining.clear();
        out.remaining.extend_from_slice(set);
        if out.depth_of.len() < set.len() * 64 {
            out.depth_of.resize(set.len() * 64, 0);
        }
        Some(p0)
    }

    /// Workers never seen leaving hold the whole request.
    fn finish_lookup(&self, n: usize, out: &mut Matches) {
        for (wi, word) in out.remaining.iter_mut().enumerate() {
            let mut bits = std::mem::take(word);
            while bits != 0 {
                out.depth_of[wi * 64 + bits.trailing_zeros() as usize] = n;
                bits &= bits - 1;
            }
        }
        out.finish();
    }

    /// Records depth `pos` for every still-remaining worker missing from `slot`
    /// (the holder set at position `pos`).
    fn exit_at(&self, slot: u32, pos: usize, out: &mut Matches) {
        let set = self.set(slot);
        for (wi, (rem, held)) in out.remaining.iter_mut().zip(set).enumerate() {
            let mut gone = *rem & !held;
            *rem &= held;
            while gone != 0 {
                out.depth_of[wi * 64 + gone.trailing_zeros() as usize] = pos;
                gone &= gone - 1;
            }
        }
    }

    /// Finds every change of holder set strictly inside `(lo, hi]`, in position order,
    /// given the probes at both ends.
    ///
    /// Under prefix closure `S(lo) ⊇ S(hi)`, so equal holder *counts* mean equal sets:
    /// intervals are compared by the count stored next to the key, and a worker
    /// bitset is read only where a set actually changes. Without closure the count
    /// test can hide a change, which can only delay a worker's recorded exit
    /// (an overestimate): exits are recorded solely at positions where the bitset
    /// shows the worker absent.
    ///
    /// (Splitting into 4 or 8 parts per round, so that a round's probes overlap their
    /// cache misses, measured no faster than bisection on a 1M-block index: most
    /// probes hit the last-level cache, where the extra probes cost more than the
    /// overlap saves.)
    fn bisect(
        &self,
        hashes: &[BlockHash],
        lo: usize,
        p_lo: Probe,
        hi: usize,
        p_hi: Probe,
        out: &mut Matches,
    ) {
        if p_lo.holders == p_hi.holders {
            return;
        }
        if hi - lo == 1 {
            self.exit_at(p_hi.slot, hi, out);
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let p_mid = self.probe(hashes[mid]);
        self.bisect(hashes, lo, p_lo, mid, p_mid, out);
        self.bisect(hashes, mid, p_mid, hi, p_hi, out);
    }

    #[inline]
    fn probe(&self, hash: BlockHash) -> Probe {
        match self.map.get(hash.0) {
            Some(e) => Probe {
                slot: e.slot,
                holders: e.holders,
            },
            None => MISS,
        }
    }

    #[inline]
    fn set(&self, slot: u32) -> &[u64] {
        if slot == ABSENT {
            &self.zeros
        } else {
            let s = slot as usize * self.stride;
            &self.bits[s..s + self.stride]
        }
    }

    #[inline]
    fn has_bit(&self, slot: u32, worker: WorkerIdx) -> bool {
        let w = worker.index();
        if w / 64 >= self.stride {
            return false;
        }
        self.bits
            .get(slot as usize * self.stride + w / 64)
            .is_some_and(|word| word & (1 << (w % 64)) != 0)
    }

    fn ensure_worker(&mut self, worker: WorkerIdx) {
        let w = worker.index();
        if w >= self.workers.len() {
            self.workers.resize_with(w + 1, WorkerState::default);
        }
        if w / 64 >= self.stride {
            self.restride((w / 64 + 1).next_power_of_two());
        }
    }

    /// Widens every bitset to `stride` words; rare (the fleet outgrew the width).
    fn restride(&mut self, stride: usize) {
        let mut bits = vec![0u64; self.slots.len() * stride];
        for (s, chunk) in self.bits.chunks_exact(self.stride).enumerate() {
            bits[s * stride..s * stride + self.stride].copy_from_slice(chunk);
        }
        self.bits = bits;
        self.stride = stride;
        self.zeros = vec![0; stride];
    }

    /// Applies blocks `blocks` of an event of kind `kind` (a `Cleared` event for the
    /// range starting at 0).
    fn apply_kind(&mut self, worker: WorkerIdx, kind: &RouterKvEventKind, blocks: Range<usize>) {
        match kind {
            RouterKvEventKind::Stored {
                parent_hash,
                block_hashes,
                medium,
            } => {
                let part = event_blocks(kind, blocks.clone());
                let tier = self.tier_mut(worker, *medium);
                // A part after the first hangs under the block before it.
                let mut parent = match blocks.start {
                    0 => *parent_hash,
                    i => block_hashes.get(i - 1).copied(),
                };
                for &h in part {
                    tier.insert_block(worker, h, parent);
                    parent = Some(h);
                }
            }
            // A tier that never received a block has nothing to remove.
            RouterKvEventKind::Removed { medium, .. }
                if medium.is_device() || !self.lower.is_empty() =>
            {
                let tier = self.tier_mut(worker, *medium);
                for &h in event_blocks(kind, blocks) {
                    tier.remove_block(worker, h);
                }
            }
            RouterKvEventKind::Removed { .. } => {}
            RouterKvEventKind::Cleared => {
                if blocks.start == 0 {
                    self.clear_all_tiers(worker);
                }
            }
        }
    }

    /// Marks `worker` as holding `hash`. The caller has run `ensure_worker`.
    fn insert_block(&mut self, worker: WorkerIdx, hash: BlockHash, parent: Option<BlockHash>) {
        let stride = self.stride;
        let (slots, bits, free) = (&mut self.slots, &mut self.bits, &mut self.free);
        let (entry, _) = self.map.get_or_insert_with(hash.0, || match free.pop() {
            Some(s) => {
                // A freed slot's bits are all clear: it had no holders left.
                slots[s as usize] = Slot { hash, parent };
                s
            }
            None => {
                slots.push(Slot { hash, parent });
                bits.resize(bits.len() + stride, 0);
                (slots.len() - 1) as u32
            }
        });
        let slot = entry.slot;
        let w = worker.index();
        let word = &mut self.bits[slot as usize * stride + w / 64];
        let mask = 1u64 << (w % 64);
        if *word & mask != 0 {
            return;
        }
        *word |= mask;
        entry.holders += 1;
        let state = &mut self.workers[w];
        state.blocks += 1;
        state.log.push(slot);
        if state.log.len() > 2 * state.blocks + 64 {
            // Drop stale and repeated entries; amortised O(1) per insert.
            let bits = &self.bits;
            state
                .log
                .retain(|&s| bits[s as usize * stride + w / 64] & mask != 0);
            state.log.sort_unstable();
            state.log.dedup();
        }
    }

    fn remove_block(&mut self, worker: WorkerIdx, hash: BlockHash) {
        if let Some(slot) = self.map.get(hash.0).map(|e| e.slot) {
            self.clear_bit(worker, slot);
        }
    }

    /// Clears `worker`'s bit on `slot`, freeing the slot when nobody holds it.
    fn clear_bit(&mut self, worker: WorkerIdx, slot: u32) {
        let w = worker.index();
        let word = &mut self.bits[slot as usize * self.stride + w / 64];
        let mask = 1u64 << (w % 64);
        if *word & mask == 0 {
            return;
        }
        *word &= !mask;
        self.workers[w].blocks -= 1;
        let hash = self.slots[slot as usize].hash;
        if let Some(e) = self.map.get_mut(hash.0) {
            e.holders -= 1;
            if e.holders == 0 {
                self.map.remove(hash.0);
                self.free.push(slot);
            }
        }
    }

    fn clear_worker(&mut self, worker: WorkerIdx) {
        let Some(state) = self.workers.get_mut(worker.index()) else {
            return;
        };
        let mut log = std::mem::take(&mut state.log);
        for &slot in &log {
            self.clear_bit(worker, slot);
        }
        log.clear();
        self.workers[worker.index()].log = log;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    proptest! {
        /// Raises queued and merged at once leave the same matches as raising one at a
        /// time, whatever the order, repeats and workers already matching.
        #[test]
        fn queued_raises_equal_raising_one_at_a_time(
            base in proptest::collection::btree_map(0u32..300, 1usize..50, 0..40),
            raises in proptest::collection::vec((0u32..300, 0usize..60), 0..200),
        ) {
            let mut seed = Matches::new();
            for (w, d) in &base {
                seed.raise(WorkerIdx(*w), *d);
            }
            let mut one = seed.clone();
            let mut queued = seed.clone();
            for (w, d) in &raises {
                one.raise(WorkerIdx(*w), *d);
                queued.queue_raise(WorkerIdx(*w), *d);
            }
            queued.apply_raises();
            prop_assert_eq!(&queued, &one);
            prop_assert_eq!(queued.deepest(), one.deepest());
            // The scratch is left clean: a second round behaves the same.
            queued.queue_raise(WorkerIdx(299), 70);
            one.raise(WorkerIdx(299), 70);
            queued.apply_raises();
            prop_assert_eq!(&queued, &one);
        }
    }

    fn chain(seed: u64, n: usize) -> Vec<BlockHash> {
        // Chained like real block hashes: each depends on its parent.
        let mut out = Vec::with_capacity(n);
        let mut h = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for i in 0..n {
            h = (h ^ (i as u64 + 1))
                .wrapping_mul(0xBF58_476D_1CE4_E5B9)
                .rotate_left(31);
            out.push(BlockHash(h));
        }
        out
    }

    fn extend(prefix: &[BlockHash], seed: u64, n: usize) -> Vec<BlockHash> {
        let mut out = prefix.to_vec();
        let mut h = prefix.last().map_or(seed, |b| b.0 ^ seed.rotate_left(17));
        for _ in 0..n {
            h = (h ^ 0xA5A5)
                .wrapping_mul(0x94D0_49BB_1331_11EB)
                .rotate_left(29);
            out.push(BlockHash(h));
        }
        out
    }

    fn w(i: u32) -> WorkerIdx {
        WorkerIdx(i)
    }

    #[test]
    fn depths_per_worker() {
        let mut idx = PrefixIndex::new();
        let a = chain(1, 10);
        idx.apply(w(0), &RouterKvEvent::stored(1, None, a[..10].to_vec()))
            .unwrap();
        idx.apply(w(1), &RouterKvEvent::stored(1, None, a[..4].to_vec()))
            .unwrap();
        idx.apply(w(2), &RouterKvEvent::stored(1, None, a[..1].to_vec()))
            .unwrap();
        let m = idx.find_matches(&a);
        assert_eq!(m.depth(w(0)), 10);
        assert_eq!(m.depth(w(1)), 4);
        assert_eq!(m.depth(w(2)), 1);
        assert_eq!(m.deepest(), 10);
        assert_eq!(m.len(), 3);
        assert_eq!(m, idx.find_matches_exact(&a));
        let other = chain(2, 5);
        assert!(idx.find_matches(&other).is_empty());
        assert!(idx.find_matches(&[]).is_empty());
        assert_eq!(idx.num_blocks(), 10);
        assert_eq!(idx.worker_block_count(w(1)), 4);
    }

    #[test]
    fn an_event_applied_in_parts_leaves_what_it_leaves_whole() {
        let a = chain(9, 40);
        let b = extend(&a[..10], 3, 25);
        let events = [
            RouterKvEvent::stored(1, None, a.clone()),
            RouterKvEvent::stored(2, Some(a[9]), b[10..].to_vec()),
            // Evicted tail first, as the engine frees them.
            RouterKvEvent::removed(3, a[12..].iter().rev().copied().collect()),
        ];
        let mut whole = PrefixIndex::new();
        let mut parts = PrefixIndex::new();
        for e in &events {
            whole.apply(w(0), e).unwrap();
            let mut start = 0;
            let mut applied = 0;
            while parts.apply_part(w(0), e, start..start + 7).unwrap() {
                start += 7;
                applied += 1;
                // Between parts: the worker as it was part-way, never past the event.
                assert_eq!(parts.last_seq(w(0)), e.seq - 1);
            }
            assert!(applied > 0, "every event here is longer than a part");
            assert_eq!(parts.last_seq(w(0)), e.seq);
        }
        let blocks = |idx: &PrefixIndex| {
            let mut v: Vec<u64> = idx.worker_blocks(w(0)).iter().map(|d| d.hash.0).collect();
            v.sort_unstable();
            v
        };
        assert_eq!(blocks(&parts), blocks(&whole));
        assert_eq!(parts.find_matches(&a).depth(w(0)), 12);
        assert_eq!(parts.find_matches(&b).depth(w(0)), 35);
        // A duplicate stops at once; a gap is an error on the first part only.
        assert_eq!(parts.apply_part(w(0), &events[1], 0..7), Ok(false));
        let late = RouterKvEvent::stored(5, None, chain(11, 20));
        assert!(matches!(
            parts.apply_part(w(0), &late, 0..7),
            Err(IndexError::Gap {
                expected: 4,
                got: 5,
                ..
            })
        ));
        // A part past the event's blocks applies nothing.
        let mut past = PrefixIndex::new();
        let short = RouterKvEvent::stored(1, None, chain(13, 5));
        assert_eq!(past.apply_part(w(0), &short, 7..14), Ok(false));
        assert_eq!(past.worker_block_count(w(0)), 0);
        // A rebuild between two parts drops the event's remaining parts.
        let next = RouterKvEvent::stored(4, None, chain(12, 20));
        assert_eq!(parts.apply_part(w(0), &next, 0..7), Ok(true));
        parts.rebuild_worker(w(0), &[], 9);
        assert_eq!(parts.apply_part(w(0), &next, 7..14), Ok(false));
        assert_eq!(parts.worker_block_count(w(0)), 0);
        assert_eq!(parts.last_seq(w(0)), 9);
    }

    #[test]
    fn gaps_are_reported_and_not_applied() {
        let mut idx = PrefixIndex::new();
        let a = chain(3, 4);
        idx.apply(w(0), &RouterKvEvent::stored(1, None, a[..2].to_vec()))
            .unwrap();
        let err = idx
            .apply(w(0), &RouterKvEvent::stored(3, Some(a[1]), a[2..].to_vec()))
            .unwrap_err();
        assert_eq!(
            err,
            IndexError::Gap {
                worker: w(0),
                expected: 2,
                got: 3
            }
        );
        assert_eq!(idx.find_matches(&a).depth(w(0)), 2);
        assert_eq!(idx.last_seq(w(0)), 1);
        // A fresh worker whose first event is not 1 is also a gap.
        assert!(matches!(
            idx.apply(w(1), &RouterKvEvent::cleared(5)),
            Err(IndexError::Gap {
                expected: 1,
                got: 5,
                ..
            })
        ));
    }

    #[test]
    fn duplicates_are_idempotent() {
        let mut idx = PrefixIndex::new();
        let a = chain(4, 6);
        let e1 = RouterKvEvent::stored(1, None, a.clone());
        let e2 = RouterKvEvent::removed(2, a[3..].to_vec());
        idx.apply(w(0), &e1).unwrap();
        idx.apply(w(0), &e2).unwrap();
        let before = idx.find_matches(&a);
        // Replays of both, in any order, change nothing.
        idx.apply(w(0), &e1).unwrap();
        idx.apply(w(0), &e2).unwrap();
        idx.apply(w(0), &e1).unwrap();
        assert_eq!(idx.find_matches(&a), before);
        assert_eq!(before.depth(w(0)), 3);
        assert_eq!(idx.worker_block_count(w(0)), 3);
        assert_eq!(idx.last_seq(w(0)), 2);
    }

    #[test]
    fn clear_remove_and_rebuild() {
        let mut idx = PrefixIndex::new();
        let a = chain(5, 8);
        idx.apply(w(0), &RouterKvEvent::stored(1, None, a.clone()))
            .unwrap();
        idx.apply(w(1), &RouterKvEvent::stored(1, None, a[..5].to_vec()))
            .unwrap();
        let dump = idx.worker_blocks(w(1));
        assert_eq!(dump.len(), 5);
        assert!(dump.contains(&DumpedBlock::device(a[0], None)));
        assert!(dump.contains(&DumpedBlock::device(a[3], Some(a[2]))));
        idx.apply(w(0), &RouterKvEvent::cleared(2)).unwrap();
        assert_eq!(idx.worker_block_count(w(0)), 0);
        assert_eq!(idx.num_blocks(), 5);
        idx.remove_worker(w(1));
        assert_eq!(idx.num_blocks(), 0);
        assert_eq!(idx.last_seq(w(1)), 0);
        idx.rebuild_worker(w(1), &dump, 40);
        assert_eq!(idx.find_matches(&a).depth(w(1)), 5);
        assert_eq!(idx.last_seq(w(1)), 40);
        assert!(idx.apply(w(1), &RouterKvEvent::cleared(41)).is_ok());
        assert_eq!(idx.num_blocks(), 0);
    }

    #[test]
    fn non_closed_sets_overestimate_but_never_underestimate() {
        let mut idx = PrefixIndex::new();
        let a = chain(6, 16);
        idx.apply(w(0), &RouterKvEvent::stored(1, None, a.clone()))
            .unwrap();
        // A hole in the middle of the chain.
        idx.apply(w(0), &RouterKvEvent::removed(2, vec![a[7]]))
            .unwrap();
        assert_eq!(idx.find_matches_exact(&a).depth(w(0)), 7);
        assert!(idx.find_matches(&a).depth(w(0)) >= 7);
    }

    #[test]
    fn widens_past_256_workers() {
        let mut idx = PrefixIndex::new();
        let a = chain(7, 3);
        idx.apply(w(3), &RouterKvEvent::stored(1, None, a.clone()))
            .unwrap();
        idx.apply(w(700), &RouterKvEvent::stored(1, None, a[..2].to_vec()))
            .unwrap();
        let m = idx.find_matches(&a);
        assert_eq!(m.depth(w(3)), 3);
        assert_eq!(m.depth(w(700)), 2);
        assert!(idx.holds(w(700), a[1]));
        assert!(!idx.holds(w(700), a[2]));
    }

    #[test]
    fn log_compaction_keeps_counts_right() {
        let mut idx = PrefixIndex::new();
        let a = chain(8, 4);
        let mut seq = 0;
        for _ in 0..500 {
            seq += 1;
            idx.apply(w(0), &RouterKvEvent::stored(seq, None, a.clone()))
                .unwrap();
            seq += 1;
            idx.apply(w(0), &RouterKvEvent::removed(seq, a[1..].to_vec()))
                .unwrap();
        }
        assert_eq!(idx.worker_block_count(w(0)), 1);
        assert_eq!(
            idx.worker_blocks(w(0)),
            vec![DumpedBlock::device(a[0], None)]
        );
        idx.remove_worker(w(0));
        assert_eq!(idx.num_blocks(), 0);
    }

    #[test]
    fn tiers_are_independent_and_priced_at_the_fastest() {
        let mut idx = PrefixIndex::new();
        let a = chain(9, 12);
        let ev = |seq, kind| RouterKvEvent { seq, kind };
        let stored = |hashes: &[BlockHash], parent, medium| RouterKvEventKind::Stored {
            parent_hash: parent,
            block_hashes: hashes.to_vec(),
            medium,
        };
        // w0: device 0..4, host 0..8 (written behind), disk 8..12.
        idx.apply(w(0), &ev(1, stored(&a[..4], None, Medium::Device)))
            .unwrap();
        idx.apply(w(0), &ev(2, stored(&a[..8], None, Medium::Host)))
            .unwrap();
        idx.apply(w(0), &ev(3, stored(&a[8..], Some(a[7]), Medium::Disk)))
            .unwrap();
        // w1: host only, 0..6.
        idx.apply(w(1), &ev(1, stored(&a[..6], None, Medium::Host)))
            .unwrap();
        assert!(idx.has_lower_tiers());
        assert_eq!(idx.num_blocks(), 4, "num_blocks counts the device tier");
        assert_eq!(idx.tier_block_count(w(0), Medium::Host), 8);
        assert_eq!(idx.find_matches(&a).depth(w(0)), 4);
        assert_eq!(idx.find_matches(&a).depth(w(1)), 0);
        let t = idx.find_tiered_matches(&a);
        let m0 = t.get(w(0));
        assert_eq!((m0.device, m0.host, m0.disk), (4, 4, 4));
        assert_eq!(m0.depth(), 12);
        let m1 = t.get(w(1));
        assert_eq!((m1.device, m1.host, m1.disk), (0, 6, 0));
        assert_eq!(t.as_slice().len(), 2);
        // Dropping the host copies leaves the device copies, and the reverse.
        idx.apply(
            w(0),
            &ev(
                4,
                RouterKvEventKind::Removed {
                    block_hashes: a[..8].to_vec(),
                    medium: Medium::Host,
                },
            ),
        )
        .unwrap();
        assert_eq!(idx.find_matches(&a).depth(w(0)), 4);
        let m0 = idx.find_tiered_matches(&a).get(w(0));
        assert_eq!((m0.device, m0.host, m0.disk), (4, 0, 0));
        idx.apply(
            w(1),
            &ev(
                2,
                RouterKvEventKind::Removed {
                    block_hashes: a[..6].to_vec(),
                    medium: Medium::Device,
                },
            ),
        )
        .unwrap();
        assert_eq!(idx.find_tiered_matches(&a).get(w(1)).host, 6);
        // The dump lists each tier; a rebuild from it restores all of them.
        let dump = idx.worker_blocks(w(0));
        assert_eq!(dump.len(), 8);
        assert!(dump.contains(&DumpedBlock {
            hash: a[9],
            parent: Some(a[8]),
            medium: Medium::Disk
        }));
        idx.apply(w(0), &RouterKvEvent::cleared(5)).unwrap();
        assert_eq!(idx.tier_block_count(w(0), Medium::Disk), 0);
        assert_eq!(idx.find_tiered_matches(&a).get(w(0)).depth(), 0);
        idx.rebuild_worker(w(0), &dump, 9);
        assert_eq!(idx.tier_block_count(w(0), Medium::Disk), 4);
        assert!(idx.holds_in(w(0), a[2], Medium::Device));
        assert!(!idx.holds_in(w(0), a[2], Medium::Host));
        idx.remove_worker(w(0));
        idx.remove_worker(w(1));
        assert!(!idx.has_lower_tiers());
    }

    #[test]
    fn without_lower_tiers_the_tiered_lookup_is_the_device_lookup() {
        let mut idx = PrefixIndex::new();
        let a = chain(10, 6);
        idx.apply(w(2), &RouterKvEvent::stored(1, None, a[..3].to_vec()))
            .unwrap();
        let t = idx.find_tiered_matches(&a);
        assert_eq!(
            t.as_slice(),
            &[TieredMatch {
                worker: w(2),
                device: 3,
                host: 0,
                disk: 0
            }]
        );
        assert_eq!(t.device(), &idx.find_matches(&a));
    }

    // --- model-based tests ------------------------------------------------------

    /// The naive reference: per-worker sets of hashes.
    #[derive(Default)]
    struct Model {
        sets: BTreeMap<u32, BTreeSet<BlockHash>>,
        // Host (false) and disk (true) sets per worker.
        lower: BTreeMap<(u32, bool), BTreeSet<BlockHash>>,
    }

    impl Model {
        fn depth(&self, worker: u32, hashes: &[BlockHash]) -> usize {
            let set = self.sets.get(&worker);
            hashes
                .iter()
                .take_while(|h| set.is_some_and(|s| s.contains(h)))
                .count()
        }

        /// (device, host, disk): the device depth, then each following block at its
        /// fastest tier until one is in none.
        fn tiered(&self, worker: u32, hashes: &[BlockHash]) -> (usize, usize, usize) {
            let has = |set: Option<&BTreeSet<BlockHash>>, h| set.is_some_and(|s| s.contains(h));
            let (dev, host, disk) = (
                self.sets.get(&worker),
                self.lower.get(&(worker, false)),
                self.lower.get(&(worker, true)),
            );
            let mut r = (self.depth(worker, hashes), 0, 0);
            for h in &hashes[r.0..] {
                if has(dev, h) {
                    r.0 += 1;
                } else if has(host, h) {
                    r.1 += 1;
                } else if has(disk, h) {
                    r.2 += 1;
                } else {
                    break;
                }
            }
            r
        }

        fn forget(&mut self, worker: u32) {
            self.sets.remove(&worker);
            self.lower.remove(&(worker, false));
            self.lower.remove(&(worker, true));
        }
    }

    fn medium(disk: bool) -> Medium {
        if disk {
            Medium::Disk
        } else {
            Medium::Host
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Worker stores `len` blocks of chain `c` starting at block `from`.
        Store {
            worker: u32,
            c: usize,
            from: usize,
            len: usize,
        },
        /// Worker drops the last `k` blocks it holds of chain `c` (tail-first).
        RemoveTail {
            worker: u32,
            c: usize,
            k: usize,
        },
        /// Worker drops one arbitrary block of chain `c` (may break closure).
        RemoveAt {
            worker: u32,
            c: usize,
            at: usize,
        },
        Clear {
            worker: u32,
        },
        RemoveWorker {
            worker: u32,
        },
        Rebuild {
            worker: u32,
        },
        /// Worker stores `len` blocks of chain `c` from `from` in its host or disk tier
        /// (lower tiers need not be prefix-closed).
        StoreLower {
            worker: u32,
            c: usize,
            from: usize,
            len: usize,
            disk: bool,
        },
        /// Worker drops one block of chain `c` from its host or disk tier.
        RemoveLower {
            worker: u32,
            c: usize,
            at: usize,
            disk: bool,
        },
    }

    fn op(closed: bool) -> impl Strategy<Value = Op> {
        let workers = 0u32..6;
        let store = (workers.clone(), 0usize..4, 0usize..24, 1usize..24).prop_map(
            |(worker, c, from, len)| Op::Store {
                worker,
                c,
                from,
                len,
            },
        );
        let tail = (workers.clone(), 0usize..4, 1usize..12)
            .prop_map(|(worker, c, k)| Op::RemoveTail { worker, c, k });
        let at = (workers.clone(), 0usize..4, 0usize..32)
            .prop_map(|(worker, c, at)| Op::RemoveAt { worker, c, at });
        let clear = workers.clone().prop_map(|worker| Op::Clear { worker });
        let rm = workers
            .clone()
            .prop_map(|worker| Op::RemoveWorker { worker });
        let rebuild = workers.clone().prop_map(|worker| Op::Rebuild { worker });
        let store_lower = (
            workers.clone(),
            0usize..4,
            0usize..24,
            1usize..24,
            any::<bool>(),
        )
            .prop_map(|(worker, c, from, len, disk)| Op::StoreLower {
                worker,
                c,
                from,
                len,
                disk,
            });
        let remove_lower =
            (workers, 0usize..4, 0usize..32, any::<bool>()).prop_map(|(worker, c, at, disk)| {
                Op::RemoveLower {
                    worker,
                    c,
                    at,
                    disk,
                }
            });
        if closed {
            prop_oneof![6 => store, 3 => tail, 1 => clear, 1 => rm, 1 => rebuild,
                4 => store_lower, 2 => remove_lower]
            .boxed()
        } else {
            prop_oneof![6 => store, 2 => tail, 3 => at, 1 => clear, 1 => rm, 1 => rebuild,
                4 => store_lower, 2 => remove_lower]
            .boxed()
        }
    }

    /// Four chains of 32 blocks; chains 1..3 share prefixes with chain 0 so holder
    /// sets overlap the way fork families do.
    fn chains() -> Vec<Vec<BlockHash>> {
        let base = chain(42, 32);
        vec![
            base.clone(),
            extend(&base[..8], 1, 24),
            extend(&base[..20], 2, 12),
            chain(43, 32),
        ]
    }

    fn run(ops: &[Op], closed: bool) -> Result<(), TestCaseError> {
        let chains = chains();
        let mut idx = PrefixIndex::new();
        let mut model = Model::default();
        let mut seqs: BTreeMap<u32, u64> = BTreeMap::new();
        for o in ops {
            match *o {
                Op::Store {
                    worker,
                    c,
                    from,
                    len,
                } => {
                    let ch = &chains[c];
                    let set = model.sets.entry(worker).or_default();
                    // Closed mode: only extend what the worker already holds.
                    let from = if closed {
                        ch.iter().take_while(|h| set.contains(h)).count()
                    } else {
                        from.min(ch.len())
                    };
                    let to = (from + len).min(ch.len());
                    if from >= to {
                        continue;
                    }
                    let parent = from.checked_sub(1).map(|p| ch[p]);
                    set.extend(&ch[from..to]);
                    let seq = seqs.entry(worker).or_default();
                    *seq += 1;
                    let ev = RouterKvEvent::stored(*seq, parent, ch[from..to].to_vec());
                    prop_assert!(idx.apply(WorkerIdx(worker), &ev).is_ok());
                }
                Op::RemoveTail { worker, c, k } => {
                    let set = model.sets.entry(worker).or_default();
                    let mut gone = Vec::new();
                    for _ in 0..k {
                        let Some(&last) = chains[c].iter().rev().find(|h| set.contains(h)) else {
                            break;
                        };
                        // In closed mode only leaves go: no held block may have `last`
                        // as its parent (chains share prefixes, so look at all of them).
                        let has_child = chains.iter().any(|ch| {
                            ch.iter()
                                .position(|x| *x == last)
                                .is_some_and(|p| p + 1 < ch.len() && set.contains(&ch[p + 1]))
                        });
                        if closed && has_child {
                            break;
                        }
                        set.remove(&last);
                        gone.push(last);
                    }
                    let seq = seqs.entry(worker).or_default();
                    *seq += 1;
                    let ev = RouterKvEvent::removed(*seq, gone);
                    prop_assert!(idx.apply(WorkerIdx(worker), &ev).is_ok());
                }
                Op::RemoveAt { worker, c, at } => {
                    let h = chains[c][at % chains[c].len()];
                    model.sets.entry(worker).or_default().remove(&h);
                    let seq = seqs.entry(worker).or_default();
                    *seq += 1;
                    let ev = RouterKvEvent::removed(*seq, vec![h]);
                    prop_assert!(idx.apply(WorkerIdx(worker), &ev).is_ok());
                }
                Op::Clear { worker } => {
                    model.forget(worker);
                    let seq = seqs.entry(worker).or_default();
                    *seq += 1;
                    prop_assert!(idx
                        .apply(WorkerIdx(worker), &RouterKvEvent::cleared(*seq))
                        .is_ok());
                }
                Op::RemoveWorker { worker } => {
                    model.forget(worker);
                    seqs.remove(&worker);
                    idx.remove_worker(WorkerIdx(worker));
                }
                Op::Rebuild { worker } => {
                    // Resync from the index's own view, at a jumped sequence number.
                    let dump = idx.worker_blocks(WorkerIdx(worker));
                    let seq = seqs.entry(worker).or_default();
                    *seq += 100;
                    idx.rebuild_worker(WorkerIdx(worker), &dump, *seq);
                    for (m, want) in [
                        (Medium::Device, model.sets.get(&worker)),
                        (Medium::Host, model.lower.get(&(worker, false))),
                        (Medium::Disk, model.lower.get(&(worker, true))),
                    ] {
                        let set: BTreeSet<BlockHash> = dump
                            .iter()
                            .filter(|d| d.medium == m)
                            .map(|d| d.hash)
                            .collect();
                        prop_assert_eq!(&set, &want.cloned().unwrap_or_default());
                        prop_assert_eq!(idx.tier_block_count(WorkerIdx(worker), m), set.len());
                    }
                }
                Op::StoreLower {
                    worker,
                    c,
                    from,
                    len,
                    disk,
                } => {
                    let ch = &chains[c];
                    let from = from.min(ch.len());
                    let to = (from + len).min(ch.len());
                    if from >= to {
                        continue;
                    }
                    model
                        .lower
                        .entry((worker, disk))
                        .or_default()
                        .extend(&ch[from..to]);
                    let seq = seqs.entry(worker).or_default();
                    *seq += 1;
                    let ev = RouterKvEvent {
                        seq: *seq,
                        kind: RouterKvEventKind::Stored {
                            parent_hash: from.checked_sub(1).map(|p| ch[p]),
                            block_hashes: ch[from..to].to_vec(),
                            medium: medium(disk),
                        },
                    };
                    prop_assert!(idx.apply(WorkerIdx(worker), &ev).is_ok());
                }
                Op::RemoveLower {
                    worker,
                    c,
                    at,
                    disk,
                } => {
                    let h = chains[c][at % chains[c].len()];
                    model.lower.entry((worker, disk)).or_default().remove(&h);
                    let seq = seqs.entry(worker).or_default();
                    *seq += 1;
                    let ev = RouterKvEvent {
                        seq: *seq,
                        kind: RouterKvEventKind::Removed {
                            block_hashes: vec![h],
                            medium: medium(disk),
                        },
                    };
                    prop_assert!(idx.apply(WorkerIdx(worker), &ev).is_ok());
                }
            }
            // Check every chain and some prefixes of them after each step.
            let total: BTreeSet<BlockHash> = model.sets.values().flatten().copied().collect();
            prop_assert_eq!(idx.num_blocks(), total.len());
            for ch in &chains {
                for n in [1, 5, 8, 9, 20, 21, ch.len()] {
                    let q = &ch[..n];
                    let fast = idx.find_matches(q);
                    let exact = idx.find_matches_exact(q);
                    let tiered = idx.find_tiered_matches(q);
                    prop_assert_eq!(tiered.device(), &fast);
                    for worker in 0..6u32 {
                        let want = model.tiered(worker, q);
                        let got = tiered.get(WorkerIdx(worker));
                        if closed {
                            prop_assert_eq!(
                                (got.device, got.host, got.disk),
                                want,
                                "tiered worker {} query {}",
                                worker,
                                n
                            );
                        } else {
                            prop_assert!(got.depth() >= want.0 + want.1 + want.2);
                        }
                    }
                    prop_assert!(tiered.as_slice().iter().all(|m| m.depth() > 0));
                    let mut deepest = 0;
                    for worker in 0..6u32 {
                        let want = model.depth(worker, q);
                        deepest = deepest.max(want);
                        prop_assert_eq!(exact.depth(WorkerIdx(worker)), want);
                        let got = fast.depth(WorkerIdx(worker));
                        if closed {
                            prop_assert_eq!(got, want, "worker {} query {}", worker, n);
                        } else {
                            prop_assert!(got >= want, "underestimate {} < {}", got, want);
                        }
                        prop_assert_eq!(
                            idx.worker_block_count(WorkerIdx(worker)),
                            model.sets.get(&worker).map_or(0, BTreeSet::len)
                        );
                    }
                    prop_assert_eq!(exact.deepest(), deepest);
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn matches_naive_model_when_prefix_closed(ops in proptest::collection::vec(op(true), 1..60)) {
            run(&ops, true)?;
        }

        #[test]
        fn never_underestimates_when_not_closed(ops in proptest::collection::vec(op(false), 1..60)) {
            run(&ops, false)?;
        }
    }
}
