//! Where pinned prefixes live, and each tenant's pin budget.
//!
//! An Anthropic `cache_control` breakpoint pins the prompt's blocks up to it on the
//! worker that computed them, for its `ttl`. The router asks for the pin only when the
//! tenant's pinned bytes (its live pinned blocks, counted once each, times the KV size
//! of a block) stay within its budget; the worker may still refuse when its own cap on
//! pinned blocks is reached. A pin the worker grants is recorded here, block hash →
//! worker and expiry, so that a later request that reuses a live pinned prefix up to
//! its breakpoint (its last pinned block) is routed to that worker
//! ([`PinTable::worker_for`]); one that shares only its first blocks is not.
//!
//! The budget is reserved when the pin is asked for and settled when the worker
//! answers, so concurrent requests of one tenant cannot overshoot it together. The
//! table is bounded: at most `max_blocks` entries (live pins and reservations), a pin
//! past it is refused. Expired entries are dropped lazily, from a min-heap of
//! expiries, on each reservation; the heap is rebuilt when re-pins leave it mostly
//! stale. Each router keeps its own table: with several routers, each enforces the
//! budget for the pins it asked for.

use kvfleet_core::sync::lock;
use kvfleet_core::{BlockHash, BlockHashMap};
use kvfleet_proto::v1 as pb;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

/// Default pin budget of each tenant: 1 GiB of KV blocks.
pub const DEFAULT_PIN_BUDGET_BYTES: u64 = 1 << 30;
/// Default bound of the table: pinned blocks of every tenant together.
pub const DEFAULT_PIN_TABLE_BLOCKS: usize = 1 << 20;

/// Why a pin was not granted; the request is served either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinRefused {
    /// The tenant's pinned bytes would pass its budget.
    OverBudget,
    /// The router's table of pins is full.
    TableFull,
    /// The worker's cap on pinned blocks (a share of its pool) was reached.
    WorkerCapacity,
    /// The worker did not report a pin (it predates pins).
    Unsupported,
    /// The worker held none of the blocks ready to pin.
    NotCached,
}

impl PinRefused {
    /// The reason as the `x-kvfleet-pin` header and metrics name it.
    pub fn as_str(self) -> &'static str {
        match self {
            PinRefused::OverBudget => "over-budget",
            PinRefused::TableFull => "table-full",
            PinRefused::WorkerCapacity => "worker-capacity",
            PinRefused::Unsupported => "unsupported",
            PinRefused::NotCached => "not-cached",
        }
    }
}

/// What became of a request's pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinOutcome {
    /// The prompt's first `blocks` blocks are pinned for `ttl_s` more seconds.
    Pinned {
        /// Leading blocks pinned.
        blocks: usize,
        /// Seconds until the pin expires.
        ttl_s: u64,
    },
    /// Not pinned.
    Refused(PinRefused),
}

impl PinOutcome {
    /// The `x-kvfleet-pin` header's value: `pinned; blocks=N; tokens=T; expires=UNIX`
    /// or `refused; reason=R`.
    pub fn header_value(&self, block_size: usize, unix_now_s: u64) -> String {
        match self {
            PinOutcome::Pinned { blocks, ttl_s } => format!(
                "pinned; blocks={blocks}; tokens={}; expires={}",
                blocks * block_size,
                unix_now_s + ttl_s
            ),
            PinOutcome::Refused(r) => format!("refused; reason={}", r.as_str()),
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    worker: Arc<str>,
    tenant: Arc<str>,
    expires_ms: u64,
    /// The last block of a pinned prefix (a breakpoint): only a prompt that reaches
    /// it reuses that prefix.
    breakpoint: bool,
}

#[derive(Debug, Default)]
struct TenantPins {
    pinned: usize,
    reserved: usize,
}

#[derive(Debug, Default)]
struct Inner {
    blocks: BlockHashMap<Entry>,
    tenants: HashMap<Arc<str>, TenantPins>,
    reserved: usize,
    /// (expiry, hash); an entry whose expiry moved later leaves a stale one behind.
    heap: BinaryHeap<Reverse<(u64, BlockHash)>>,
}

impl Inner {
    fn sweep(&mut self, now_ms: u64) {
        while let Some(Reverse((at, h))) = self.heap.peek().copied() {
            if at > now_ms {
                break;
            }
            self.heap.pop();
            if self.blocks.get(&h).is_some_and(|e| e.expires_ms == at) {
                if let Some(e) = self.blocks.remove(&h) {
                    self.uncount(&e.tenant);
                }
            }
        }
    }

    fn uncount(&mut self, tenant: &Arc<str>) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.pinned = t.pinned.saturating_sub(1);
            if t.pinned == 0 && t.reserved == 0 {
                self.tenants.remove(tenant);
            }
        }
    }

    fn live(&self, h: &BlockHash, now_ms: u64) -> Option<&Entry> {
        self.blocks.get(h).filter(|e| e.expires_ms > now_ms)
    }

    fn compact(&mut self) {
        if self.heap.len() <= 2 * self.blocks.len() + 64 {
            return;
        }
        self.heap = self
            .blocks
            .iter()
            .map(|(h, e)| Reverse((e.expires_ms, *h)))
            .collect();
    }
}

/// The router's pins: block hash → worker and expiry, and each tenant's usage.
#[derive(Debug)]
pub struct PinTable {
    inner: Mutex<Inner>,
    budget_bytes: u64,
    max_blocks: usize,
}

impl PinTable {
    /// A table giving each tenant `budget_bytes` of pinned KV blocks, holding at most
    /// `max_blocks` blocks in all.
    pub fn new(budget_bytes: u64, max_blocks: usize) -> Self {
        PinTable {
            inner: Mutex::new(Inner::default()),
            budget_bytes,
            max_blocks,
        }
    }

    /// Each tenant's budget in bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// Reserves the budget to pin `hashes` (a prompt's leading blocks) for `tenant`,
    /// each block costing `block_bytes`. Blocks already pinned and live cost nothing
    /// again. The reservation lasts until the ticket is settled or dropped.
    pub fn reserve(
        self: &Arc<Self>,
        tenant: &str,
        hashes: &[BlockHash],
        block_bytes: u64,
        ttl_s: u32,
        now_ms: u64,
    ) -> Result<PinTicket, PinRefused> {
        let mut inner = lock(&self.inner);
        inner.sweep(now_ms);
        let new = hashes
            .iter()
            .filter(|h| inner.live(h, now_ms).is_none())
            .count();
        let tenant: Arc<str> = match inner.tenants.get_key_value(tenant) {
            Some((k, _)) => k.clone(),
            None => Arc::from(tenant),
        };
        let used = inner
            .tenants
            .get(&tenant)
            .map_or(0, |t| t.pinned + t.reserved);
        let bytes = (used + new) as u64 * block_bytes.max(1);
        if bytes > self.budget_bytes {
            return Err(PinRefused::OverBudget);
        }
        if inner.blocks.len() + inner.reserved + new > self.max_blocks {
            return Err(PinRefused::TableFull);
        }
        inner.reserved += new;
        inner.tenants.entry(tenant.clone()).or_default().reserved += new;
        Ok(PinTicket {
            table: self.clone(),
            tenant,
            reserved: new,
            hashes: hashes.to_vec(),
            ttl_s,
        })
    }

    /// The worker holding the longest live pinned prefix of `hashes` that `hashes`
    /// reuse whole (up to its breakpoint), if any. A prompt sharing only the first
    /// blocks of a pinned prefix (a chat template's opening) is not steered by it.
    pub fn worker_for(&self, hashes: &[BlockHash], now_ms: u64) -> Option<Arc<str>> {
        let inner = lock(&self.inner);
        let mut worker = None;
        for h in hashes {
            match inner.live(h, now_ms) {
                Some(e) if e.breakpoint => worker = Some(e.worker.clone()),
                Some(_) => {}
                None => break,
            }
        }
        worker
    }

    /// Bytes of live pins `tenant` holds (reservations included), at `block_bytes`
    /// per block.
    pub fn tenant_bytes(&self, tenant: &str, block_bytes: u64) -> u64 {
        let inner = lock(&self.inner);
        inner
            .tenants
            .get(tenant)
            .map_or(0, |t| (t.pinned + t.reserved) as u64 * block_bytes)
    }

    /// Live pinned blocks of every tenant.
    pub fn len(&self) -> usize {
        lock(&self.inner).blocks.len()
    }

    /// Whether no block is pinned.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn unreserve(&self, inner: &mut Inner, tenant: &Arc<str>, n: usize) {
        inner.reserved = inner.reserved.saturating_sub(n);
        if let Some(t) = inner.tenants.get_mut(tenant) {
            t.reserved = t.reserved.saturating_sub(n);
            if t.pinned == 0 && t.reserved == 0 {
                inner.tenants.remove(tenant);
            }
        }
    }
}

/// A reserved pin budget, waiting for the worker's answer.
#[derive(Debug)]
pub struct PinTicket {
    table: Arc<PinTable>,
    tenant: Arc<str>,
    reserved: usize,
    hashes: Vec<BlockHash>,
    ttl_s: u32,
}

impl PinTicket {
    /// What to ask the worker for.
    pub fn request(&self) -> pb::PinRequest {
        pb::PinRequest {
            blocks: u32::try_from(self.hashes.len()).unwrap_or(u32::MAX),
            ttl_s: self.ttl_s,
        }
    }

    /// Records the worker's answer (`None`: it sent none): the blocks it pinned are
    /// routed to it until they expire, and the reservation becomes their usage.
    pub fn settle(
        mut self,
        worker: &str,
        result: Option<&pb::PinResult>,
        now_ms: u64,
    ) -> PinOutcome {
        let table = self.table.clone();
        let mut guard = lock(&table.inner);
        let inner = &mut *guard;
        let reserved = std::mem::take(&mut self.reserved);
        table.unreserve(inner, &self.tenant, reserved);
        let Some(r) = result else {
            return PinOutcome::Refused(PinRefused::Unsupported);
        };
        if r.refusal == pb::PinRefusal::Capacity as i32 {
            return PinOutcome::Refused(PinRefused::WorkerCapacity);
        }
        if r.blocks == 0 {
            return PinOutcome::Refused(PinRefused::NotCached);
        }
        let expires_ms = now_ms + r.expires_in_ms;
        let worker: Arc<str> = Arc::from(worker);
        let n = (r.blocks as usize).min(self.hashes.len());
        for (i, h) in self.hashes[..n].iter().enumerate() {
            let live = inner.live(h, now_ms).is_some();
            let breakpoint = i + 1 == n;
            match inner.blocks.get_mut(h) {
                Some(e) if live => {
                    e.breakpoint |= breakpoint;
                    // A re-pin moves the expiry later; the block still counts once,
                    // for the tenant that pinned it first.
                    if e.expires_ms < expires_ms {
                        e.expires_ms = expires_ms;
                    }
                    e.worker = worker.clone();
                    let at = e.expires_ms;
                    inner.heap.push(Reverse((at, *h)));
                }
                _ => {
                    if inner.blocks.len() >= table.max_blocks {
                        break;
                    }
                    if let Some(old) = inner.blocks.remove(h) {
                        inner.uncount(&old.tenant);
                    }
                    inner.blocks.insert(
                        *h,
                        Entry {
                            worker: worker.clone(),
                            tenant: self.tenant.clone(),
                            expires_ms,
                            breakpoint,
                        },
                    );
                    inner.tenants.entry(self.tenant.clone()).or_default().pinned += 1;
                    inner.heap.push(Reverse((expires_ms, *h)));
                }
            }
        }
        inner.compact();
        PinOutcome::Pinned {
            blocks: n,
            ttl_s: r.expires_in_ms.div_ceil(1000),
        }
    }
}

impl Drop for PinTicket {
    fn drop(&mut self) {
        if self.reserved == 0 {
            return;
        }
        let mut inner = lock(&self.table.inner);
        self.table
            .unreserve(&mut inner, &self.tenant, self.reserved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hs(base: u64, n: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(base + i)).collect()
    }

    fn granted(blocks: u32, ms: u64) -> pb::PinResult {
        pb::PinResult {
            blocks,
            expires_in_ms: ms,
            refusal: 0,
        }
    }

    #[test]
    fn a_granted_pin_routes_its_prefix_until_it_expires() {
        let t = Arc::new(PinTable::new(1000, 100));
        let a = hs(1, 4);
        let ticket = t.reserve("acme", &a, 100, 300, 0).unwrap();
        assert_eq!(ticket.request().blocks, 4);
        let out = ticket.settle("w1", Some(&granted(4, 300_000)), 0);
        assert_eq!(
            out,
            PinOutcome::Pinned {
                blocks: 4,
                ttl_s: 300
            }
        );
        // A longer prompt with the same prefix goes to w1; another prefix does not.
        let mut longer = a.clone();
        longer.push(BlockHash(99));
        assert_eq!(t.worker_for(&longer, 1000).as_deref(), Some("w1"));
        assert_eq!(t.worker_for(&hs(50, 3), 1000), None);
        assert_eq!(t.worker_for(&a, 300_000), None, "expired");
        assert_eq!(t.tenant_bytes("acme", 100), 400);
    }

    #[test]
    fn only_a_prompt_that_reaches_the_pinned_breakpoint_is_routed_by_it() {
        // A 4-block pin. Prompts that share its first blocks only (a chat template's
        // opening, say) but not the whole pinned prefix are routed on their own: the
        // pin once pulled every such prompt onto its worker, even under round-robin.
        let t = Arc::new(PinTable::new(10_000, 100));
        let a = hs(1, 4);
        let ticket = t.reserve("acme", &a, 100, 300, 0).unwrap();
        ticket.settle("w1", Some(&granted(4, 300_000)), 0);
        let mut shares_two = a[..2].to_vec();
        shares_two.extend(hs(500, 10));
        assert_eq!(t.worker_for(&shares_two, 1000), None);
        assert_eq!(t.worker_for(&a[..3], 1000), None);
        assert_eq!(t.worker_for(&a, 1000).as_deref(), Some("w1"));
        // A second, shorter pin on another worker ends at block 2: a prompt reaching
        // block 2 but not 4 follows it; one reaching block 4 follows the deeper pin.
        let ticket = t.reserve("acme", &a[..2], 100, 300, 0).unwrap();
        ticket.settle("w2", Some(&granted(2, 300_000)), 0);
        assert_eq!(t.worker_for(&shares_two, 1000).as_deref(), Some("w2"));
    }

    #[test]
    fn the_budget_counts_each_block_once_and_refuses_what_passes_it() {
        let t = Arc::new(PinTable::new(1000, 100));
        let a = hs(1, 6);
        t.reserve("acme", &a, 100, 300, 0)
            .unwrap()
            .settle("w1", Some(&granted(6, 300_000)), 0);
        // The same prefix again costs nothing new: granted, still 600 bytes.
        let again = t.reserve("acme", &a, 100, 300, 10).unwrap();
        assert_eq!(
            again.settle("w1", Some(&granted(6, 300_000)), 10),
            PinOutcome::Pinned {
                blocks: 6,
                ttl_s: 300
            }
        );
        assert_eq!(t.tenant_bytes("acme", 100), 600);
        // Five new blocks would make 1,100 bytes: over budget. Another tenant has its own.
        assert_eq!(
            t.reserve("acme", &hs(100, 5), 100, 300, 10).unwrap_err(),
            PinRefused::OverBudget
        );
        assert!(t.reserve("other", &hs(100, 5), 100, 300, 10).is_ok());
        // A reservation holds the budget until dropped.
        let held = t.reserve("acme", &hs(200, 4), 100, 300, 10).unwrap();
        assert_eq!(
            t.reserve("acme", &hs(300, 1), 100, 300, 10).unwrap_err(),
            PinRefused::OverBudget
        );
        drop(held);
        assert!(t.reserve("acme", &hs(300, 1), 100, 300, 10).is_ok());
        // Once the pins expire the budget is free again.
        assert_eq!(t.tenant_bytes("acme", 100), 600);
        assert!(t.reserve("acme", &hs(400, 10), 100, 300, 300_010).is_ok());
    }

    #[test]
    fn a_worker_refusal_records_nothing_and_frees_the_reservation() {
        let t = Arc::new(PinTable::new(1000, 100));
        let a = hs(1, 5);
        let refused = pb::PinResult {
            blocks: 0,
            expires_in_ms: 0,
            refusal: pb::PinRefusal::Capacity as i32,
        };
        let out = t
            .reserve("acme", &a, 100, 300, 0)
            .unwrap()
            .settle("w1", Some(&refused), 0);
        assert_eq!(out, PinOutcome::Refused(PinRefused::WorkerCapacity));
        assert_eq!(t.worker_for(&a, 1), None);
        assert_eq!(t.tenant_bytes("acme", 100), 0);
        let out = t
            .reserve("acme", &a, 100, 300, 0)
            .unwrap()
            .settle("w1", None, 0);
        assert_eq!(out, PinOutcome::Refused(PinRefused::Unsupported));
        assert_eq!(out.header_value(16, 0), "refused; reason=unsupported");
    }

    #[test]
    fn the_table_is_bounded() {
        let t = Arc::new(PinTable::new(u64::MAX, 8));
        t.reserve("a", &hs(1, 6), 1, 300, 0)
            .unwrap()
            .settle("w1", Some(&granted(6, 1000)), 0);
        assert_eq!(
            t.reserve("b", &hs(100, 3), 1, 300, 0).unwrap_err(),
            PinRefused::TableFull
        );
        // Re-pinning the same blocks many times keeps the heap bounded.
        for i in 0..1000 {
            t.reserve("a", &hs(1, 6), 1, 300, i)
                .unwrap()
                .settle("w1", Some(&granted(6, 1000)), i);
        }
        assert!(lock(&t.inner).heap.len() <= 2 * 6 + 64 + 6);
        assert_eq!(t.len(), 6);
    }
}
