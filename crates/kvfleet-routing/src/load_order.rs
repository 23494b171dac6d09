//! [`LoadOrder`]: every worker ordered by load, so that `cache-aware` prices the few
//! cheapest members of a large group of equally matched workers instead of all of
//! them.
//!
//! Under `cache-aware`, workers that match a prompt equally (the same device blocks of
//! it and no host or disk blocks: none at all, or a system prompt every worker holds)
//! differ only in load. An idle prefill lane costs `λ_idle × X + d × active + m × X ×
//! usage`, a busy one `λ_busy × X + backlog + d × active + m × X × usage`, with `X`
//! the same for the whole group (see [`CacheAware`](crate::policy::CacheAware)). The
//! memory term's weight `m × X` depends on the request, so usage cannot be folded into
//! one key; it takes [`USAGE_LEVELS`] + 1 values, and each lane keeps one order per
//! level. At one level the cheapest members of a group come first in one of two
//! orders: idle lanes by active sequences, busy lanes by `backlog + d × active` (then
//! active sequences); a decision walks the head of each level. Workers with equal
//! keys (a *run*: typically hundreds of idle workers at light load) are ordered by id
//! hash, which is how `cache-aware` breaks ties: by the preferred order (the smallest
//! id hash) and by the anchor's ring (the tied workers nearest at or after its point).
//! Both are a range query.
//!
//! A worker that cannot admit the prompt now (its admission headroom is short of it)
//! costs more than its key says, by an amount that depends on the prompt: the key
//! orders each level by the cost every worker would have were it to admit the prompt,
//! a lower bound, and the walk stops at the first run whose bound is out of reach.
//! Within a run, a prompt splits the members in two, those whose headroom holds it
//! and the rest, each at one cost. Headroom is not part of the run (every worker
//! reports its own, so runs would be one worker long and the walk would price them
//! one by one); each run's members are also kept by headroom, where either part of
//! the split is one range. The router keeps the orders up to date on every load
//! change (`O(log n)`), and a decision walks their heads run by run instead of
//! pricing the fleet: at 1,024 workers it prices a handful of workers, not 1,024.

use crate::load::{CandidateLoad, USAGE_LEVELS};
use crate::registry::WorkerIdx;
use std::collections::BTreeSet;
use std::ops::{Bound, RangeInclusive};

/// Whether a worker's prefill lane is idle (no backlog) or busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// No prompt tokens waiting: ordered by active sequences.
    Idle,
    /// Prompt tokens waiting: ordered by `backlog + d × active`.
    Busy,
}

impl Lane {
    /// Both lanes.
    pub const BOTH: [Lane; 2] = [Lane::Idle, Lane::Busy];

    /// The lane of a worker with `load`.
    pub fn of(load: &CandidateLoad) -> Lane {
        if load.prefill_backlog_tokens() > 0 {
            Lane::Busy
        } else {
            Lane::Idle
        }
    }
}

/// A position in one lane's order: (usage level, order key, active sequences, id
/// hash, worker). The first three are the worker's run: its load as far as cost goes,
/// but for its admission headroom.
pub type Position = (u8, u64, u64, u64, WorkerIdx);

/// A run: (usage level, order key, active sequences), the load of workers that cost
/// the same where their admission headroom holds the prompt (or where it does not).
/// Within a level the key orders costs as if every worker admits the prompt, a lower
/// bound of each run's cost.
pub type Run = (u8, u64, u64);

/// The run of a position: workers with equal loads.
pub fn run_of(p: &Position) -> Run {
    (p.0, p.1, p.2)
}

/// A position by headroom: (usage level, order key, active sequences, admission
/// headroom in blocks, `u32::MAX` where the worker does not say, id hash, worker).
type RoomPosition = (u8, u64, u64, u32, u64, WorkerIdx);

/// One lane's orders, a tree per usage level: a decision walks each level's head, and
/// a tree of its own per level spares it a search for where each level starts (and
/// keeps every search within a level's workers).
#[derive(Clone, Debug, Default)]
struct LaneOrder {
    /// Each run's members by id hash.
    by_id: [BTreeSet<Position>; USAGE_LEVELS as usize + 1],
    /// The same by headroom, then id hash: a prompt's split of a run is two ranges.
    by_room: [BTreeSet<RoomPosition>; USAGE_LEVELS as usize + 1],
}

impl LaneOrder {
    fn insert(&mut self, p: Position, room: u32) {
        let level = usize::from(p.0);
        self.by_id[level].insert(p);
        self.by_room[level].insert((p.0, p.1, p.2, room, p.3, p.4));
    }

    fn remove(&mut self, p: &Position, room: u32) {
        let level = usize::from(p.0);
        self.by_id[level].remove(p);
        self.by_room[level].remove(&(p.0, p.1, p.2, room, p.3, p.4));
    }
}

/// Registered workers in two load orders, with the fleet's totals.
#[derive(Clone, Debug)]
pub struct LoadOrder {
    /// `d`: the cost of one active sequence, in prompt-token equivalents.
    decode_cost: f64,
    idle: LaneOrder,
    busy: LaneOrder,
    /// Each worker's lane, position and headroom, by index (`None`: not registered).
    slot: Vec<Option<(Lane, Position, u32)>>,
    workers: usize,
    active_sequences: usize,
    usage_levels: usize,
}

impl LoadOrder {
    /// An empty order for a policy that prices an active sequence at `decode_cost`.
    pub fn new(decode_cost: f64) -> Self {
        Self {
            decode_cost,
            idle: LaneOrder::default(),
            busy: LaneOrder::default(),
            slot: Vec::new(),
            workers: 0,
            active_sequences: 0,
            usage_levels: 0,
        }
    }

    /// Whether the orders follow cost: only with a finite, non-negative `decode_cost`
    /// (a key of `backlog + d × active` is then ordered as its cost).
    pub fn usable(&self) -> bool {
        self.decode_cost.is_finite() && self.decode_cost >= 0.0
    }

    /// Registered workers.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Active sequences over every registered worker.
    pub fn active_sequences(&self) -> usize {
        self.active_sequences
    }

    /// Usage levels over every registered worker, summed.
    pub fn usage_levels(&self) -> usize {
        self.usage_levels
    }

    /// Records worker `w`'s load and id hash (`None`: it left).
    pub fn set(&mut self, w: WorkerIdx, load: Option<(CandidateLoad, u64)>) {
        let i = w.index();
        if i >= self.slot.len() {
            self.slot.resize(i + 1, None);
        }
        if let Some((lane, pos, room)) = self.slot[i].take() {
            self.lane_mut(lane).remove(&pos, room);
            self.workers -= 1;
            self.active_sequences -= pos.2 as usize;
            self.usage_levels -= usize::from(pos.0);
        }
        if let Some((load, id_hash)) = load {
            let lane = Lane::of(&load);
            let active = load.active_sequences();
            let level = load.usage_level().min(USAGE_LEVELS);
            let pos = (level, self.key(lane, &load), active as u64, id_hash, w);
            let room = load.admit_blocks();
            self.lane_mut(lane).insert(pos, room);
            self.slot[i] = Some((lane, pos, room));
            self.workers += 1;
            self.active_sequences += active;
            self.usage_levels += usize::from(level);
        }
    }

    /// The usage levels `lane` has workers at, lowest first.
    pub fn levels(&self, lane: Lane) -> impl Iterator<Item = u8> + '_ {
        self.lane(lane)
            .by_id
            .iter()
            .enumerate()
            .filter(|(_, set)| !set.is_empty())
            .map(|(level, _)| level as u8)
    }

    /// `lane`'s workers at usage `level` in order, after `after` (from the level's
    /// start with `None`).
    pub fn walk(
        &self,
        lane: Lane,
        level: u8,
        after: Option<Position>,
    ) -> impl Iterator<Item = Position> + '_ {
        let start = after.map_or(
            Bound::Included((level, 0, 0, 0, WorkerIdx(0))),
            Bound::Excluded,
        );
        let end = Bound::Included(LoadOrder::run_end((level, u64::MAX, u64::MAX)));
        self.lane(lane)
            .by_id
            .get(usize::from(level))
            .into_iter()
            .flat_map(move |set| set.range((start, end)).copied())
    }

    /// The workers of `run` in `lane` whose id hash is at least `from`, in order.
    pub fn run_from(&self, lane: Lane, run: Run, from: u64) -> impl Iterator<Item = Position> + '_ {
        self.lane(lane)
            .by_id
            .get(usize::from(run.0))
            .into_iter()
            .flat_map(move |set| {
                set.range((run.0, run.1, run.2, from, WorkerIdx(0))..=LoadOrder::run_end(run))
                    .copied()
            })
    }

    /// The workers of `run` in `lane` whose admission headroom is in `rooms`
    /// (`u32::MAX`: not said), by headroom.
    pub fn run_by_room(
        &self,
        lane: Lane,
        run: Run,
        rooms: RangeInclusive<u32>,
    ) -> impl Iterator<Item = Position> + '_ {
        let (low, high) = (*rooms.start(), *rooms.end());
        self.lane(lane)
            .by_room
            .get(usize::from(run.0))
            .into_iter()
            .flat_map(move |set| {
                set.range(
                    (run.0, run.1, run.2, low, 0, WorkerIdx(0))
                        ..=(run.0, run.1, run.2, high, u64::MAX, WorkerIdx(u32::MAX)),
                )
                .map(|p| (p.0, p.1, p.2, p.4, p.5))
            })
    }

    /// The position just past the end of `run`: walking after it starts the next run.
    pub fn run_end(run: Run) -> Position {
        (run.0, run.1, run.2, u64::MAX, WorkerIdx(u32::MAX))
    }

    fn key(&self, lane: Lane, load: &CandidateLoad) -> u64 {
        match lane {
            // `d × active` is ordered as `active` for any d ≥ 0.
            Lane::Idle => load.active_sequences() as u64,
            // Non-negative finite f64s are ordered as their bit patterns.
            Lane::Busy => (load.prefill_backlog_tokens() as f64
                + self.decode_cost * load.active_sequences() as f64)
                .max(0.0)
                .to_bits(),
        }
    }

    fn lane(&self, lane: Lane) -> &LaneOrder {
        match lane {
            Lane::Idle => &self.idle,
            Lane::Busy => &self.busy,
        }
    }

    fn lane_mut(&mut self, lane: Lane) -> &mut LaneOrder {
        match lane {
            Lane::Idle => &mut self.idle,
            Lane::Busy => &mut self.busy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order_of(o: &LoadOrder, lane: Lane) -> Vec<u32> {
        o.levels(lane)
            .flat_map(|l| o.walk(lane, l, None))
            .map(|p| p.4 .0)
            .collect()
    }

    fn set(o: &mut LoadOrder, w: u32, active: usize, backlog: usize) {
        // Id hashes in reverse index order, to tell them apart from indices.
        o.set(
            WorkerIdx(w),
            Some((CandidateLoad::new(active, backlog), 100 - u64::from(w))),
        );
    }

    #[test]
    fn workers_are_ordered_by_their_cost_per_lane_and_moved_on_every_change() {
        let mut o = LoadOrder::new(16.0);
        set(&mut o, 0, 3, 0);
        set(&mut o, 1, 1, 0);
        set(&mut o, 2, 0, 100);
        // 10 + 16 × 2 = 42 < 100.
        set(&mut o, 3, 2, 10);
        assert_eq!(order_of(&o, Lane::Idle), [1, 0]);
        assert_eq!(order_of(&o, Lane::Busy), [3, 2]);
        assert_eq!((o.workers(), o.active_sequences()), (4, 6));
        // w1 starts prefilling: it leaves the idle lane for the busy one.
        set(&mut o, 1, 2, 500);
        assert_eq!(order_of(&o, Lane::Idle), [0]);
        assert_eq!(order_of(&o, Lane::Busy), [3, 2, 1]);
        assert_eq!(o.active_sequences(), 7);
        // w3 leaves.
        o.set(WorkerIdx(3), None);
        assert_eq!(order_of(&o, Lane::Busy), [2, 1]);
        assert_eq!((o.workers(), o.active_sequences()), (3, 5));
        // Resuming after a position.
        let first = o.walk(Lane::Busy, 0, None).next();
        let rest: Vec<u32> = o.walk(Lane::Busy, 0, first).map(|p| p.4 .0).collect();
        assert_eq!(rest, [1]);
        // A run: equal loads, ordered by id hash; found from a point on the ring.
        for w in 10..15 {
            set(&mut o, w, 4, 0);
        }
        assert_eq!(order_of(&o, Lane::Idle), [0, 14, 13, 12, 11, 10]);
        let run = run_of(
            &o.walk(Lane::Idle, 0, Some(LoadOrder::run_end((0, 3, 3))))
                .next()
                .unwrap(),
        );
        assert_eq!(run, (0, 4, 4));
        let from = |h: u64| {
            o.run_from(Lane::Idle, run, h)
                .map(|p| p.4 .0)
                .collect::<Vec<_>>()
        };
        assert_eq!(from(88), [12, 11, 10]);
        assert!(from(91).is_empty());
        let next: Vec<u32> = o
            .walk(Lane::Idle, 0, Some(LoadOrder::run_end(run)))
            .map(|p| p.4 .0)
            .collect();
        assert!(next.is_empty());
        // A fuller pool: another level, walked on its own.
        o.set(
            WorkerIdx(20),
            Some((CandidateLoad::new(0, 0).with_usage_level(9), 7)),
        );
        assert_eq!(o.levels(Lane::Idle).collect::<Vec<_>>(), [0, 9]);
        assert_eq!(order_of(&o, Lane::Idle), [0, 14, 13, 12, 11, 10, 20]);
        let at9: Vec<u32> = o.walk(Lane::Idle, 9, None).map(|p| p.4 .0).collect();
        assert_eq!(
            at9,
            [20],
            "worker 20 has the fewest sequences, but only at level 9"
        );
        o.set(WorkerIdx(20), None);
        assert_eq!(o.levels(Lane::Idle).collect::<Vec<_>>(), [0]);
        assert!(o.usable());
        assert!(!LoadOrder::new(-1.0).usable());
        assert!(!LoadOrder::new(f64::NAN).usable());
    }

    #[test]
    fn a_run_holds_every_headroom_and_is_split_by_headroom_in_one_range() {
        let mut o = LoadOrder::new(16.0);
        // Five workers decoding 2 sequences each, idle, headroom 10, 20, 30, 40 and
        // unsaid; id hashes 100 - w.
        for (w, room) in [
            (1, Some(30)),
            (2, Some(10)),
            (3, None),
            (4, Some(40)),
            (5, Some(20)),
        ] {
            o.set(
                WorkerIdx(w),
                Some((
                    CandidateLoad::new(2, 0).with_admit_blocks(room),
                    100 - u64::from(w),
                )),
            );
        }
        // One run, by id hash.
        assert_eq!(order_of(&o, Lane::Idle), [5, 4, 3, 2, 1]);
        let run = (0, 2, 2);
        let by_room = |o: &LoadOrder, rooms: RangeInclusive<u32>| {
            o.run_by_room(Lane::Idle, run, rooms)
                .map(|p| p.4 .0)
                .collect::<Vec<_>>()
        };
        // A prompt of 25 blocks: admitted by 1, 4 and 3 (unsaid), not by 2 and 5.
        assert_eq!(by_room(&o, 0..=24), [2, 5]);
        assert_eq!(by_room(&o, 25..=u32::MAX), [1, 4, 3]);
        // A change of headroom alone moves the worker within its run only.
        o.set(
            WorkerIdx(2),
            Some((CandidateLoad::new(2, 0).with_admit_blocks(Some(50)), 98)),
        );
        assert_eq!(order_of(&o, Lane::Idle), [5, 4, 3, 2, 1]);
        assert_eq!(by_room(&o, 0..=24), [5]);
        assert_eq!(by_room(&o, 25..=u32::MAX), [1, 4, 2, 3]);
        // Leaving leaves both orders.
        o.set(WorkerIdx(5), None);
        assert!(by_room(&o, 0..=24).is_empty());
        assert_eq!(order_of(&o, Lane::Idle), [4, 3, 2, 1]);
    }
}
