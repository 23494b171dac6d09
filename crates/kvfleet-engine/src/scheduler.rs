//! Continuous batching: which sequences run this step, and how many tokens each.
//!
//! Every step has a token budget. Running sequences go first, oldest first: a decoding
//! sequence takes one token, a prefilling one takes a chunk of its prompt. Then waiting
//! sequences are admitted in arrival order (strict FCFS: if the oldest cannot get its
//! blocks, nobody behind it jumps the queue). When blocks run out for a running
//! sequence, the newest running sequence is preempted: its blocks are released
//! (tail-first, so its prefix stays cached) and it is recomputed later, keeping every
//! token it generated, so no request is lost. A sequence that cannot grow while it runs
//! alone has outgrown the pool: it is reported in `exhausted` for the engine to end.
//!
//! Prefix reuse happens at admission (the longest run of cached blocks) and at every
//! block allocation (a block some other sequence published in the meantime). A block
//! that another sequence is computing right now is taken by reference, and this
//! sequence waits for it instead of computing it again.
//!
//! A waiting sequence is admitted only while the free blocks also cover what the
//! running sequences and it are expected to generate ([`crate::decode_reserve`]):
//! admitting on prompt room alone makes the running sequences preempt each other as
//! they grow.
//!
//! A sequence queued behind others holds its cached prefix (a reference on each ready
//! block, while the waiting sequences have taken at most half the pool from the free
//! blocks: a prefix queued siblings share counts once) until it is admitted, and
//! the rest of it is made the most recently used, so the admissions ahead of it evict
//! other blocks first. A hold only ever yields: when a running or admitted sequence
//! finds no free block, the youngest waiting sequence's hold is released before
//! anything is preempted or the queue stops.

use crate::block_pool::BlockPool;
use crate::decode_reserve::{DecodeReserve, DecodeReserveConfig};
use crate::sequence::{RequestId, SeqStatus, Sequence};
use kvfleet_core::BlockHashMap;
use std::collections::{HashMap, VecDeque};

/// Limits that shape each step.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences admitted at once.
    pub max_num_seqs: usize,
    /// Most tokens run through the model in one step (chunked prefill budget).
    pub max_batched_tokens: usize,
    /// Most prompt tokens one sequence may run in one step, so that several prefills
    /// advance together instead of one long prompt holding the whole budget.
    pub max_prefill_chunk: usize,
    /// The room kept for the tokens sequences have yet to generate.
    pub decode_reserve: DecodeReserveConfig,
}

/// A piece of work for one step: run `len` tokens of `seq` from `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    /// The sequence.
    pub seq: RequestId,
    /// First position to compute.
    pub start: usize,
    /// Number of tokens.
    pub len: usize,
}

/// Sequences, their queues and the block pool they draw from.
pub struct Scheduler {
    /// Limits.
    pub config: SchedulerConfig,
    /// The KV block pool.
    pub pool: BlockPool,
    /// Every unfinished sequence.
    pub seqs: HashMap<RequestId, Sequence>,
    /// Admitted sequences, oldest first.
    pub running: Vec<RequestId>,
    /// Queued sequences, oldest first.
    pub waiting: VecDeque<RequestId>,
    /// Sequences preempted during the last `schedule` (for metrics and tests).
    pub preempted_last_step: Vec<RequestId>,
    /// Sequences the last `schedule` found unable to grow although they held the
    /// whole pool: the engine ends them (`Length`) instead of preempting them and
    /// re-admitting them forever. They are out of `running` but still in `seqs`.
    pub exhausted: Vec<RequestId>,
    /// The share of their remaining `max_tokens` sequences are expected to generate.
    reserve: DecodeReserve,
}

enum Grow {
    /// The blocks needed are held; this many tokens may run.
    Ok(usize),
    /// The pool is exhausted.
    NoBlocks,
}

impl Scheduler {
    /// A scheduler over a pool of `num_blocks` blocks.
    pub fn new(config: SchedulerConfig, num_blocks: usize) -> Self {
        Scheduler {
            reserve: DecodeReserve::new(config.decode_reserve),
            config,
            pool: BlockPool::new(num_blocks),
            seqs: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            preempted_last_step: Vec::new(),
            exhausted: Vec::new(),
        }
    }

    /// Queues a sequence (in arrival order); it holds, or touches, the cached blocks
    /// of its prompt (see [`Self::hold_prefix`]).
    pub fn enqueue(&mut self, mut seq: Sequence) {
        let id = seq.id;
        self.hold_prefix(&mut seq);
        self.seqs.insert(id, seq);
        self.insert_waiting(id);
    }

    /// Keeps the cached leading blocks of `seq`'s prompt for it until it is admitted:
    /// it takes a reference on each ready one while the waiting sequences have taken at
    /// most half the pool to hold ([`Sequence::staged`], released at admission), and
    /// touches the rest, deepest first so that its root is the most recent. A block
    /// someone else references (a queued sibling's hold, a running sequence) is held
    /// at no cost: it takes nothing more from the free pool.
    ///
    /// Without it, the admissions queued ahead of a request evict its prefix when that
    /// is the least recent, and the request recomputes a prefix that was cached when it
    /// arrived (and when the router chose this worker for it). A touch alone is undone
    /// by the requests ahead that finish meanwhile: their released blocks become more
    /// recent than it. SGLang's scheduler keeps waiting requests' prefixes the same way
    /// (its radix cache's prefix match updates their access times).
    fn hold_prefix(&mut self, seq: &mut Sequence) {
        let max_blocks = seq.reusable_blocks(self.config.block_size);
        let cached = seq.hashes[..max_blocks]
            .iter()
            .take_while(|&&h| self.pool.lookup(h).is_some())
            .count();
        // Only a block nobody references counts against the cap: fork siblings queued
        // together hold their shared prefix once.
        let mut room = (self.pool.num_blocks() / 2).saturating_sub(self.held_by_waiting());
        let mut held = 0;
        for &h in &seq.hashes[..cached] {
            let Some(b) = self.pool.lookup(h).filter(|&b| self.pool.is_ready(b)) else {
                break;
            };
            let free = self.pool.ref_count(b) == 0;
            if free && room == 0 {
                break;
            }
            let Some(b) = self.pool.acquire(h) else { break };
            seq.staged.push(b);
            if free {
                seq.staged_free += 1;
                room -= 1;
            }
            held += 1;
        }
        for &h in seq.hashes[held..cached].iter().rev() {
            self.pool.touch(h);
        }
    }

    /// Blocks the waiting sequences took from the free pool to hold until their
    /// admission.
    fn held_by_waiting(&self) -> usize {
        self.waiting
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| s.staged_free)
            .sum()
    }

    /// Releases the blocks held by the youngest waiting sequence that holds any (never
    /// `except`), for a sequence that found no free block. Returns whether it released
    /// some.
    fn release_youngest_hold(&mut self, except: Option<RequestId>) -> bool {
        let Some(&id) = self.waiting.iter().rev().find(|&&w| {
            Some(w) != except && self.seqs.get(&w).is_some_and(|s| !s.staged.is_empty())
        }) else {
            return false;
        };
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        release_staged(&mut self.pool, seq, id);
        // What it held may have been promoted from a lower tier: it looks again.
        seq.tier_staged = false;
        true
    }

    /// Puts a known sequence in the waiting queue at its arrival position.
    fn insert_waiting(&mut self, id: RequestId) {
        let arrival = self.seqs.get(&id).map_or(u64::MAX, |s| s.arrival);
        let pos = self
            .waiting
            .iter()
            .position(|w| self.seqs.get(w).is_some_and(|s| s.arrival > arrival))
            .unwrap_or(self.waiting.len());
        self.waiting.insert(pos, id);
    }

    /// Prompt tokens the worker has yet to compute, over all unfinished sequences: a
    /// reusable block that several of them share (fork siblings queued behind the
    /// first) counts once, and one already computed (ready in the pool, for a sequence
    /// still waiting) not at all. Routers read this as the worker's prefill backlog;
    /// counting a shared prefix once per sibling made a fork's holder look busier the
    /// more siblings it had, and pushed later siblings off it.
    pub fn queued_prefill_tokens(&self) -> usize {
        let bs = self.config.block_size.max(1);
        let mut counted: BlockHashMap<()> = BlockHashMap::default();
        let mut total = 0;
        for s in self.seqs.values() {
            let remaining = s.prompt_len.saturating_sub(s.num_computed);
            if remaining == 0 {
                continue;
            }
            // Blocks a sequence may reuse: every full block before the one holding its
            // last prompt token (whose logits it computes itself).
            let shareable = (s.prompt_len.saturating_sub(1) / bs).min(s.hashes.len());
            let mut skipped = 0;
            for i in s.num_computed / bs..shareable {
                let h = s.hashes[i];
                let ready = self.pool.lookup(h).is_some_and(|b| self.pool.is_ready(b));
                if ready || counted.insert(h, ()).is_some() {
                    skipped += (i + 1) * bs - (i * bs).max(s.num_computed);
                }
            }
            total += remaining.saturating_sub(skipped);
        }
        total
    }

    /// Decides this step's work.
    pub fn schedule(&mut self) -> Vec<ScheduledChunk> {
        self.preempted_last_step.clear();
        self.exhausted.clear();
        let mut budget = self.config.max_batched_tokens;
        let mut chunks = Vec::new();

        let mut i = 0;
        while i < self.running.len() {
            if budget == 0 {
                break;
            }
            let id = self.running[i];
            loop {
                let cap = budget.min(self.config.max_prefill_chunk);
                match self.grow(id, cap) {
                    Grow::Ok(0) => break,
                    Grow::Ok(n) => {
                        chunks.push(self.chunk_of(id, n));
                        budget -= n;
                        break;
                    }
                    Grow::NoBlocks => {
                        // A waiting sequence's hold yields first.
                        if self.release_youngest_hold(None) {
                            continue;
                        }
                        // Evict the newest running sequence; it may be this one.
                        let Some(victim) = self.running.last().copied() else {
                            break;
                        };
                        if victim == id && self.running.len() == 1 {
                            // Alone, it holds every block it could ever get: preempting
                            // it would only re-admit it into the same wall.
                            self.running.retain(|r| *r != id);
                            self.exhausted.push(id);
                            break;
                        }
                        self.preempt(victim);
                        if victim == id {
                            break;
                        }
                    }
                }
            }
            if self.running.get(i) == Some(&id) {
                i += 1;
            }
        }

        if self.preempted_last_step.is_empty() && !self.running.is_empty() {
            self.reserve.relax();
        }
        // What the running sequences are expected to grow by, in blocks.
        let mut reserved = self.reserved_growth();
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            // A sequence whose prefix is still being read from disk waits for it (it
            // is not short of blocks, so the next one in line may go first).
            let Some(pos) = self
                .waiting
                .iter()
                .position(|w| self.seqs.get(w).is_none_or(|s| s.awaiting_loads == 0))
            else {
                break;
            };
            let id = self.waiting[pos];
            // Strict FCFS: while the head's expected blocks do not fit beside the
            // running sequences' expected growth, nobody is admitted (a lone sequence
            // always is).
            if self.reserve.enabled() && !self.running.is_empty() && !self.fits_beside(id, reserved)
            {
                break;
            }
            self.admit_prefix(id);
            let cap = budget.min(self.config.max_prefill_chunk);
            let mut grown = self.grow(id, cap);
            // The holds of those behind it yield to the sequence being admitted.
            while matches!(grown, Grow::NoBlocks) && self.release_youngest_hold(Some(id)) {
                grown = self.grow(id, cap);
            }
            match grown {
                Grow::Ok(n) => {
                    self.waiting.remove(pos);
                    if let Some(s) = self.seqs.get_mut(&id) {
                        s.status = SeqStatus::Running;
                    }
                    self.running.push(id);
                    if n > 0 {
                        chunks.push(self.chunk_of(id, n));
                        budget -= n;
                    }
                    // What it took is out of the free pool now; what it will still
                    // take joins the running sequences' reserve.
                    if self.reserve.enabled() {
                        reserved += self.seqs.get(&id).map_or(0, |s| self.growth_blocks(s));
                    }
                }
                Grow::NoBlocks => {
                    self.release_blocks(id);
                    break;
                }
            }
        }
        chunks
    }

    /// The next `len` tokens of `id`, from where its computed prefix ends.
    fn chunk_of(&self, id: RequestId, len: usize) -> ScheduledChunk {
        let start = self.seqs.get(&id).map_or(0, |s| s.num_computed);
        ScheduledChunk {
            seq: id,
            start,
            len,
        }
    }

    /// Records that a chunk's K/V are now computed: publishes the blocks it filled.
    pub fn commit(&mut self, chunk: &ScheduledChunk) {
        let bs = self.config.block_size;
        let Some(seq) = self.seqs.get_mut(&chunk.seq) else {
            return;
        };
        let end = chunk.start + chunk.len;
        if chunk.start < seq.prompt_len {
            seq.prompt_tokens_computed += end.min(seq.prompt_len) - chunk.start;
        }
        seq.num_computed = end;
        for b in chunk.start / bs..end / bs {
            let Some(&id) = seq.block_table.get(b) else {
                continue;
            };
            if self.pool.is_ready(id) {
                continue;
            }
            if self.pool.hash_of(id).is_some() {
                self.pool.mark_ready(id);
            } else if let Some(&h) = seq.hashes.get(b) {
                if !self.pool.publish_ready(id, h, seq.parent_of(b)) {
                    // Computed twice (published elsewhere meanwhile): keep ours private
                    // but valid, so it is not recomputed.
                    self.pool.mark_ready(id);
                }
            } else {
                self.pool.mark_ready(id);
            }
        }
    }

    /// Removes a sequence from the queues, releasing its blocks.
    pub fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        self.release_blocks(id);
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        self.seqs.remove(&id)
    }

    /// Blocks a new sequence may take from the free pool now: the free blocks less
    /// the running sequences' expected growth (with the decode reserve on; the free
    /// blocks without it). A waiting sequence is admitted once its expected blocks
    /// fit in this ([`Self::fits_beside`]), so a router that knows it can tell a
    /// lane that would start a prompt from one that would queue it.
    pub fn admit_headroom(&self) -> usize {
        self.pool.num_free().saturating_sub(self.reserved_growth())
    }

    /// What the running sequences are expected to grow by, in blocks (0 with the
    /// decode reserve off).
    fn reserved_growth(&self) -> usize {
        if !self.reserve.enabled() {
            return 0;
        }
        self.running
            .iter()
            .filter_map(|id| self.seqs.get(id))
            .map(|s| self.growth_blocks(s))
            .sum()
    }

    /// Blocks `s` is expected to take from the free pool as it grows: its whole
    /// expected length (prompt, what it generated, and the reserve's share of what
    /// `max_tokens` still allows) beyond the blocks it holds.
    fn growth_blocks(&self, s: &Sequence) -> usize {
        self.expected_blocks(s).saturating_sub(s.block_table.len())
    }

    /// Whether waiting `id`'s expected blocks fit in the free pool beside `reserved`
    /// blocks of the running sequences' growth. Its leading cached blocks that someone
    /// already references (its own hold, a running sibling) are shared, not taken
    /// from the free pool; the walk over them runs only when the bound without them
    /// does not fit, so a queue head is not re-walked every step while the pool has
    /// room.
    fn fits_beside(&self, id: RequestId, reserved: usize) -> bool {
        let Some(s) = self.seqs.get(&id) else {
            return true;
        };
        let free = self.pool.num_free();
        let expected = self.expected_blocks(s);
        let held = s.block_table.len();
        if reserved + expected.saturating_sub(held) <= free {
            return true;
        }
        let shared = s.hashes[..s.reusable_blocks(self.config.block_size)]
            .iter()
            .map_while(|&h| self.pool.lookup(h))
            .filter(|&b| self.pool.ref_count(b) > 0)
            .count();
        reserved + expected.saturating_sub(held.max(shared)) <= free
    }

    fn expected_blocks(&self, s: &Sequence) -> usize {
        let growth = if s.prefill_only {
            0
        } else {
            self.reserve
                .expected_tokens(s.params.max_tokens, s.num_generated())
        };
        (s.tokens.len() + growth).div_ceil(self.config.block_size.max(1))
    }

    /// Releases a sequence's blocks tail-first and queues it for recomputation.
    pub fn preempt(&mut self, id: RequestId) {
        self.reserve.tighten();
        self.release_blocks(id);
        self.running.retain(|r| *r != id);
        if let Some(s) = self.seqs.get_mut(&id) {
            s.status = SeqStatus::Waiting;
            s.preemptions += 1;
            // Its released prefix may move down a tier before it runs again.
            s.tier_staged = false;
            self.insert_waiting(id);
        }
        self.preempted_last_step.push(id);
    }

    fn release_blocks(&mut self, id: RequestId) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        for b in seq.block_table.drain(..).rev() {
            self.pool.release(b, id);
        }
        release_staged(&mut self.pool, seq, id);
        seq.num_computed = 0;
    }

    /// At admission: take the longest run of cached blocks (ready or in flight) that
    /// starts the prompt, never including the block of the last token (its logits
    /// must be computed).
    fn admit_prefix(&mut self, id: RequestId) {
        let bs = self.config.block_size;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        if !seq.block_table.is_empty() {
            return;
        }
        let max_blocks = seq.reusable_blocks(bs);
        for i in 0..max_blocks {
            match self.pool.acquire(seq.hashes[i]) {
                Some(b) => seq.block_table.push(b),
                None => break,
            }
        }
        // The block table holds its own references to promoted blocks now.
        release_staged(&mut self.pool, seq, id);
        seq.num_computed = 0;
    }

    /// Moves `num_computed` past leading blocks that became ready (computed by others),
    /// then secures blocks for up to `budget` more tokens. Stops early at a block
    /// another sequence is still computing.
    fn grow(&mut self, id: RequestId, budget: usize) -> Grow {
        let bs = self.config.block_size;
        let pool = &mut self.pool;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Grow::Ok(0);
        };
        let total = seq.tokens.len();
        // Take every further block that others have cached or are computing now; the
        // block holding the last token is always our own (its logits run here).
        while seq.block_table.len() < seq.hashes.len() && (seq.block_table.len() + 1) * bs < total {
            match pool.acquire(seq.hashes[seq.block_table.len()]) {
                Some(blk) => seq.block_table.push(blk),
                None => break,
            }
        }
        // Skip blocks others computed for us.
        while seq.num_computed % bs == 0 && seq.num_computed + bs < total {
            match seq.block_table.get(seq.num_computed / bs) {
                Some(&b) if pool.is_ready(b) => seq.num_computed += bs,
                _ => break,
            }
        }
        let start = seq.num_computed;
        let mut end = (start + budget).min(total);
        let mut b = start / bs;
        while b * bs < end {
            if b >= seq.block_table.len() {
                let full_before_last = (b + 1) * bs < total;
                let hash = seq.hashes.get(b).copied();
                let shared = match hash {
                    Some(h) if full_before_last => pool.acquire(h),
                    _ => None,
                };
                match shared {
                    Some(blk) => seq.block_table.push(blk),
                    None => {
                        let Some(blk) = pool.allocate() else {
                            end = end.min(b * bs);
                            if end <= start {
                                return Grow::NoBlocks;
                            }
                            break;
                        };
                        if let Some(h) = hash {
                            pool.publish_in_flight(blk, h, seq.parent_of(b), id);
                        }
                        seq.block_table.push(blk);
                    }
                }
            }
            let blk = seq.block_table[b];
            let in_flight_elsewhere =
                !pool.is_ready(blk) && pool.hash_of(blk).is_some() && !pool.claim(blk, id);
            if in_flight_elsewhere {
                end = end.min(b * bs).max(start);
                break;
            }
            if pool.is_ready(blk) && b * bs > start {
                // A block someone else computed lies ahead: stop before it, never
                // write into a shared block; the next step skips over it.
                end = b * bs;
                break;
            }
            b += 1;
        }
        Grow::Ok(end - start)
    }
}

/// Releases the blocks `seq` (request `id`) held until its admission ([`Sequence::staged`]),
/// tail first, and what its hold took from the free pool with them.
fn release_staged(pool: &mut BlockPool, seq: &mut Sequence, id: RequestId) {
    for b in seq.staged.drain(..).rev() {
        pool.release(b, id);
    }
    seq.staged_free = 0;
}
