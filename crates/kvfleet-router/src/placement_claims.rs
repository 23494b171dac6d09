//! One claim per placement key at a time, per router.
//!
//! A request that finds its key unplaced routes first (reserving its prompt on the
//! worker it chose) and then claims that worker with one compare-and-set. Until the
//! claim resolves, that reservation makes the prompt look held by a worker that may
//! lose the claim: a sibling arriving on the same router in that window would follow
//! the reservation to the loser and compute the prefix a second time. So the first
//! request to claim a key takes a [`ClaimTicket`], and siblings arriving meanwhile
//! wait for its outcome ([`ClaimWait`]) and follow the owner.
//!
//! Entries live only while a claim is in flight (a ticket removes its entry when it
//! resolves or is dropped), so the map holds at most one entry per request in flight.

use kvfleet_core::sync::lock;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// A claim's outcome as its waiters see it: `None` while in flight, then the owner
/// (`Some(None)` when the claim could not be made).
type Outcome = Option<Option<String>>;

/// Claims in flight, by key.
type Claims<K> = Arc<Mutex<HashMap<K, watch::Receiver<Outcome>>>>;

/// The claims this router has in flight, by key (a placement key; generic so this
/// module stands alone).
pub struct ClaimsInFlight<K> {
    claims: Claims<K>,
}

impl<K> Default for ClaimsInFlight<K> {
    fn default() -> Self {
        ClaimsInFlight {
            claims: Arc::default(),
        }
    }
}

/// Whose turn it is to claim a key.
pub enum ClaimTurn<K: Hash + Eq> {
    /// This request claims the key; the ticket tells waiters the outcome.
    Mine(ClaimTicket<K>),
    /// Another request on this router is claiming it: wait for its outcome.
    Wait(ClaimWait),
}

/// The right to claim one key, held by the one request doing it.
pub struct ClaimTicket<K: Hash + Eq> {
    key: K,
    tx: watch::Sender<Outcome>,
    claims: Claims<K>,
}

/// A wait for another request's claim of the same key.
#[derive(Clone)]
pub struct ClaimWait {
    rx: watch::Receiver<Outcome>,
}

impl<K: Hash + Eq + Clone> ClaimsInFlight<K> {
    /// No claim in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// The wait for a claim of `key` in flight, if one is.
    pub fn in_flight(&self, key: &K) -> Option<ClaimWait> {
        lock(&self.claims)
            .get(key)
            .map(|rx| ClaimWait { rx: rx.clone() })
    }

    /// Takes the turn to claim `key`, or the wait for the claim already in flight.
    pub fn begin(&self, key: &K) -> ClaimTurn<K> {
        let mut claims = lock(&self.claims);
        if let Some(rx) = claims.get(key) {
            return ClaimTurn::Wait(ClaimWait { rx: rx.clone() });
        }
        let (tx, rx) = watch::channel(None);
        claims.insert(key.clone(), rx);
        ClaimTurn::Mine(ClaimTicket {
            key: key.clone(),
            tx,
            claims: self.claims.clone(),
        })
    }

    /// Whether no claim is in flight (for tests: the map must not keep entries).
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        lock(&self.claims).is_empty()
    }
}

impl<K: Hash + Eq> ClaimTicket<K> {
    /// The key this ticket claims.
    pub fn key(&self) -> &K {
        &self.key
    }

    /// Tells the waiters who owns the key (`None`: the claim could not be made).
    pub fn resolve(self, owner: Option<String>) {
        // Nobody waiting is fine: the send only fails without receivers.
        let _ = self.tx.send(Some(owner));
    }
}

impl<K: Hash + Eq> Drop for ClaimTicket<K> {
    fn drop(&mut self) {
        // Resolved or abandoned (its request cancelled): either way, the next request
        // for this key no longer waits. Waiters of an abandoned claim see the sender
        // gone and route on their own.
        lock(&self.claims).remove(&self.key);
    }
}

impl ClaimWait {
    /// The owner the claim found, or `None` if it could not be made, was abandoned,
    /// or took longer than `limit`.
    pub async fn owner(mut self, limit: Duration) -> Option<String> {
        match tokio::time::timeout(limit, self.rx.wait_for(Option::is_some)).await {
            Ok(Ok(v)) => v.clone().flatten(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control_hooks::PlacementRef;

    const LIMIT: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn siblings_wait_for_the_first_claim_and_learn_its_owner() {
        let claims = ClaimsInFlight::new();
        let key = PlacementRef::PrefixRoot(7);
        let ClaimTurn::Mine(ticket) = claims.begin(&key) else {
            panic!("the first request claims");
        };
        let ClaimTurn::Wait(second) = claims.begin(&key) else {
            panic!("a sibling waits");
        };
        let third = claims.in_flight(&key).expect("in flight");
        assert!(claims.in_flight(&PlacementRef::PrefixRoot(8)).is_none());
        let waiters =
            tokio::spawn(async move { (second.owner(LIMIT).await, third.owner(LIMIT).await) });
        ticket.resolve(Some("w1".into()));
        assert_eq!(
            waiters.await.expect("join"),
            (Some("w1".to_string()), Some("w1".to_string()))
        );
        // Resolved: the key is free to claim again, and nothing is kept.
        assert!(claims.is_empty());
        assert!(matches!(claims.begin(&key), ClaimTurn::Mine(_)));
        assert!(claims.is_empty(), "a dropped ticket frees its key");
    }

    #[tokio::test]
    async fn an_abandoned_or_failed_claim_releases_its_waiters() {
        let claims = ClaimsInFlight::new();
        let key = PlacementRef::ForkGroup("g".into());
        let ClaimTurn::Mine(ticket) = claims.begin(&key) else {
            panic!("first");
        };
        let wait = claims.in_flight(&key).expect("in flight");
        drop(ticket);
        assert_eq!(wait.owner(LIMIT).await, None);

        let ClaimTurn::Mine(ticket) = claims.begin(&key) else {
            panic!("free again");
        };
        let wait = claims.in_flight(&key).expect("in flight");
        ticket.resolve(None);
        assert_eq!(wait.owner(LIMIT).await, None);

        // A claim that never resolves holds a waiter no longer than its limit.
        let ClaimTurn::Mine(_ticket) = claims.begin(&key) else {
            panic!("free again");
        };
        let wait = claims.in_flight(&key).expect("in flight");
        assert_eq!(wait.owner(Duration::from_millis(20)).await, None);
    }
}
