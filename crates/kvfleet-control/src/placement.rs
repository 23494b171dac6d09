//! Placement: which worker owns a prefix root or a fork group. The first router to
//! route one writes it with a compare-and-set (create-if-absent) under a TTL; every
//! other router reads or watches it and follows. Written once per new root, never per
//! request, in one round trip: the CAS transaction (which returns the owner when it
//! loses), on a lease shared by every placement written with that TTL in the last
//! tenth of it (so a lease is granted once per TTL/10, not once per key).

use crate::error::{ControlError, Result};
use crate::kv::{CasOutcome, KvChangeKind, KvStore};
use crate::watch::WatchStream;
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Mutex};

/// Key prefix of placements.
pub const PLACEMENT_PREFIX: &str = "/kvfleet/placement/";

/// What a placement is keyed by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PlacementKind {
    /// The first block hash of a prompt.
    PrefixRoot,
    /// A client-named fork group.
    ForkGroup,
}

impl PlacementKind {
    /// The key segment.
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementKind::PrefixRoot => "prefix-root",
            PlacementKind::ForkGroup => "fork-group",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "prefix-root" => Some(PlacementKind::PrefixRoot),
            "fork-group" => Some(PlacementKind::ForkGroup),
            _ => None,
        }
    }
}

/// A placement key.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PlacementKey {
    /// Prefix root or fork group.
    pub kind: PlacementKind,
    /// The root hash (hex) or the group name.
    pub key: String,
}

impl PlacementKey {
    /// The placement of prefix root `hash`.
    pub fn prefix_root(hash: u64) -> Self {
        PlacementKey {
            kind: PlacementKind::PrefixRoot,
            key: format!("{hash:016x}"),
        }
    }

    /// The placement of fork group `name`.
    pub fn fork_group(name: &str) -> Self {
        PlacementKey {
            kind: PlacementKind::ForkGroup,
            key: name.to_string(),
        }
    }

    /// The store key: `/kvfleet/placement/<kind>/<key>` (the key percent-escapes '/'
    /// and '%').
    pub fn store_key(&self) -> String {
        let escaped = self.key.replace('%', "%25").replace('/', "%2F");
        format!("{PLACEMENT_PREFIX}{}/{escaped}", self.kind.as_str())
    }

    /// Parses a store key.
    pub fn from_store_key(k: &str) -> Option<Self> {
        let rest = k.strip_prefix(PLACEMENT_PREFIX)?;
        let (kind, key) = rest.split_once('/')?;
        Some(PlacementKey {
            kind: PlacementKind::parse(kind)?,
            key: key.replace("%2F", "/").replace("%25", "%"),
        })
    }
}

/// A placement change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlacementEvent {
    /// `key` is owned by `worker`.
    Placed {
        /// Revision of the change.
        revision: i64,
        /// The placement.
        key: PlacementKey,
        /// Owner.
        worker: String,
    },
    /// `key` has no owner any more (TTL expiry or released).
    Freed {
        /// Revision of the change.
        revision: i64,
        /// The placement.
        key: PlacementKey,
    },
}

/// Placement of prefix roots and fork groups.
#[async_trait]
pub trait Placement: Send + Sync {
    /// Makes `worker` the owner of `key` for `ttl` unless it has one; returns the owner
    /// after the call (ours, or the one that was there).
    async fn place(&self, key: &PlacementKey, worker: &str, ttl: Duration) -> Result<String>;
    /// The owner of `key`, if any.
    async fn owner(&self, key: &PlacementKey) -> Result<Option<String>>;
    /// Every placement, with the revision of the read.
    async fn list(&self) -> Result<(i64, Vec<(PlacementKey, String)>)>;
    /// Changes from `from_revision` (inclusive) on.
    async fn watch(&self, from_revision: i64) -> Result<WatchStream<PlacementEvent>>;
    /// Frees every placement owned by `worker` (it left the fleet); how many.
    async fn release_worker(&self, worker: &str) -> Result<usize>;
}

/// [`Placement`] over any [`KvStore`]. Placements written with one TTL within a
/// rotation period share a lease, so each lives between its TTL and its TTL plus that
/// period ([`rotation`]).
pub struct KvPlacement<S: KvStore + ?Sized> {
    store: Arc<S>,
    /// The current shared lease per TTL.
    leases: Mutex<HashMap<Duration, SharedLease>>,
}

/// A lease that placements of one TTL attach to until it is `rotation(ttl)` old.
#[derive(Clone, Copy)]
struct SharedLease {
    id: i64,
    granted: Instant,
}

/// How long a shared lease takes new placements: a tenth of their TTL, at least 1 s.
/// The lease itself lasts TTL + this, so every key on it gets at least its TTL.
fn rotation(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_secs(1))
}

impl<S: KvStore + ?Sized> KvPlacement<S> {
    /// Placements kept in `store`.
    pub fn new(store: Arc<S>) -> Self {
        KvPlacement {
            store,
            leases: Mutex::new(HashMap::new()),
        }
    }

    /// The lease new placements of `ttl` attach to: the current one, or a new one when
    /// it is a rotation old (or `stale`, the one a write just found gone).
    async fn lease_for(&self, ttl: Duration, stale: Option<i64>) -> Result<i64> {
        let mut leases = self.leases.lock().await;
        if let Some(l) = leases.get(&ttl) {
            if l.granted.elapsed() < rotation(ttl) && Some(l.id) != stale {
                return Ok(l.id);
            }
        }
        // The lock is held across the grant: concurrent placers of a new period wait
        // for the one lease rather than each granting their own.
        let id = self.store.grant_lease(ttl + rotation(ttl)).await?;
        leases.insert(
            ttl,
            SharedLease {
                id,
                granted: Instant::now(),
            },
        );
        Ok(id)
    }
}

fn owner_of(v: Vec<u8>) -> Result<String> {
    String::from_utf8(v).map_err(|e| ControlError::Decode {
        what: "placement owner",
        message: e.to_string(),
    })
}

#[async_trait]
impl<S: KvStore + ?Sized> Placement for KvPlacement<S> {
    async fn place(&self, key: &PlacementKey, worker: &str, ttl: Duration) -> Result<String> {
        let k = key.store_key();
        let mut lease = self.lease_for(ttl, None).await?;
        // One transaction: it writes the placement, or returns the one already there.
        // Callers place only keys their own view lacks, so no read goes first.
        for attempt in 0..2 {
            match self
                .store
                .create_if_absent(&k, worker.as_bytes().to_vec(), Some(lease))
                .await
            {
                Ok(CasOutcome::Created(_)) => return Ok(worker.to_string()),
                Ok(CasOutcome::Exists(v)) => return owner_of(v),
                // The shared lease is gone (the store lost it): once more on a new one.
                Err(ControlError::LeaseLost(_)) if attempt == 0 => {
                    lease = self.lease_for(ttl, Some(lease)).await?;
                }
                Err(e) => return Err(e),
            }
        }
        Err(ControlError::LeaseLost(lease))
    }

    async fn owner(&self, key: &PlacementKey) -> Result<Option<String>> {
        self.store
            .get(&key.store_key())
            .await?
            .map(owner_of)
            .transpose()
    }

    async fn list(&self) -> Result<(i64, Vec<(PlacementKey, String)>)> {
        let (rev, kvs) = self.store.list(PLACEMENT_PREFIX).await?;
        let mut out = Vec::with_capacity(kvs.len());
        for (k, v) in kvs {
            if let Some(key) = PlacementKey::from_store_key(&k) {
                out.push((key, owner_of(v)?));
            }
        }
        Ok((rev, out))
    }

    async fn watch(&self, from_revision: i64) -> Result<WatchStream<PlacementEvent>> {
        let mut inner = self.store.watch(PLACEMENT_PREFIX, from_revision).await?;
        let (tx, rx) = mpsc::channel(1024);
        let task = tokio::spawn(async move {
            while let Some(item) = inner.next().await {
                let out = match item {
                    Err(e) => Err(e),
                    Ok(change) => {
                        let Some(key) = PlacementKey::from_store_key(&change.key) else {
                            continue;
                        };
                        match change.kind {
                            KvChangeKind::Put(v) => match owner_of(v) {
                                Ok(worker) => Ok(PlacementEvent::Placed {
                                    revision: change.revision,
                                    key,
                                    worker,
                                }),
                                Err(_) => continue,
                            },
                            KvChangeKind::Delete => Ok(PlacementEvent::Freed {
                                revision: change.revision,
                                key,
                            }),
                        }
                    }
                };
                if tx.send(out).await.is_err() {
                    return;
                }
            }
        });
        Ok(WatchStream::new(rx, Some(task)))
    }

    async fn release_worker(&self, worker: &str) -> Result<usize> {
        let (_, kvs) = self.store.list(PLACEMENT_PREFIX).await?;
        let mut n = 0;
        for (k, v) in kvs {
            if v == worker.as_bytes() && self.store.delete_if(&k, &v).await? {
                n += 1;
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvChange;
    use crate::memory::MemKv;
    use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};

    /// The in-memory store, counting the calls a placement makes (each one a round
    /// trip on etcd).
    struct Counting {
        inner: Arc<MemKv>,
        grants: AtomicUsize,
        reads: AtomicUsize,
        cas: AtomicUsize,
        last_lease: AtomicI64,
    }

    #[async_trait]
    impl KvStore for Counting {
        async fn grant_lease(&self, ttl: Duration) -> Result<i64> {
            self.grants.fetch_add(1, Ordering::SeqCst);
            let id = self.inner.grant_lease(ttl).await?;
            self.last_lease.store(id, Ordering::SeqCst);
            Ok(id)
        }
        async fn keep_alive(&self, lease: i64) -> Result<()> {
            self.inner.keep_alive(lease).await
        }
        async fn revoke_lease(&self, lease: i64) -> Result<()> {
            self.inner.revoke_lease(lease).await
        }
        async fn put(&self, key: &str, value: Vec<u8>, lease: Option<i64>) -> Result<i64> {
            self.inner.put(key, value, lease).await
        }
        async fn create_if_absent(
            &self,
            key: &str,
            value: Vec<u8>,
            lease: Option<i64>,
        ) -> Result<CasOutcome> {
            self.cas.fetch_add(1, Ordering::SeqCst);
            self.inner.create_if_absent(key, value, lease).await
        }
        async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            self.inner.get(key).await
        }
        async fn list(&self, prefix: &str) -> Result<(i64, Vec<(String, Vec<u8>)>)> {
            self.inner.list(prefix).await
        }
        async fn delete_if(&self, key: &str, value: &[u8]) -> Result<bool> {
            self.inner.delete_if(key, value).await
        }
        async fn watch(&self, prefix: &str, from: i64) -> Result<WatchStream<KvChange>> {
            self.inner.watch(prefix, from).await
        }
    }

    #[tokio::test]
    async fn a_new_placement_is_one_transaction_on_a_shared_lease() {
        let store = Arc::new(Counting {
            inner: MemKv::new(),
            grants: AtomicUsize::new(0),
            reads: AtomicUsize::new(0),
            cas: AtomicUsize::new(0),
            last_lease: AtomicI64::new(0),
        });
        let p = KvPlacement::new(store.clone());
        let ttl = Duration::from_secs(600);
        for i in 0..10 {
            let key = PlacementKey::prefix_root(i);
            assert_eq!(p.place(&key, "w0", ttl).await.unwrap(), "w0");
        }
        let counts = |s: &Counting| {
            (
                s.grants.load(Ordering::SeqCst),
                s.reads.load(Ordering::SeqCst),
                s.cas.load(Ordering::SeqCst),
            )
        };
        // Ten keys: one lease for all, no read, one transaction each.
        assert_eq!(counts(&store), (1, 0, 10));
        // A key already placed: the transaction returns its owner.
        let first = PlacementKey::prefix_root(0);
        assert_eq!(p.place(&first, "w1", ttl).await.unwrap(), "w0");
        assert_eq!(counts(&store), (1, 0, 11));
        // The shared lease lost (its keys with it): the next placement takes a new one.
        let lease = store.last_lease.load(Ordering::SeqCst);
        store.inner.revoke_lease(lease).await.unwrap();
        assert_eq!(p.owner(&first).await.unwrap(), None);
        assert_eq!(p.place(&first, "w1", ttl).await.unwrap(), "w1");
        assert_eq!(counts(&store).0, 2);
        // Placements of another TTL get their own lease.
        let group = PlacementKey::fork_group("g");
        assert_eq!(
            p.place(&group, "w2", Duration::from_secs(5)).await.unwrap(),
            "w2"
        );
        assert_eq!(counts(&store).0, 3);
    }
}
