//! Where a trace's sessions were served: how often a session's request went to another
//! worker than its previous one (a *move*), and how many distinct sessions each worker
//! served. The simulator ([`crate::sim`]) and the live replay ([`crate::replay`]) count
//! them the same way, so a session that a live router moves and the simulated one keeps
//! shows up side by side (`scripts/bench_engine_sim.sh`).
//!
//! Moves matter on multi-turn traces: a turn served away from the worker of the turn
//! before finds none of its history there, and leaves that history to age in a pool
//! that will not be asked for it again.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// Sessions' placements, with workers named by `W` (an index in the simulator, an id
/// string in a replay).
#[derive(Clone, Debug)]
pub struct SessionPlacement<W> {
    last: HashMap<u64, W>,
    pairs: HashSet<(u64, W)>,
    moves: usize,
}

impl<W> Default for SessionPlacement<W> {
    fn default() -> Self {
        Self {
            last: HashMap::new(),
            pairs: HashSet::new(),
            moves: 0,
        }
    }
}

impl<W: Clone + Eq + Hash> SessionPlacement<W> {
    /// A request of `session` went to `worker` (called in the order the session's
    /// requests were sent).
    pub fn served(&mut self, session: u64, worker: W) {
        if self
            .last
            .insert(session, worker.clone())
            .is_some_and(|w| w != worker)
        {
            self.moves += 1;
        }
        self.pairs.insert((session, worker));
    }

    /// Requests served by another worker than their session's previous request.
    pub fn moves(&self) -> usize {
        self.moves
    }

    /// Distinct sessions per worker, for the workers that served any.
    pub fn per_worker(&self) -> HashMap<W, usize> {
        let mut n = HashMap::new();
        for (_, w) in &self.pairs {
            *n.entry(w.clone()).or_insert(0) += 1;
        }
        n
    }
}

/// max / mean of `v` (1 when it sums to 0): how much more the busiest worker got than
/// the average one.
pub fn max_over_mean(v: &[usize]) -> f64 {
    let total: usize = v.iter().sum();
    if total == 0 {
        return 1.0;
    }
    let max = v.iter().copied().max().unwrap_or(0);
    max as f64 * v.len() as f64 / total as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_a_request_served_away_from_its_sessions_previous_worker() {
        let mut p = SessionPlacement::default();
        // Session 1: a, a, b, a (two moves); session 2: b, b (none).
        for (s, w) in [(1, "a"), (2, "b"), (1, "a"), (1, "b"), (2, "b"), (1, "a")] {
            p.served(s, w);
        }
        assert_eq!(p.moves(), 2);
        assert_eq!(p.per_worker(), HashMap::from([("a", 1), ("b", 2)]));
        assert_eq!(max_over_mean(&[1, 2, 3]), 1.5);
        assert_eq!(max_over_mean(&[0, 0]), 1.0);
    }
}
