//! kvfleet's own policies under simulation: the real [`KvRouter`] (prefix index,
//! pending reservations, load bookkeeping, policies), fed with the simulated workers'
//! KV events (stored when a request's prefill ends, as the engine reports computed
//! blocks; removed when evicted; with per-worker sequence numbers) and load reports
//! from their queues, exactly as the live fleet's supervisors feed it.
//!
//! Hashes are the trace's chained hash ids, with the router's block size set to the
//! trace's; the prompt length given to the router is one token more than its blocks,
//! so every block counts as reusable, as the simulated caches and the bounds count it.

use super::lru::ChainChange;
use super::{RouteReq, SimRouter, SimWorker};
use kvfleet_core::kv_events::{KvEvent, KvEventKind};
use kvfleet_core::BlockHash;
use kvfleet_routing::{KvRouter, PolicyKind, ReservationId, RouterConfig, RunningId};

/// A request in flight: its prefill tokens, reservation and running chain.
type InFlight = (usize, Option<ReservationId>, Option<RunningId>);

/// A [`KvRouter`] driving one policy.
pub struct KvfleetPolicy {
    router: KvRouter,
    kind: PolicyKind,
    ids: Vec<String>,
    seqs: Vec<u64>,
    /// Router worker index → simulated worker.
    slot: Vec<usize>,
    /// The last decision's pull: (simulated source worker, end block).
    pull: Option<(usize, usize)>,
    /// Requests in flight, by the token `route` handed out: (prefill tokens,
    /// reservation, running chain), so their end releases them as the live router's
    /// does.
    in_flight: Vec<InFlight>,
    /// Tokens of finished requests, for reuse.
    free_tokens: Vec<usize>,
}

impl KvfleetPolicy {
    /// A router over `workers` workers.
    pub fn new(config: RouterConfig, kind: PolicyKind, workers: usize) -> anyhow::Result<Self> {
        let bs = config.block_size;
        let mut router = KvRouter::new(config);
        let ids: Vec<String> = (0..workers).map(|i| format!("w{i}")).collect();
        let mut slot = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let idx = router
                .add_worker(id, bs)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if slot.len() <= idx.index() {
                slot.resize(idx.index() + 1, usize::MAX);
            }
            slot[idx.index()] = i;
        }
        Ok(Self {
            router,
            kind,
            seqs: vec![0; workers],
            ids,
            slot,
            pull: None,
            in_flight: Vec::new(),
            free_tokens: Vec::new(),
        })
    }

    /// The router (read-only), e.g. for its prediction statistics.
    pub fn router(&self) -> &KvRouter {
        &self.router
    }

    fn report(&mut self, w: usize, workers: &[SimWorker]) {
        let _ = self
            .router
            .update_load(&self.ids[w], workers[w].load_report());
    }

    /// The token `route` hands back for a request, remembering what its end releases.
    fn issue_token(&mut self, entry: InFlight) -> usize {
        match self.free_tokens.pop() {
            Some(t) => {
                self.in_flight[t] = entry;
                t
            }
            None => {
                self.in_flight.push(entry);
                self.in_flight.len() - 1
            }
        }
    }

    fn event(&mut self, w: usize, make: impl FnOnce(u64) -> KvEvent) {
        self.seqs[w] += 1;
        let ev = make(self.seqs[w]);
        // Sequence numbers never skip, so apply never reports a gap.
        let _ = self.router.apply_event(&self.ids[w], &ev);
    }
}

impl SimRouter for KvfleetPolicy {
    fn route(&mut self, req: &RouteReq<'_>, _workers: &[SimWorker], now_ms: f64) -> (usize, usize) {
        let prompt = req.hashes.len() * req.block_size + 1;
        match self
            .router
            .route(req.hashes, prompt, self.kind, now_ms as u64)
        {
            Ok(d) => {
                self.pull = d.pull.map(|p| (self.slot[p.from_idx.index()], p.end_block));
                let token = self.issue_token((d.prefill_tokens, d.reservation, d.running));
                (self.slot[d.worker_idx.index()], token)
            }
            Err(_) => {
                self.pull = None;
                (0, self.issue_token((0, None, None)))
            }
        }
    }

    fn take_pull(&mut self) -> Option<(usize, usize)> {
        self.pull.take()
    }

    fn on_enqueued(&mut self, w: usize, change: &ChainChange, workers: &[SimWorker]) {
        if !change.removed.is_empty() {
            let removed = change.removed.clone();
            self.event(w, |seq| KvEvent::removed(seq, removed));
        }
        // Lower-tier changes, in order, one event per run of the same tier and kind.
        for run in change
            .lower
            .chunk_by(|a, b| a.medium == b.medium && a.stored == b.stored)
        {
            let (medium, block_hashes) = (run[0].medium, run.iter().map(|o| o.hash).collect());
            let kind = if run[0].stored {
                KvEventKind::Stored {
                    parent_hash: None,
                    block_hashes,
                    medium,
                }
            } else {
                KvEventKind::Removed {
                    block_hashes,
                    medium,
                }
            };
            self.event(w, |seq| KvEvent { seq, kind });
        }
        self.report(w, workers);
    }

    fn on_computed(
        &mut self,
        w: usize,
        stored: &[(Option<BlockHash>, Vec<BlockHash>)],
        gone: &[BlockHash],
        _workers: &[SimWorker],
    ) {
        for (parent, blocks) in stored {
            let (parent, blocks) = (*parent, blocks.clone());
            self.event(w, |seq| KvEvent::stored(seq, parent, blocks));
        }
        if !gone.is_empty() {
            let gone = gone.to_vec();
            self.event(w, |seq| KvEvent::removed(seq, gone));
        }
    }

    fn on_load_changed(&mut self, w: usize, workers: &[SimWorker]) {
        self.report(w, workers);
    }

    fn on_finished(&mut self, w: usize, token: usize, workers: &[SimWorker], now_ms: f64) {
        let (prefill, reservation, running) = self
            .in_flight
            .get(token)
            .copied()
            .unwrap_or((0, None, None));
        self.free_tokens.push(token);
        let _ = self.router.request_finished(&self.ids[w], prefill);
        if let Some(id) = running {
            self.router.request_done(id);
        }
        if let Some(id) = reservation {
            self.router.request_ended(id, now_ms as u64);
        }
        self.report(w, workers);
    }
}
