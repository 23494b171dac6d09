//! `least-loaded`: fewest active sequences, ignoring caches.

use super::{RouteContext, RoutingPolicy, Selection};

/// Picks the candidate with the fewest active sequences, then the smallest prefill
/// backlog, then the lowest index.
#[derive(Clone, Debug, Default)]
pub struct LeastLoaded;

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least-loaded"
    }

    fn select(&mut self, ctx: &RouteContext<'_>) -> Option<Selection> {
        ctx.candidates
            .iter()
            .min_by_key(|c| {
                (
                    c.load.active_sequences(),
                    c.load.prefill_backlog_tokens(),
                    c.worker,
                )
            })
            .map(|c| Selection::to(c.worker))
    }
}
