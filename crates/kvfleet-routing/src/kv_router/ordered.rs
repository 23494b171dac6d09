//! `cache-aware`'s candidates on a large fleet, without pricing every worker: the
//! workers that match a prompt unlike the rest are priced on their own, and of each
//! large group of equally matched workers only those [`LoadOrder`] puts within reach of
//! the group's cheapest (see [`crate::load_order`]). The policy then chooses among them
//! exactly as among every worker, which `KvRouter::set_full_scan` keeps as the
//! reference (`tests.rs`: `the_ordered_walk_chooses_what_the_full_scan_chooses`).

use super::{lower_tier_blocks, KvRouter};
use crate::load::CandidateLoad;
use crate::load_order::{run_of, Lane, LoadOrder, Position, Run};
use crate::policy::{prompt_anchor, ring_point, Candidate, RouteContext, TIE_RING_REACH};
use crate::prefix_index::{Matches, TieredMatches};
use crate::registry::WorkerIdx;
use crate::reservations::Reservations;
use crate::USAGE_LEVELS;
use kvfleet_core::BlockHash;
use std::iter::Peekable;
use std::ops::RangeInclusive;

/// Match classes at least this large are walked in load order rather than priced
/// whole (and at least an eighth of the fleet).
const WALK_MIN_CLASS: usize = 32;

/// Scratch of the ordered walk: the size of each match class.
#[derive(Debug, Default)]
pub(super) struct MatchClasses {
    /// Workers of each class `d ≥ 1` that runs none of the prompt, by `d`. All 0
    /// between routes.
    size: Vec<u32>,
    /// Workers of each class that runs some of the prompt (few such classes: a
    /// shared system prompt, a session's own turns). Empty between routes.
    running_size: Vec<(Class, u32)>,
    /// The classes `d ≥ 1` with members this route.
    seen: Vec<Class>,
    /// Candidates of each class while it is still small (so a class that stays small
    /// needs no second pass over the matches); empty between routes.
    kept: Vec<(Class, Candidate)>,
    /// Each matching worker's class this route, by index, as (route stamp, class):
    /// the walk asks for the class of every worker it steps over, and pass 1 has
    /// already worked it out (a search of the matches, and of the running chains).
    by_worker: Vec<(u32, Class)>,
    /// This route's stamp in `by_worker` (never 0, which marks no entry).
    stamp: u32,
}

impl MatchClasses {
    /// Workers of `class` counted so far.
    fn size(&self, class: Class) -> u32 {
        if class >> 32 == 0 {
            self.size[class as usize]
        } else {
            self.running_size
                .iter()
                .find(|(c, _)| *c == class)
                .map_or(0, |(_, n)| *n)
        }
    }

    /// Counts one more worker of `class`; its size now.
    fn add(&mut self, class: Class) -> u32 {
        let size = if class >> 32 == 0 {
            &mut self.size[class as usize]
        } else {
            match self.running_size.iter().position(|(c, _)| *c == class) {
                Some(i) => &mut self.running_size[i].1,
                None => {
                    self.running_size.push((class, 0));
                    let last = self.running_size.len() - 1;
                    &mut self.running_size[last].1
                }
            }
        };
        if *size == 0 {
            self.seen.push(class);
        }
        *size += 1;
        *size
    }

    /// Starts a route over `workers` registered slots: no class is known yet.
    fn begin(&mut self, workers: usize) {
        self.reset();
        if self.by_worker.len() < workers {
            self.by_worker.resize(workers, (0, 0));
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.by_worker.fill((0, 0));
            self.stamp = 1;
        }
    }

    /// Records `worker`'s class this route.
    #[inline]
    fn know(&mut self, worker: WorkerIdx, class: Class) {
        if let Some(slot) = self.by_worker.get_mut(worker.index()) {
            *slot = (self.stamp, class);
        }
    }

    /// `worker`'s class this route, if [`Self::know`] recorded it.
    #[inline]
    fn known(&self, worker: WorkerIdx) -> Option<Class> {
        match self.by_worker.get(worker.index()) {
            Some(&(stamp, class)) if stamp == self.stamp => Some(class),
            _ => None,
        }
    }

    /// Forgets this route's sizes.
    fn reset(&mut self) {
        for &d in &self.seen {
            if d >> 32 == 0 {
                self.size[d as usize] = 0;
            }
        }
        self.running_size.clear();
        self.seen.clear();
    }
}

/// A worker's match class for one prompt: 0 for matching nothing; for matching `d ≥
/// 1` device blocks and nothing in lower tiers, `d` in the low 32 bits and in the high
/// ones the blocks of it that requests this router sent there still run
/// ([`Candidate::running_blocks`]: equal members must admit the prompt alike);
/// [`PRICED`] for one with lower-tier blocks (priced on its own).
type Class = u64;

/// The class of a worker priced on its own.
const PRICED: Class = Class::MAX;

/// The class of `matched` device blocks, `running` of them still run there.
#[inline]
fn class_of(matched: usize, running: usize) -> Class {
    let (m, r) = (matched as u64, running.min(matched) as u64);
    if m >> 32 != 0 || r >> 31 != 0 {
        // Beyond any prompt a class can tell apart: priced on its own.
        PRICED
    } else {
        m | (r << 32)
    }
}

/// The matched and running blocks of a class other than [`PRICED`].
#[inline]
fn blocks_of(class: Class) -> (usize, usize) {
    (
        (class & u64::from(u32::MAX)) as usize,
        (class >> 32) as usize,
    )
}

/// How far the chains running on each worker ([`Candidate::running_blocks`]) share
/// a prompt, asked of the running trie one worker at a time, and only where a
/// worker's running blocks can change a decision (a lane with nothing queued, short of
/// room for the whole prompt): a shared system prompt runs on the whole fleet, and a
/// lookup for every worker would walk all of them on every decision.
pub(super) struct RunningLookup<'a> {
    trie: &'a Reservations,
    hashes: &'a [BlockHash],
}

impl<'a> RunningLookup<'a> {
    /// The chains of `trie`, as far as they share `hashes`.
    pub(super) fn new(trie: &'a Reservations, hashes: &'a [BlockHash]) -> Self {
        Self { trie, hashes }
    }

    /// Of the leading blocks of the prompt (at most `matched`) that a chain running on
    /// `worker`, whose load is `load`, shares, those that change a decision
    /// ([`crate::policy::running_that_admits`]) for a prompt of `admit_blocks`.
    pub(super) fn admitting(
        &self,
        worker: WorkerIdx,
        matched: usize,
        load: &CandidateLoad,
        admit_blocks: usize,
    ) -> usize {
        // Where the whole prompt is admitted, or a queue takes the free blocks first,
        // running blocks change nothing: no lookup.
        if matched == 0 || load.prefill_backlog_tokens() > 0 || load.admits(admit_blocks) {
            return 0;
        }
        let running = self.trie.depth_of(worker, self.hashes).min(matched);
        crate::policy::running_that_admits(admit_blocks, load, running)
    }
}

/// What a prompt's lookup found: the candidates are built from it.
pub(super) struct Found<'a> {
    /// Device depths, index and reservations.
    pub(super) matches: &'a Matches,
    /// The chains running on each worker, as far as they share the prompt.
    pub(super) running: RunningLookup<'a>,
    /// Host and disk depths, once some worker reported a lower tier.
    pub(super) tiered: Option<&'a TieredMatches>,
    /// Blocks a request can reuse.
    pub(super) reusable: usize,
    /// Blocks a worker's admission headroom must hold for the prompt, were none of it
    /// running there ([`RouteContext::admit_blocks`]).
    pub(super) admit_blocks: usize,
}

impl Found<'_> {
    /// The class of `worker`, whose device match is `depth` blocks and load `load`.
    #[inline]
    fn class(&self, worker: WorkerIdx, depth: usize, load: &CandidateLoad) -> Class {
        let matched = depth.min(self.reusable);
        let lower = self.tiered.map_or((0, 0), |t| {
            lower_tier_blocks(t.get(worker), matched, self.reusable)
        });
        if lower != (0, 0) {
            PRICED
        } else if matched == 0 {
            matched as Class
        } else {
            class_of(matched, self.running_of(worker, matched, load))
        }
    }

    /// `worker`'s running blocks of the prompt that change a decision
    /// ([`crate::policy::running_that_admits`]), at most `matched`.
    #[inline]
    pub(super) fn running_of(
        &self,
        worker: WorkerIdx,
        matched: usize,
        load: &CandidateLoad,
    ) -> usize {
        self.running
            .admitting(worker, matched, load, self.admit_blocks)
    }

    /// `worker`'s device match, by search (the walk asks about a few workers only).
    #[inline]
    fn depth(&self, worker: WorkerIdx) -> usize {
        let m = self.matches.as_slice();
        m.binary_search_by_key(&worker, |x| x.worker)
            .map_or(0, |i| m[i].depth)
    }
}

impl KvRouter {
    /// The candidates that can win under `cache-aware`, without pricing the whole
    /// fleet: workers fall into match classes by their device blocks of the prompt
    /// (class 0: none); a worker with lower-tier blocks, or in a small class, is a
    /// candidate on its own; of each large class only the members the load order puts
    /// within reach of the class's cheapest are. The policy then chooses among them
    /// exactly as among every worker: whoever is left out costs more than the cheapest
    /// within bounds plus the near-tie band, or is tied with a member added in its
    /// place that the policy prefers.
    pub(super) fn ordered_candidates(
        &self,
        base: &RouteContext<'_>,
        found: &Found<'_>,
        classes: &mut MatchClasses,
        out: &mut Vec<Candidate>,
    ) {
        let (matches, tiered, reusable) = (found.matches, found.tiered, found.reusable);
        if classes.size.len() <= reusable {
            classes.size.resize(reusable + 1, 0);
        }
        classes.begin(self.scored.len());
        // Class sizes from which a class is walked rather than priced whole: dense
        // enough that the walk rarely steps over a worker of another class.
        let walk_min = WALK_MIN_CLASS.max(self.load_order.workers() / 8) as u32;
        let registered = |w: WorkerIdx| self.scored.get(w.index()).and_then(Option::as_ref);

        // Pass 1: class sizes; workers priced on their own are added now.
        let mut matching = 0usize;
        for m in matches.iter() {
            let Some(e) = registered(m.worker) else {
                continue;
            };
            matching += 1;
            let class = found.class(m.worker, m.depth, &e.load);
            classes.know(m.worker, class);
            match class {
                PRICED => {
                    let run = found.running_of(m.worker, m.depth.min(reusable), &e.load);
                    out.push(self.candidate(m.worker, e, m.depth, run, tiered, reusable));
                }
                d => {
                    // Every member of a class that ends up small is kept here. The
                    // class holds its running blocks: no second lookup.
                    if classes.add(d) < walk_min {
                        let run = blocks_of(d).1;
                        classes.kept.push((
                            d,
                            self.candidate(m.worker, e, m.depth, run, tiered, reusable),
                        ));
                    }
                }
            }
        }
        if let Some(t) = tiered {
            // Workers holding the prompt only in lower tiers.
            for m in t.as_slice() {
                if found.depth(m.worker) == 0 {
                    if let Some(e) = registered(m.worker) {
                        matching += 1;
                        out.push(self.candidate(m.worker, e, 0, 0, tiered, reusable));
                    }
                }
            }
        }
        // Members of small classes, kept by pass 1.
        let kept = std::mem::take(&mut classes.kept);
        out.extend(
            kept.iter()
                .filter(|(d, _)| classes.size(*d) < walk_min)
                .map(|(_, c)| *c),
        );
        classes.kept = kept;
        classes.kept.clear();
        // Large classes, and the workers matching nothing.
        let unmatched = self.load_order.workers() - matching;
        if unmatched >= walk_min as usize {
            self.walk_class(base, found, classes, 0, out);
        } else if unmatched > 0 {
            // Few: every worker in no match list (both are sorted by index).
            let mut device = matches.as_slice().iter().peekable();
            for (i, e) in self.scored.iter().enumerate() {
                let w = WorkerIdx(i as u32);
                while device.next_if(|m| m.worker < w).is_some() {}
                let Some(e) = e else { continue };
                if device.peek().is_none_or(|m| m.worker != w) && found.class(w, 0, &e.load) == 0 {
                    out.push(self.candidate(w, e, 0, 0, None, reusable));
                }
            }
        }
        for &d in &classes.seen {
            if classes.size(d) >= walk_min {
                self.walk_class(base, found, classes, d, out);
            }
        }
        classes.reset();
        out.sort_unstable_by_key(|c| c.worker);
        // A pull target may also be in its run.
        out.dedup_by_key(|c| c.worker);
    }

    /// Adds the members of match class `class` (device blocks `class`, nothing in
    /// lower tiers) that can win, walking the order of each lane at each usage level
    /// part by part (a [`Part`] of a run: equal costs; at one level costs follow the
    /// order): at every level, the parts up to the first within its bounds; then, from
    /// there, every part up to the cheapest within bounds (over all levels) plus the
    /// near-tie band. Of a part only these members can matter, and only they are
    /// added: the one the policy prefers (the smallest id hash) and the
    /// [`TIE_RING_REACH`] a tie can go to (the nearest on the anchor's ring).
    fn walk_class(
        &self,
        base: &RouteContext<'_>,
        found: &Found<'_>,
        classes: &MatchClasses,
        class: Class,
        out: &mut Vec<Candidate>,
    ) {
        let policy = &self.cache_aware;
        let bound = policy.load_bound(base.fleet);
        let point = prompt_anchor(base.hashes).map_or(0, ring_point);
        let order = &self.load_order;
        let member = |w: WorkerIdx| -> Option<Candidate> {
            let e = self.scored.get(w.index()).and_then(Option::as_ref)?;
            // A worker pass 1 did not see matches no device block of the prompt.
            let of = classes
                .known(w)
                .unwrap_or_else(|| found.class(w, 0, &e.load));
            if of != class {
                return None;
            }
            let (matched_blocks, running_blocks) = blocks_of(class);
            Some(Candidate {
                worker: w,
                id_hash: e.id_hash,
                load: e.load,
                matched_blocks,
                running_blocks,
                host_blocks: 0,
                disk_blocks: 0,
                kv_movable: e.kv_movable,
            })
        };
        // A run's part whose first member is `c`: its cost, the least a part from
        // there on can cost (its cost were it to admit the prompt at once: the order
        // follows that, and not admitting it only costs more) and whether it is within
        // bounds.
        let part = |run: Run, need: usize, admits: bool, c: Candidate, then| {
            let (cost, ok) = policy.price(base, &c, bound);
            let least = if admits {
                cost
            } else {
                let admitted = Candidate {
                    load: c.load.with_admit_blocks(None),
                    ..c
                };
                policy.price(base, &admitted, bound).0
            };
            Part {
                run,
                need,
                admits,
                first: (c.id_hash, c.worker),
                then,
                cost,
                least,
                ok,
            }
        };
        // The first member of a run's part.
        let first_of = |lane: Lane, run: Run, need: usize, admits: bool| {
            first_member(order, lane, run, need, admits, &member)
        };
        // The next part after `after` at `level` of `lane` (from the level's start
        // with `None`). A run's members that admit the prompt come first: the rest
        // cost more, and are looked for only once the walk goes on past the first.
        let next_part = |lane: Lane, level: u8, after: Option<&Part>| {
            // After a part that admits the prompt, the rest of its run may hold
            // members that do not: the walk looks there first, from the part's first
            // member on (whatever it passes admits it).
            let waiting_after =
                after.filter(|a| a.admits && rooms(a.run.2, a.need, false).is_some());
            let from = match (after, waiting_after) {
                (_, Some(a)) if a.then.is_none() => {
                    Some((a.run.0, a.run.1, a.run.2, a.first.0, a.first.1))
                }
                (Some(a), _) => Some(LoadOrder::run_end(a.run)),
                (None, _) => None,
            };
            let mut walk = order.walk(lane, level, from).peekable();
            if let Some(a) = waiting_after {
                let waiting = match a.then {
                    Some(seen) => seen.and_then(member),
                    None => match first_after(&mut walk, a.run, a.need, false, &member) {
                        Some(seen) => seen,
                        None => {
                            // A long run: searched, and walked on from its end.
                            walk = order
                                .walk(lane, level, Some(LoadOrder::run_end(a.run)))
                                .peekable();
                            first_of(lane, a.run, a.need, false)
                        }
                    },
                };
                if let Some(c) = waiting {
                    return Some(part(a.run, a.need, false, c, None));
                }
            }
            let (p, c) = walk.find_map(|p| Some((p, member(p.4)?)))?;
            let run = run_of(&p);
            // One lane and one class: every member of the run needs as many blocks.
            let need = base.admit_blocks_on(&c);
            if c.load.admits(need) {
                return Some(part(run, need, true, c, None));
            }
            let admitting = match first_after(&mut walk, run, need, true, &member) {
                Some(seen) => seen,
                None => first_of(lane, run, need, true),
            };
            Some(match admitting {
                // `c`, the run's first member, is the first that does not admit it.
                Some(w) => part(run, need, true, w, Some(Some(c.worker))),
                None => part(run, need, false, c, None),
            })
        };
        // Adds a part: its first member and the members a tie can go to, the nearest
        // at or after the anchor's point on the ring, wrapping around to its start.
        let add_part = |lane: Lane, s: &Part, out: &mut Vec<Candidate>| {
            out.extend(member(s.first.1));
            if let Some(rooms) = rooms(s.run.2, s.need, s.admits) {
                let ring = nearest(order, lane, s.run, rooms, point, TIE_RING_REACH, &member);
                out.extend(
                    ring.workers()
                        .filter(|&w| w != s.first.1)
                        .filter_map(member),
                );
            }
        };
        // A pull that ends a wait goes to the idle lane with the fewest sequences
        // within bounds that admits the prompt and can import KV (a simulated engine
        // cannot), whatever its pool's use: the first such member at each level is a
        // candidate.
        let pull_targets = policy.pulls_end_waits();
        let importer = |w: WorkerIdx| member(w).filter(|c| c.kv_movable);
        let pull_target = |level: u8, from: Part, out: &mut Vec<Candidate>| {
            let mut at = Some(from);
            while let Some(s) = at {
                let first = if s.ok && s.admits {
                    importer(s.first.1)
                        .or_else(|| first_member(order, Lane::Idle, s.run, s.need, true, &importer))
                } else {
                    None
                };
                if let Some(c) = first.filter(|c| policy.starts_at_once(base, c)) {
                    out.push(c);
                    return;
                }
                at = next_part(Lane::Idle, level, Some(&s));
            }
        };
        // The least a member can cost at usage `level`: on an idle lane running
        // nothing, or a busy one with a token queued, whose headroom holds the prompt.
        // A cost only grows with sequences, backlog and (a memory weight at least 0)
        // the pool's use, and pulls are off.
        let floors = !policy.config().tiers.pulls_enabled() && policy.config().memory_weight >= 0.0;
        let floor = |level: u8| {
            let (matched_blocks, running_blocks) = blocks_of(class);
            let at = |backlog: usize| {
                let c = Candidate {
                    worker: WorkerIdx(u32::MAX),
                    id_hash: 0,
                    load: CandidateLoad::new(0, backlog).with_usage_level(level),
                    matched_blocks,
                    running_blocks,
                    host_blocks: 0,
                    disk_blocks: 0,
                    kv_movable: false,
                };
                policy.price(base, &c, bound).0
            };
            at(0).min(at(1))
        };
        // Phase 1: at each level of each lane, the parts out of bounds are added up to
        // the first part within bounds, where phase 2 starts (kept, so phase 2 does not
        // find and price it again).
        let mut resume: [[Option<Part>; USAGE_LEVELS as usize + 1]; 2] =
            [[None; USAGE_LEVELS as usize + 1]; 2];
        let mut cheapest_ok = f64::INFINITY;
        for lane in Lane::BOTH {
            for level in order.levels(lane) {
                // Once a level's floor is past the reach so far, nothing there or
                // higher can be chosen, tie or be the cheapest overall (a spill's
                // source): the lane's walk ends.
                if floors
                    && cheapest_ok.is_finite()
                    && floor(level) > cheapest_ok + policy.tie_band(cheapest_ok) + 1.0
                {
                    break;
                }
                let mut after = None;
                while let Some(s) = next_part(lane, level, after.as_ref()) {
                    if s.ok {
                        cheapest_ok = cheapest_ok.min(s.cost);
                        resume[lane as usize][level as usize] = Some(s);
                        if pull_targets && lane == Lane::Idle {
                            pull_target(level, s, out);
                        }
                        break;
                    }
                    add_part(lane, &s, out);
                    after = Some(s);
                }
            }
        }
        if !cheapest_ok.is_finite() {
            // No member within bounds: every part was added.
            return;
        }
        // Phase 2: from each level's first part within bounds, every part within reach
        // (one token of slack for rounding).
        let reach = cheapest_ok + policy.tie_band(cheapest_ok) + 1.0;
        for lane in Lane::BOTH {
            for (level, start) in resume[lane as usize].iter().enumerate() {
                // A level without a part within bounds (or without workers) is done.
                let mut at = *start;
                // Parts within reach are added whole; the walk ends at the first part
                // that, and every part after it, costs more than the reach.
                while let Some(s) = at {
                    if s.least > reach {
                        break;
                    }
                    if s.cost <= reach {
                        add_part(lane, &s, out);
                    }
                    at = next_part(lane, level as u8, Some(&s));
                }
            }
        }
    }
}

/// A run's members of one match class that admit the prompt at once (`admits`), or
/// those that do not: a run's workers differ only in their admission headroom, and
/// the prompt splits them in two, each at one cost.
#[derive(Clone, Copy)]
struct Part {
    run: Run,
    /// Blocks the class's members of the run need to admit the prompt.
    need: usize,
    admits: bool,
    /// The member the policy prefers (the smallest id hash): (id hash, worker).
    first: (u64, WorkerIdx),
    /// For the part that admits the prompt, the first member of the one that does
    /// not, where the walk has seen it (`Some(None)`: the run has none).
    then: Option<Option<WorkerIdx>>,
    cost: f64,
    /// What the part would cost were it to admit the prompt: no part after it at its
    /// level costs less.
    least: f64,
    /// Within the load bound.
    ok: bool,
}

/// The admission headrooms of a run's members (running `active` sequences) that admit
/// a prompt of `need` blocks (`admits`), or of those that do not, as
/// [`CandidateLoad::admits`] tells them apart; `None` where there are none.
fn rooms(active: u64, need: usize, admits: bool) -> Option<RangeInclusive<u32>> {
    if active == 0 {
        // A worker running nothing admits any prompt.
        return admits.then_some(0..=u32::MAX);
    }
    match (u32::try_from(need), admits) {
        (Ok(n), true) => Some(n..=u32::MAX),
        (Ok(0), false) | (Err(_), true) => None,
        (Ok(n), false) => Some(0..=n - 1),
        (Err(_), false) => Some(0..=u32::MAX),
    }
}

/// The first of `run`'s members in `lane` (`member`: those that count) that admit a
/// prompt of `need` blocks (`admits`), or that do not, by id hash.
fn first_member(
    order: &LoadOrder,
    lane: Lane,
    run: Run,
    need: usize,
    admits: bool,
    member: &impl Fn(WorkerIdx) -> Option<Candidate>,
) -> Option<Candidate> {
    let rooms = rooms(run.2, need, admits)?;
    member(nearest(order, lane, run, rooms, 0, 1, member).first()?)
}

/// Steps [`nearest`] takes by id hash before it also searches by headroom: most parts
/// are found within them, and every range search costs a descent of the tree.
const ROOM_SEARCH_AFTER: usize = 16;

/// The next member of `run` on `walk` (the level's order, within the run) that admits
/// a prompt of `need` blocks (`admits`), or that does not: `Some(None)` where the run
/// ends first (the walk is then at the next run), `None` where it has not ended within
/// [`ROOM_SEARCH_AFTER`] steps (then [`nearest`] searches). Most runs end sooner, and
/// the walk spares a search of the tree.
fn first_after<I: Iterator<Item = Position>>(
    walk: &mut Peekable<I>,
    run: Run,
    need: usize,
    admits: bool,
    member: &impl Fn(WorkerIdx) -> Option<Candidate>,
) -> Option<Option<Candidate>> {
    if rooms(run.2, need, admits).is_none() {
        return Some(None);
    }
    for _ in 0..ROOM_SEARCH_AFTER {
        let Some(p) = walk.next_if(|p| run_of(p) == run) else {
            return Some(None);
        };
        if let Some(c) = member(p.4).filter(|c| c.load.admits(need) == admits) {
            return Some(Some(c));
        }
    }
    None
}

/// At most [`TIE_RING_REACH`] workers (id hash, index), in order, without
/// allocating (and small: a decision fills one for every part it adds).
#[derive(Clone, Copy)]
struct Nearest {
    len: usize,
    at: [(u64, WorkerIdx); TIE_RING_REACH],
}

impl Nearest {
    const EMPTY: Nearest = Nearest {
        len: 0,
        at: [(0, WorkerIdx(0)); TIE_RING_REACH],
    };

    fn first(&self) -> Option<WorkerIdx> {
        self.workers().next()
    }

    fn workers(&self) -> impl Iterator<Item = WorkerIdx> + '_ {
        self.at[..self.len].iter().map(|&(_, w)| w)
    }

    /// Appends `c`, found in order.
    fn push(&mut self, c: &Candidate) {
        if let Some(slot) = self.at.get_mut(self.len) {
            *slot = (c.id_hash, c.worker);
            self.len += 1;
        }
    }

    /// Inserts `c` in ring order from `from` (see [`nearest`]), keeping the first `k`
    /// (at most [`TIE_RING_REACH`]).
    fn insert(&mut self, c: &Candidate, k: usize, from: u64) {
        let ring = |&(h, w): &(u64, WorkerIdx)| (h < from, h, w);
        let kc = ring(&(c.id_hash, c.worker));
        let at = self.at[..self.len]
            .iter()
            .position(|x| ring(x) > kc)
            .unwrap_or(self.len);
        let k = k.min(TIE_RING_REACH);
        if at >= k {
            return;
        }
        // The members from `at` move one place on; the one past `k` falls off.
        let end = self.len.min(k - 1);
        self.at.copy_within(at..end, at + 1);
        self.at[at] = (c.id_hash, c.worker);
        self.len = end + 1;
    }
}

/// The first `k` (at most [`TIE_RING_REACH`]) members of `run` in `lane` (`member`:
/// those of the class walked) whose admission headroom is in `rooms`, in ring order
/// from `from`: by id hash, those at or after `from` first, then from the start.
/// Searched by id hash (short where most members are in `rooms`) and, after
/// [`ROOM_SEARCH_AFTER`] steps, by headroom too (short where few are), a step of each
/// in turn, and answered by whichever ends first: a large run is never scanned for a
/// part of it that is small.
fn nearest(
    order: &LoadOrder,
    lane: Lane,
    run: Run,
    rooms: RangeInclusive<u32>,
    from: u64,
    k: usize,
    member: &impl Fn(WorkerIdx) -> Option<Candidate>,
) -> Nearest {
    let k = k.min(TIE_RING_REACH);
    let (mut found, mut kept) = (Nearest::EMPTY, Nearest::EMPTY);
    if k == 0 {
        return found;
    }
    // Each range is searched for only once the walk reaches it (from 0 nothing wraps).
    let wrapped = std::iter::once(from)
        .filter(|&f| f > 0)
        .flat_map(move |f| order.run_from(lane, run, 0).take_while(move |p| p.3 < f));
    let mut by_id = order.run_from(lane, run, from).chain(wrapped);
    let mut by_room = None;
    for step in 0.. {
        let Some(p) = by_id.next() else {
            return found;
        };
        if let Some(c) = member(p.4).filter(|c| rooms.contains(&c.load.admit_blocks())) {
            found.push(&c);
            if found.len == k {
                return found;
            }
        }
        if step < ROOM_SEARCH_AFTER {
            continue;
        }
        let by_room = by_room.get_or_insert_with(|| order.run_by_room(lane, run, rooms.clone()));
        let Some(p) = by_room.next() else {
            return kept;
        };
        if let Some(c) = member(p.4) {
            kept.insert(&c, k, from);
        }
    }
    found
}
