//! Worker loads spread over what a fleet reports, from one random word: the loads
//! `kvfleet bench router-scale` polls and `benches/router.rs` prices decisions
//! against, so that both measure the router on the same fleet.

use kvfleet_routing::WorkerLoad;

/// Blocks of each synthetic worker's KV pool.
pub const POOL_BLOCKS: usize = 4_096;

/// A polled load drawn from `r`: up to 7 running sequences, a third of the prefill
/// lanes busy (512-8,192 tokens queued), the pool at any of the 17 usage levels of
/// the memory price and, with `headroom`, the admission headroom an engine reports
/// (the free blocks less up to 448 blocks of its running sequences' expected
/// growth; room for any prompt of the benches). Without it the worker says nothing
/// of its headroom, as one predating the field.
pub fn polled_load(r: u64, headroom: bool) -> WorkerLoad {
    let free = POOL_BLOCKS - ((r >> 28) % 17) as usize * 256;
    WorkerLoad {
        running: (r % 8) as usize,
        waiting: ((r >> 8) % 2) as usize,
        queued_prefill_tokens: if (r >> 16).is_multiple_of(3) {
            ((r >> 20) % 16 + 1) as usize * 512
        } else {
            0
        },
        total_blocks: POOL_BLOCKS,
        free_blocks: free,
        admit_blocks: headroom.then(|| free.saturating_sub(((r >> 33) % 8) as usize * 64)),
        ..WorkerLoad::default()
    }
}
