//! Worker membership: register under a lease with keep-alive; list and watch.

use crate::error::{ControlError, Result};
use crate::kv::{KvChangeKind, KvStore};
use crate::watch::WatchStream;
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Key prefix of worker registrations.
pub const WORKERS_PREFIX: &str = "/kvfleet/workers/";

/// A worker as it announces itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Worker id (unique in the fleet).
    pub id: String,
    /// Its gRPC endpoint (`host:port`).
    pub grpc_addr: String,
    /// The model it serves.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Distinguishes restarts of the same worker id (its KV event seqs restart at 1):
    /// events of another incarnation are ignored.
    #[serde(default)]
    pub incarnation: u64,
}

/// Membership as of a revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberSnapshot {
    /// Store revision of the listing; watch from `revision + 1`.
    pub revision: i64,
    /// Registered workers.
    pub workers: Vec<WorkerRecord>,
}

/// A membership change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberEvent {
    /// A worker registered (or re-registered with new facts).
    Joined {
        /// Revision of the change.
        revision: i64,
        /// The worker.
        worker: WorkerRecord,
    },
    /// A worker left: deregistered, or its lease expired.
    Left {
        /// Revision of the change.
        revision: i64,
        /// The worker's id.
        id: String,
    },
}

impl MemberEvent {
    /// The store revision of the change.
    pub fn revision(&self) -> i64 {
        match self {
            MemberEvent::Joined { revision, .. } | MemberEvent::Left { revision, .. } => *revision,
        }
    }
}

/// A live registration: its lease is kept alive until [`Registration::deregister`]
/// (revokes: the worker leaves at once) or drop (stops keep-alives: the worker leaves
/// when the lease expires, as if it had crashed).
pub struct Registration {
    lease: i64,
    keeper: Option<JoinHandle<()>>,
    lost: watch::Receiver<Option<ControlError>>,
    revoke: Option<Box<dyn FnOnce() -> futures::future::BoxFuture<'static, Result<()>> + Send>>,
}

impl Registration {
    /// The lease id.
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// Resolves when the registration is lost (lease expired or keep-alive failing
    /// past the TTL), with the reason.
    pub async fn lost(&mut self) -> ControlError {
        loop {
            let current = self.lost.borrow().clone();
            if let Some(e) = current {
                return e;
            }
            if self.lost.changed().await.is_err() {
                return ControlError::Closed;
            }
        }
    }

    /// Leaves now: stops keep-alives and revokes the lease.
    pub async fn deregister(mut self) -> Result<()> {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
        match self.revoke.take() {
            Some(r) => r().await,
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(k) = self.keeper.take() {
            k.abort();
        }
    }
}

/// Worker membership.
#[async_trait]
pub trait Membership: Send + Sync {
    /// Registers `worker` under a lease of `ttl`, kept alive in the background.
    async fn register(&self, worker: &WorkerRecord, ttl: Duration) -> Result<Registration>;
    /// Every registered worker, with the revision of the read.
    async fn list(&self) -> Result<MemberSnapshot>;
    /// Changes from `from_revision` (inclusive) on; resumes across reconnects without
    /// missing or repeating a change.
    async fn watch(&self, from_revision: i64) -> Result<WatchStream<MemberEvent>>;
}

/// [`Membership`] over any [`KvStore`]: keys `/kvfleet/workers/<id>`, JSON values.
pub struct KvMembership<S: KvStore + ?Sized> {
    store: Arc<S>,
}

impl<S: KvStore + ?Sized> KvMembership<S> {
    /// Membership kept in `store`.
    pub fn new(store: Arc<S>) -> Self {
        KvMembership { store }
    }
}

fn decode_worker(bytes: &[u8]) -> Result<WorkerRecord> {
    serde_json::from_slice(bytes).map_err(|e| ControlError::Decode {
        what: "worker record",
        message: e.to_string(),
    })
}

#[async_trait]
impl<S: KvStore + ?Sized> Membership for KvMembership<S> {
    async fn register(&self, worker: &WorkerRecord, ttl: Duration) -> Result<Registration> {
        if worker.id.is_empty() || worker.id.contains('/') {
            return Err(ControlError::Invalid(format!(
                "worker id {:?} must be non-empty and contain no '/'",
                worker.id
            )));
        }
        let lease = self.store.grant_lease(ttl).await?;
        let value = serde_json::to_vec(worker).map_err(|e| ControlError::Invalid(e.to_string()))?;
        self.store
            .put(
                &format!("{WORKERS_PREFIX}{}", worker.id),
                value,
                Some(lease),
            )
            .await?;
        let (lost_tx, lost) = watch::channel(None);
        let store = self.store.clone();
        // Three keep-alives per TTL; the lease survives two failed ones in a row.
        let period = (ttl / 3).max(Duration::from_millis(100));
        let keeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            let mut last_ok = tokio::time::Instant::now();
            loop {
                tick.tick().await;
                match store.keep_alive(lease).await {
                    Ok(()) => last_ok = tokio::time::Instant::now(),
                    Err(e @ ControlError::LeaseLost(_)) => {
                        let _ = lost_tx.send(Some(e));
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(lease, "keep-alive failed: {e}");
                        if last_ok.elapsed() > ttl {
                            let _ = lost_tx.send(Some(ControlError::LeaseLost(lease)));
                            return;
                        }
                    }
                }
            }
        });
        let store = self.store.clone();
        Ok(Registration {
            lease,
            keeper: Some(keeper),
            lost,
            revoke: Some(Box::new(move || {
                Box::pin(async move { store.revoke_lease(lease).await })
            })),
        })
    }

    async fn list(&self) -> Result<MemberSnapshot> {
        let (revision, kvs) = self.store.list(WORKERS_PREFIX).await?;
        let mut workers = Vec::with_capacity(kvs.len());
        for (key, value) in kvs {
            match decode_worker(&value) {
                Ok(w) => workers.push(w),
                Err(e) => tracing::warn!(key, "skipping a worker record: {e}"),
            }
        }
        Ok(MemberSnapshot { revision, workers })
    }

    async fn watch(&self, from_revision: i64) -> Result<WatchStream<MemberEvent>> {
        let mut inner = self.store.watch(WORKERS_PREFIX, from_revision).await?;
        let (tx, rx) = mpsc::channel(256);
        let task = tokio::spawn(async move {
            while let Some(item) = inner.next().await {
                let out = match item {
                    Err(e) => Err(e),
                    Ok(change) => {
                        let id = change.key[WORKERS_PREFIX.len()..].to_string();
                        match change.kind {
                            KvChangeKind::Put(v) => match decode_worker(&v) {
                                Ok(worker) => Ok(MemberEvent::Joined {
                                    revision: change.revision,
                                    worker,
                                }),
                                Err(e) => {
                                    tracing::warn!(id, "skipping a worker record: {e}");
                                    continue;
                                }
                            },
                            KvChangeKind::Delete => Ok(MemberEvent::Left {
                                revision: change.revision,
                                id,
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
}
