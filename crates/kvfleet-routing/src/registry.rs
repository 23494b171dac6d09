//! Worker registry: maps the fleet's string worker ids to compact indices.
//!
//! The prefix index stores one bit per worker per block, so workers are named inside
//! the router by small dense integers ([`WorkerIdx`]). The registry hands out the
//! lowest free index and recycles it when a worker leaves, which keeps the bitsets as
//! narrow as the largest fleet the router has seen at once.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// A worker's compact index inside one router. Only meaningful to the registry that
/// issued it; a removed worker's index is reused by the next worker added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerIdx(pub u32);

impl WorkerIdx {
    /// The index as a `usize`, for indexing per-worker vectors.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for WorkerIdx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Bidirectional map between string worker ids and [`WorkerIdx`] slots.
#[derive(Debug, Default, Clone)]
pub struct WorkerRegistry {
    names: Vec<Option<Arc<str>>>,
    by_name: HashMap<Arc<str>, WorkerIdx>,
    // Lowest-first reuse keeps indices (and so bitset widths) dense.
    free: BTreeSet<u32>,
}

impl WorkerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `id`, returning its index and whether it was newly added. Adding an
    /// id that is already present returns its existing index.
    pub fn insert(&mut self, id: &str) -> (WorkerIdx, bool) {
        if let Some(idx) = self.by_name.get(id) {
            return (*idx, false);
        }
        let name: Arc<str> = Arc::from(id);
        let idx = match self.free.pop_first() {
            Some(slot) => {
                if let Some(entry) = self.names.get_mut(slot as usize) {
                    *entry = Some(name.clone());
                }
                WorkerIdx(slot)
            }
            None => {
                let slot = u32::try_from(self.names.len()).unwrap_or(u32::MAX);
                self.names.push(Some(name.clone()));
                WorkerIdx(slot)
            }
        };
        self.by_name.insert(name, idx);
        (idx, true)
    }

    /// Removes `id`, returning the index it held; the index becomes free for reuse.
    pub fn remove(&mut self, id: &str) -> Option<WorkerIdx> {
        let idx = self.by_name.remove(id)?;
        if let Some(entry) = self.names.get_mut(idx.index()) {
            *entry = None;
        }
        self.free.insert(idx.0);
        Some(idx)
    }

    /// The index of `id`, if registered.
    pub fn get(&self, id: &str) -> Option<WorkerIdx> {
        self.by_name.get(id).copied()
    }

    /// The string id registered at `idx`.
    pub fn name(&self, idx: WorkerIdx) -> Option<&Arc<str>> {
        self.names.get(idx.index()).and_then(Option::as_ref)
    }

    /// Number of registered workers.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// One more than the highest index ever issued: the width per-worker tables need.
    pub fn capacity(&self) -> usize {
        self.names.len()
    }

    /// Registered workers in index order.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerIdx, &Arc<str>)> + '_ {
        self.names
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (WorkerIdx(i as u32), n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycles_lowest_slot() {
        let mut r = WorkerRegistry::new();
        let (a, new_a) = r.insert("a");
        let (b, _) = r.insert("b");
        let (c, _) = r.insert("c");
        assert!(new_a);
        assert_eq!((a, b, c), (WorkerIdx(0), WorkerIdx(1), WorkerIdx(2)));
        assert_eq!(r.insert("b"), (b, false));
        assert_eq!(r.remove("b"), Some(b));
        assert_eq!(r.remove("a"), Some(a));
        assert_eq!(r.remove("a"), None);
        assert_eq!(r.get("b"), None);
        assert_eq!(r.insert("d").0, WorkerIdx(0));
        assert_eq!(r.insert("e").0, WorkerIdx(1));
        assert_eq!(r.insert("f").0, WorkerIdx(3));
        assert_eq!(r.len(), 4);
        assert_eq!(r.capacity(), 4);
        let names: Vec<&str> = r.iter().map(|(_, n)| &**n).collect();
        assert_eq!(names, ["d", "e", "c", "f"]);
        assert_eq!(r.name(WorkerIdx(2)).map(|n| &**n), Some("c"));
    }
}
