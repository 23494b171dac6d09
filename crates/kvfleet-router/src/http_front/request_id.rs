//! Request ids, unique across every router process of a fleet.
//!
//! A worker refuses a request whose id is already running on it (`AlreadyExists`, a
//! 502 for the client), and several routers send to the same workers. An id made of
//! the clock and a per-process counter alone repeats when two routers issue their
//! n-th request in the same microsecond, which fork siblings sent to two routers at
//! once do. So each process adds a random nonce of its own.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// One process's source of request ids.
pub(crate) struct RequestIds {
    nonce: u32,
    next: AtomicU64,
}

impl RequestIds {
    /// A source with a nonce of its own (std seeds `RandomState` from the OS).
    pub(crate) fn new() -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        Self {
            nonce: h.finish() as u32,
            next: AtomicU64::new(1),
        }
    }

    /// The next id, as of `micros` since the Unix epoch.
    pub(crate) fn next_at(&self, micros: u64) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{micros:x}{:08x}{:06x}", self.nonce, n & 0xff_ffff)
    }
}

/// A request id unique across the fleet's routers.
pub(crate) fn request_id() -> String {
    static IDS: OnceLock<RequestIds> = OnceLock::new();
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    IDS.get_or_init(RequestIds::new).next_at(micros)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn two_routers_issuing_their_nth_request_in_one_microsecond_get_different_ids() {
        let (a, b) = (RequestIds::new(), RequestIds::new());
        let t = 1_764_000_000_000_000;
        for _ in 0..100 {
            assert_ne!(a.next_at(t), b.next_at(t));
        }
    }

    #[test]
    fn one_router_never_repeats_an_id_within_a_microsecond() {
        let ids = RequestIds::new();
        let got: HashSet<String> = (0..10_000).map(|_| ids.next_at(42)).collect();
        assert_eq!(got.len(), 10_000);
    }
}
