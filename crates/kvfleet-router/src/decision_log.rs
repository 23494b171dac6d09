//! The live record behind `/dashboard`: a bounded ring of recent routing decisions,
//! per-worker cache-hit tallies (cumulative and over the last minute), fleet totals,
//! and the prefix groups routed most recently.
//!
//! Everything here is bounded: [`DECISIONS_KEPT`] decisions, [`GROUPS_KEPT`] prefix
//! groups (each with at most [`GROUP_CHAIN_BLOCKS`] hashes) and [`WORKERS_KEPT`]
//! workers' tallies. A decision costs one push under the fleet's short lock; its
//! outcome is found again by sequence number in O(1). Nothing here reads the prefix
//! index: the snapshot hands the tracked groups' chains to the caller, which asks the
//! index about at most [`GROUPS_SHOWN`] of them.
//!
//! A *prefix group* is every request whose prompt shares its first
//! [`GROUP_DEPTH_BLOCKS`] blocks (fewer for shorter prompts): its id is the chained
//! hash of that block, which already identifies the whole prefix before it. Only ids
//! and counts are kept, never prompt text, so the page shows nothing a tenant typed.

use crate::fleet_metrics as m;
use kvfleet_core::sync::lock;
use kvfleet_core::BlockHash;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

/// Decisions kept in the ring.
pub const DECISIONS_KEPT: usize = 256;
/// Prefix groups tracked (the least recently routed is forgotten first).
pub const GROUPS_KEPT: usize = 64;
/// Prefix groups a snapshot shows (the most recently routed).
pub const GROUPS_SHOWN: usize = 24;
/// Blocks of a prompt that name its prefix group.
pub const GROUP_DEPTH_BLOCKS: usize = 8;
/// Most block hashes kept per group (the latest request's chain, truncated).
pub const GROUP_CHAIN_BLOCKS: usize = 256;
/// Workers whose hit tallies are kept (the least recently routed is forgotten first).
pub const WORKERS_KEPT: usize = 1024;
/// Seconds in the sliding window of [`WorkerHits::last_minute`].
pub const WINDOW_SECS: usize = 60;

/// One routing decision, as the dashboard shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DecisionRecord {
    /// Position in the log (1, 2, …), unique for the router's life.
    pub seq: u64,
    /// When the worker accepted the request, Unix milliseconds.
    pub unix_ms: u64,
    /// Milliseconds since the router started.
    pub at_ms: u64,
    /// The router's request id (the suffix of the response's `id`).
    pub request_id: String,
    /// `chat`, `completions` or `forks`.
    pub endpoint: &'static str,
    /// Chosen worker.
    pub worker: String,
    /// Policy that chose it.
    pub policy: &'static str,
    /// Prompt tokens (the shared prefix, for a fork call).
    pub prompt_tokens: usize,
    /// Cached tokens the router predicted.
    pub predicted_cached_tokens: usize,
    /// Cached tokens the worker reported, once its usage arrived.
    pub actual_cached_tokens: Option<usize>,
    /// First block hash of the prompt (the prefix root), hex.
    pub prefix_root: Option<String>,
    /// The prompt's prefix group id, hex (see the module docs).
    pub prefix_group: Option<String>,
    /// Fork group, if any.
    pub fork_group: Option<String>,
    /// Session, if any.
    pub session: Option<String>,
    /// Time the routing core took to choose the worker (index lookup, scoring,
    /// reservation), µs, for the attempt that succeeded.
    pub decision_us: u64,
    /// Time from the request reaching the router to the worker accepting it, µs
    /// (routing, placement, retries and the worker's first message).
    pub accept_us: u64,
    /// Workers tried (1 unless a worker failed or was busy).
    pub attempts: u32,
    /// How a control plane's placement took part ([`PlacementStep`]).
    pub placement: PlacementStep,
    /// `in_flight` until the request ends, then `ok`, `worker_error`, `client_gone`…
    pub outcome: &'static str,
    /// The prefix group as a number, to find the group again without parsing.
    #[serde(skip)]
    group_key: Option<u64>,
}

/// A decision to log: [`DecisionRecord`] without the fields the log assigns.
#[derive(Clone, Debug)]
pub struct NewDecision {
    /// Unix milliseconds.
    pub unix_ms: u64,
    /// Milliseconds since the router started.
    pub at_ms: u64,
    /// Request id.
    pub request_id: String,
    /// Endpoint name.
    pub endpoint: &'static str,
    /// Chosen worker.
    pub worker: String,
    /// Policy name.
    pub policy: &'static str,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Predicted cached tokens.
    pub predicted_cached_tokens: usize,
    /// Fork group.
    pub fork_group: Option<String>,
    /// Session.
    pub session: Option<String>,
    /// Routing-core time, µs.
    pub decision_us: u64,
    /// Request in to worker accepted, µs.
    pub accept_us: u64,
    /// Workers tried.
    pub attempts: u32,
    /// How a control plane's placement took part.
    pub placement: PlacementStep,
}

/// How a request's placement (shared with other routers through a control plane) took
/// part in its routing: it tells an SRE why siblings did or did not land together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlacementStep {
    /// No control plane, or nothing to place (no fork group, no anchor block).
    #[default]
    None,
    /// A worker was known to hold the prompt up to its anchor: routed on the index (to
    /// a holder, or elsewhere with the key's placement known to be old).
    Indexed,
    /// Followed a placement this router already knew of.
    Followed,
    /// This router's choice won the compare-and-set.
    Claimed,
    /// Another router's placement won the compare-and-set: rerouted to it.
    Lost,
    /// The compare-and-set failed (control plane unreachable): routed on the index.
    Unplaced,
    /// A live pinned prefix decided the worker.
    Pinned,
}

impl Serialize for PlacementStep {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl PlacementStep {
    /// Its name, as in the decision log and the `step` label of
    /// `kvfleet_router_placements_total`.
    pub fn name(self) -> &'static str {
        match self {
            PlacementStep::None => "none",
            PlacementStep::Indexed => "indexed",
            PlacementStep::Followed => "followed",
            PlacementStep::Claimed => "claimed",
            PlacementStep::Lost => "lost",
            PlacementStep::Unplaced => "unplaced",
            PlacementStep::Pinned => "pinned",
        }
    }
}

/// Cached versus prompt tokens over some span of requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct HitTally {
    /// Requests whose cached-token count is known.
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Their cached tokens, as the workers reported them.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens` (0 with no tokens).
    pub hit_ratio: f64,
}

impl HitTally {
    fn add(&mut self, prompt: u64, cached: u64) {
        self.requests += 1;
        self.prompt_tokens += prompt;
        self.cached_tokens += cached;
        self.hit_ratio = ratio(self.cached_tokens, self.prompt_tokens);
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// One second's tally in a worker's sliding window.
#[derive(Clone, Copy, Debug, Default)]
struct SecondBucket {
    unix_sec: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    requests: u64,
}

/// A worker's hit tallies.
#[derive(Clone, Debug)]
struct WorkerHits {
    routed: u64,
    total: HitTally,
    window: [SecondBucket; WINDOW_SECS],
    last_unix_ms: u64,
}

impl Default for WorkerHits {
    fn default() -> Self {
        WorkerHits {
            routed: 0,
            total: HitTally::default(),
            window: [SecondBucket::default(); WINDOW_SECS],
            last_unix_ms: 0,
        }
    }
}

impl WorkerHits {
    fn add(&mut self, unix_ms: u64, prompt: u64, cached: u64) {
        self.total.add(prompt, cached);
        let sec = unix_ms / 1000;
        let b = &mut self.window[(sec % WINDOW_SECS as u64) as usize];
        if b.unix_sec != sec {
            *b = SecondBucket {
                unix_sec: sec,
                ..SecondBucket::default()
            };
        }
        b.prompt_tokens += prompt;
        b.cached_tokens += cached;
        b.requests += 1;
    }

    /// The tally over the [`WINDOW_SECS`] seconds up to `now_unix_ms`.
    fn last_minute(&self, now_unix_ms: u64) -> HitTally {
        let now = now_unix_ms / 1000;
        let mut t = HitTally::default();
        for b in &self.window {
            if b.requests > 0 && b.unix_sec + (WINDOW_SECS as u64) > now && b.unix_sec <= now {
                t.requests += b.requests;
                t.prompt_tokens += b.prompt_tokens;
                t.cached_tokens += b.cached_tokens;
            }
        }
        t.hit_ratio = ratio(t.cached_tokens, t.prompt_tokens);
        t
    }
}

/// A prefix group the log tracks.
#[derive(Clone, Debug)]
struct Group {
    chain: Vec<BlockHash>,
    label: Option<String>,
    requests: u64,
    hits: HitTally,
    last_worker: String,
    last_unix_ms: u64,
    /// Log-wide counter at the last request, to order groups without clock ties.
    last_tick: u64,
}

/// Fleet-wide totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct DecisionTotals {
    /// Requests routed (decisions logged).
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Cached tokens predicted for them.
    pub predicted_cached_tokens: u64,
    /// Requests whose cached-token count is known, with their tokens.
    pub known: HitTally,
    /// Requests that ended, by outcome `ok`.
    pub ok: u64,
    /// Requests that ended otherwise.
    pub failed: u64,
}

/// A worker's tallies in a snapshot.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerHitsView {
    /// Worker id.
    pub worker: String,
    /// Requests routed to it.
    pub routed: u64,
    /// Since the router started.
    pub total: HitTally,
    /// Over the last [`WINDOW_SECS`] seconds.
    pub last_minute: HitTally,
}

/// A prefix group in a snapshot, with its chain for the index lookup.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupView {
    /// Group id, hex.
    pub id: String,
    /// Fork group or session of its latest request, if it named one.
    pub label: Option<String>,
    /// Requests routed in the group.
    pub requests: u64,
    /// Its cached versus prompt tokens.
    pub hits: HitTally,
    /// Worker of its latest request.
    pub last_worker: String,
    /// Unix milliseconds of its latest request.
    pub last_unix_ms: u64,
    /// Block hashes of its latest request's prompt (at most [`GROUP_CHAIN_BLOCKS`]).
    pub chain: Vec<BlockHash>,
}

/// What the log holds at one moment, bounded by the constants above.
#[derive(Clone, Debug)]
pub struct LogSnapshot {
    /// Decisions, newest first (at most `limit` of them).
    pub decisions: Vec<DecisionRecord>,
    /// Fleet totals.
    pub totals: DecisionTotals,
    /// Per-worker tallies, by worker id.
    pub workers: Vec<WorkerHitsView>,
    /// Most recently routed groups first, at most [`GROUPS_SHOWN`].
    pub groups: Vec<GroupView>,
    /// Sequence number of the newest decision (0 when none).
    pub last_seq: u64,
}

/// The bounded decision log; see the module docs.
#[derive(Debug)]
pub struct DecisionLog {
    ring: VecDeque<DecisionRecord>,
    next_seq: u64,
    totals: DecisionTotals,
    workers: BTreeMap<String, WorkerHits>,
    groups: HashMap<u64, Group>,
    tick: u64,
}

impl Default for DecisionLog {
    fn default() -> Self {
        Self::new()
    }
}

/// The prefix group id of a prompt's block chain (`None` below one full block).
pub fn prefix_group(hashes: &[BlockHash]) -> Option<BlockHash> {
    hashes
        .get(hashes.len().min(GROUP_DEPTH_BLOCKS).checked_sub(1)?)
        .copied()
}

impl DecisionLog {
    /// An empty log.
    pub fn new() -> Self {
        DecisionLog {
            ring: VecDeque::with_capacity(DECISIONS_KEPT),
            next_seq: 1,
            totals: DecisionTotals::default(),
            workers: BTreeMap::new(),
            groups: HashMap::with_capacity(GROUPS_KEPT + 1),
            tick: 0,
        }
    }

    /// Logs a decision for a prompt with block chain `hashes`; returns its sequence
    /// number, for [`Self::complete`].
    pub fn record(&mut self, d: NewDecision, hashes: &[BlockHash]) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.tick += 1;
        let group = prefix_group(hashes);
        self.totals.requests += 1;
        self.totals.prompt_tokens += d.prompt_tokens as u64;
        self.totals.predicted_cached_tokens += d.predicted_cached_tokens as u64;
        if !self.workers.contains_key(&d.worker) && self.workers.len() >= WORKERS_KEPT {
            let stalest = self
                .workers
                .iter()
                .min_by_key(|(_, w)| w.last_unix_ms)
                .map(|(k, _)| k.clone());
            if let Some(k) = stalest {
                self.workers.remove(&k);
            }
        }
        let w = self.workers.entry(d.worker.clone()).or_default();
        w.routed += 1;
        w.last_unix_ms = d.unix_ms;
        if let Some(g) = group {
            self.touch_group(g, hashes, &d);
        }
        self.ring.push_back(DecisionRecord {
            seq,
            unix_ms: d.unix_ms,
            at_ms: d.at_ms,
            request_id: d.request_id,
            endpoint: d.endpoint,
            worker: d.worker,
            policy: d.policy,
            prompt_tokens: d.prompt_tokens,
            predicted_cached_tokens: d.predicted_cached_tokens,
            actual_cached_tokens: None,
            prefix_root: hashes.first().map(|h| h.to_string()),
            prefix_group: group.map(|h| h.to_string()),
            fork_group: d.fork_group,
            session: d.session,
            decision_us: d.decision_us,
            accept_us: d.accept_us,
            attempts: d.attempts,
            placement: d.placement,
            outcome: "in_flight",
            group_key: group.map(|h| h.0),
        });
        while self.ring.len() > DECISIONS_KEPT {
            self.ring.pop_front();
        }
        seq
    }

    fn touch_group(&mut self, g: BlockHash, hashes: &[BlockHash], d: &NewDecision) {
        if !self.groups.contains_key(&g.0) && self.groups.len() >= GROUPS_KEPT {
            let stalest = self
                .groups
                .iter()
                .min_by_key(|(_, v)| v.last_tick)
                .map(|(k, _)| *k);
            if let Some(k) = stalest {
                self.groups.remove(&k);
            }
        }
        let entry = self.groups.entry(g.0).or_insert_with(|| Group {
            chain: Vec::new(),
            label: None,
            requests: 0,
            hits: HitTally::default(),
            last_worker: String::new(),
            last_unix_ms: 0,
            last_tick: 0,
        });
        entry.chain.clear();
        entry
            .chain
            .extend_from_slice(&hashes[..hashes.len().min(GROUP_CHAIN_BLOCKS)]);
        if let Some(l) = d.fork_group.as_ref().or(d.session.as_ref()) {
            entry.label = Some(l.clone());
        }
        entry.requests += 1;
        entry.last_worker.clone_from(&d.worker);
        entry.last_unix_ms = d.unix_ms;
        entry.last_tick = self.tick;
    }

    fn find_mut(&mut self, seq: u64) -> Option<&mut DecisionRecord> {
        let first = self.ring.front()?.seq;
        let i = usize::try_from(seq.checked_sub(first)?).ok()?;
        self.ring.get_mut(i).filter(|r| r.seq == seq)
    }

    /// Fills in decision `seq`'s cached tokens (counted once, the first time they are
    /// known) and, when given, its outcome. A decision already pushed out of the ring
    /// still counts towards the tallies through `worker`, `prompt_tokens` and `group`.
    pub fn complete(
        &mut self,
        seq: u64,
        actual_cached_tokens: Option<usize>,
        outcome: Option<&'static str>,
        unix_ms: u64,
    ) {
        let Some(rec) = self.find_mut(seq) else {
            return;
        };
        let mut newly_known = None;
        if let (None, Some(c)) = (rec.actual_cached_tokens, actual_cached_tokens) {
            rec.actual_cached_tokens = Some(c);
            newly_known = Some((
                rec.worker.clone(),
                rec.prompt_tokens as u64,
                c as u64,
                rec.group_key,
            ));
        }
        let mut ended = None;
        if let Some(o) = outcome {
            if rec.outcome == "in_flight" {
                ended = Some(o == "ok");
            }
            rec.outcome = o;
        }
        match ended {
            Some(true) => self.totals.ok += 1,
            Some(false) => self.totals.failed += 1,
            None => {}
        }
        if let Some((worker, prompt, cached, group)) = newly_known {
            self.totals.known.add(prompt, cached);
            if let Some(w) = self.workers.get_mut(&worker) {
                w.add(unix_ms, prompt, cached);
            }
            if let Some(g) = group.and_then(|k| self.groups.get_mut(&k)) {
                g.hits.add(prompt, cached);
            }
        }
    }

    /// The log now: at most `limit` newest decisions, newest first, and the
    /// [`GROUPS_SHOWN`] most recently routed groups.
    pub fn snapshot(&self, limit: usize, now_unix_ms: u64) -> LogSnapshot {
        let decisions = self.ring.iter().rev().take(limit).cloned().collect();
        let workers = self
            .workers
            .iter()
            .map(|(id, w)| WorkerHitsView {
                worker: id.clone(),
                routed: w.routed,
                total: w.total,
                last_minute: w.last_minute(now_unix_ms),
            })
            .collect();
        let mut recent: Vec<(&u64, &Group)> = self.groups.iter().collect();
        recent.sort_unstable_by_key(|(_, g)| std::cmp::Reverse(g.last_tick));
        let groups = recent
            .into_iter()
            .take(GROUPS_SHOWN)
            .map(|(id, g)| GroupView {
                id: BlockHash(*id).to_string(),
                label: g.label.clone(),
                requests: g.requests,
                hits: g.hits,
                last_worker: g.last_worker.clone(),
                last_unix_ms: g.last_unix_ms,
                chain: g.chain.clone(),
            })
            .collect();
        LogSnapshot {
            decisions,
            totals: self.totals,
            workers,
            groups,
            last_seq: self.next_seq - 1,
        }
    }

    /// Every decision in the ring, oldest first.
    pub fn decisions(&self) -> Vec<DecisionRecord> {
        self.ring.iter().cloned().collect()
    }
}

/// Fork groups remembered for co-location statistics.
const FORK_GROUPS_KEPT: usize = 65_536;

#[derive(Default)]
struct ForkGroups {
    first_worker: HashMap<String, String>,
    order: VecDeque<String>,
    colocated: u64,
    total: u64,
}

/// The decision log and fork-group co-location statistics as request handlers and
/// the dashboard share them: each behind its own lock, taken per call, and read out
/// as copies.
#[derive(Default)]
pub struct Decisions {
    log: Mutex<DecisionLog>,
    fork_groups: Mutex<ForkGroups>,
}

impl Decisions {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a routing decision for the dashboard and fork-group co-location;
    /// returns its number in the log, for [`Self::outcome`].
    pub fn record(&self, rec: NewDecision, hashes: &[BlockHash]) -> u64 {
        if let Some(group) = &rec.fork_group {
            let mut fg = lock(&self.fork_groups);
            let first = match fg.first_worker.get(group) {
                Some(w) => w.clone(),
                None => {
                    fg.first_worker.insert(group.clone(), rec.worker.clone());
                    fg.order.push_back(group.clone());
                    if fg.order.len() > FORK_GROUPS_KEPT {
                        if let Some(old) = fg.order.pop_front() {
                            fg.first_worker.remove(&old);
                        }
                    }
                    rec.worker.clone()
                }
            };
            let colocated = first == rec.worker;
            fg.total += 1;
            if colocated {
                fg.colocated += 1;
            }
            m::fork_group(colocated, fg.colocated as f64 / fg.total as f64);
        }
        lock(&self.log).record(rec, hashes)
    }

    /// Fills in a logged decision's cached tokens and, when given, its outcome (timed
    /// by the wall clock).
    pub fn outcome(
        &self,
        seq: u64,
        actual_cached_tokens: Option<usize>,
        outcome: Option<&'static str>,
    ) {
        let now = crate::wall_clock::unix_ms();
        lock(&self.log).complete(seq, actual_cached_tokens, outcome, now);
    }

    /// The most recent routing decisions, oldest first.
    pub fn recent(&self) -> Vec<DecisionRecord> {
        lock(&self.log).decisions()
    }

    /// The dashboard's view of the log (see [`DecisionLog::snapshot`]).
    pub fn snapshot(&self, limit: usize, now_unix_ms: u64) -> LogSnapshot {
        lock(&self.log).snapshot(limit, now_unix_ms)
    }

    /// Fork-group requests served by their group's first worker / all of them.
    pub fn fork_colocation(&self) -> (u64, u64) {
        let fg = lock(&self.fork_groups);
        (fg.colocated, fg.total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(worker: &str, prompt: usize, session: Option<&str>) -> NewDecision {
        NewDecision {
            unix_ms: 1_000_000,
            at_ms: 5,
            request_id: format!("r-{worker}-{prompt}"),
            endpoint: "chat",
            worker: worker.into(),
            policy: "cache-aware",
            prompt_tokens: prompt,
            predicted_cached_tokens: prompt / 2,
            fork_group: None,
            session: session.map(str::to_string),
            decision_us: 40,
            accept_us: 900,
            attempts: 1,
            placement: PlacementStep::None,
        }
    }

    fn chain(root: u64, n: usize) -> Vec<BlockHash> {
        (0..n as u64).map(|i| BlockHash(root * 1000 + i)).collect()
    }

    #[test]
    fn the_ring_keeps_the_newest_decisions_and_snapshots_newest_first() {
        let mut log = DecisionLog::new();
        for i in 0..(DECISIONS_KEPT + 10) {
            let seq = log.record(decision("w0", i + 1, None), &chain(1, 2));
            assert_eq!(seq, i as u64 + 1);
        }
        let all = log.decisions();
        assert_eq!(all.len(), DECISIONS_KEPT);
        assert_eq!(all[0].seq, 11, "the oldest 10 were pushed out");
        assert_eq!(all[DECISIONS_KEPT - 1].seq, DECISIONS_KEPT as u64 + 10);
        let snap = log.snapshot(5, 1_000_000);
        let seqs: Vec<u64> = snap.decisions.iter().map(|d| d.seq).collect();
        let last = DECISIONS_KEPT as u64 + 10;
        assert_eq!(seqs, vec![last, last - 1, last - 2, last - 3, last - 4]);
        assert_eq!(snap.last_seq, last);
        assert_eq!(snap.totals.requests, last);
        assert_eq!(log.snapshot(10_000, 0).decisions.len(), DECISIONS_KEPT);
    }

    #[test]
    fn outcomes_fill_in_cached_tokens_once_and_feed_the_hit_ratios() {
        let mut log = DecisionLog::new();
        let a = log.record(decision("w0", 100, Some("s")), &chain(1, 8));
        let b = log.record(decision("w1", 200, None), &chain(2, 8));
        log.complete(a, Some(64), None, 1_000_500);
        // A second report of the same usage is not counted twice.
        log.complete(a, Some(64), Some("ok"), 1_000_600);
        log.complete(b, Some(0), Some("worker_error"), 1_000_600);
        // Unknown and pushed-out sequence numbers are ignored.
        log.complete(999, Some(5), Some("ok"), 1_000_600);
        let snap = log.snapshot(10, 1_001_000);
        assert_eq!(snap.decisions[1].actual_cached_tokens, Some(64));
        assert_eq!(snap.decisions[1].outcome, "ok");
        assert_eq!(snap.decisions[0].outcome, "worker_error");
        assert_eq!(snap.totals.known.cached_tokens, 64);
        assert_eq!(snap.totals.known.prompt_tokens, 300);
        assert_eq!((snap.totals.ok, snap.totals.failed), (1, 1));
        let w0 = &snap.workers[0];
        assert_eq!(w0.worker, "w0");
        assert_eq!(w0.total.hit_ratio, 0.64);
        assert_eq!(w0.last_minute.cached_tokens, 64);
        // A minute later the window is empty; the cumulative tally is not.
        let later = log.snapshot(10, 1_000_500 + 61_000);
        assert_eq!(later.workers[0].last_minute.requests, 0);
        assert_eq!(later.workers[0].total.requests, 1);
        let g = snap.groups.iter().find(|g| g.label.as_deref() == Some("s"));
        assert_eq!(g.map(|g| g.hits.cached_tokens), Some(64));
    }

    #[test]
    fn groups_are_bounded_named_by_their_prefix_and_ordered_by_recency() {
        let mut log = DecisionLog::new();
        for g in 0..(GROUPS_KEPT as u64 + 5) {
            log.record(decision("w0", 10, None), &chain(g + 1, 300));
        }
        assert_eq!(log.groups.len(), GROUPS_KEPT);
        // Group 1 again: it becomes the most recent.
        log.record(decision("w2", 10, Some("agent-7")), &chain(1, 3));
        let snap = log.snapshot(0, 0);
        assert!(snap.decisions.is_empty());
        assert_eq!(snap.groups.len(), GROUPS_SHOWN);
        let top = &snap.groups[0];
        assert_eq!(
            top.id,
            BlockHash(1000 + 2).to_string(),
            "3-block prompt: block 3"
        );
        assert_eq!(top.label.as_deref(), Some("agent-7"));
        assert_eq!(top.last_worker, "w2");
        assert_eq!(top.chain.len(), 3);
        let second = &snap.groups[1];
        let newest = GROUPS_KEPT as u64 + 5;
        assert_eq!(
            second.id,
            BlockHash(newest * 1000 + GROUP_DEPTH_BLOCKS as u64 - 1).to_string()
        );
        assert_eq!(second.chain.len(), GROUP_CHAIN_BLOCKS);
        assert!(snap
            .groups
            .iter()
            .all(|g| g.chain.len() <= GROUP_CHAIN_BLOCKS));
        // Prompts under one block have no group.
        assert_eq!(prefix_group(&[]), None);
    }
}
