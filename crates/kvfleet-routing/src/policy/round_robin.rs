//! `round-robin`: each worker in turn, ignoring caches and load.

use super::{RouteContext, RoutingPolicy, Selection};
use crate::registry::WorkerIdx;

/// Picks the candidate after the previous pick, by worker index, wrapping around. Keyed
/// by index rather than position so that workers joining or leaving do not reset the
/// rotation.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    last: Option<WorkerIdx>,
}

impl RoundRobin {
    /// A rotation that starts at the lowest index.
    pub fn new() -> Self {
        Self::default()
    }
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection> {
        let first = ctx.candidates.first()?;
        let next = match self.last {
            Some(last) => ctx
                .candidates
                .iter()
                .find(|c| c.worker > last)
                .unwrap_or(first),
            None => first,
        };
        self.last = Some(next.worker);
        Some(Selection::to(next.worker))
    }
}
