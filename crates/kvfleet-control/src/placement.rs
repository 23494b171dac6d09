//! Placement: which worker owns a prefix root or a fork group. The first router to
//! route one writes it with a compare-and-set (create-if-absent) under a TTL; every
//! other router reads or watches it and follows. Written once per new root, never per
//! request (a CAS is a round trip to etcd).

use crate::error::{ControlError, Result};
use crate::kv::{CasOutcome, KvChangeKind, KvStore};
use crate::watch::WatchStream;
use async_trait::async_trait;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

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

/// [`Placement`] over any [`KvStore`]. Each placement gets a lease of its TTL.
pub struct KvPlacement<S: KvStore + ?Sized> {
    store: Arc<S>,
}

impl<S: KvStore + ?Sized> KvPlacement<S> {
    /// Placements kept in `store`.
    pub fn new(store: Arc<S>) -> Self {
        KvPlacement { store }
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
        // Cheap read first: most callers lose to an existing placement.
        if let Some(v) = self.store.get(&k).await? {
            return owner_of(v);
        }
        let lease = self.store.grant_lease(ttl).await?;
        match self
            .store
            .create_if_absent(&k, worker.as_bytes().to_vec(), Some(lease))
            .await?
        {
            CasOutcome::Created(_) => Ok(worker.to_string()),
            CasOutcome::Exists(v) => {
                let _ = self.store.revoke_lease(lease).await;
                owner_of(v)
            }
        }
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
