//! [`KvStore`]: the few etcd operations membership and placement need — leases,
//! put, create-if-absent, compare-and-delete, prefix listing and a watch from a
//! revision that resumes by itself — implemented by [`crate::memory::MemKv`] and
//! [`crate::etcd::EtcdKv`] with the same semantics.

use crate::error::Result;
use crate::watch::WatchStream;
use async_trait::async_trait;
use std::time::Duration;

/// What a create-if-absent did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CasOutcome {
    /// The key was absent and now holds our value (at this revision).
    Created(i64),
    /// The key exists; its current value.
    Exists(Vec<u8>),
}

/// What happened to a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvChangeKind {
    /// Written (created or updated) with this value.
    Put(Vec<u8>),
    /// Deleted (explicitly, or by its lease's expiry).
    Delete,
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvChange {
    /// The store revision of the change (strictly increasing along a watch).
    pub revision: i64,
    /// The key.
    pub key: String,
    /// Put or delete.
    pub kind: KvChangeKind,
}

/// A key-value store with leases and revisions (etcd's model).
#[async_trait]
pub trait KvStore: Send + Sync + 'static {
    /// Grants a lease that expires `ttl` after its last keep-alive.
    async fn grant_lease(&self, ttl: Duration) -> Result<i64>;
    /// Refreshes a lease; [`crate::ControlError::LeaseLost`] if it is gone.
    async fn keep_alive(&self, lease: i64) -> Result<()>;
    /// Revokes a lease, deleting its keys.
    async fn revoke_lease(&self, lease: i64) -> Result<()>;
    /// Writes `key`, attached to `lease` if given; returns the revision.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<i64>) -> Result<i64>;
    /// Writes `key` only if it does not exist (one transaction).
    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<i64>,
    ) -> Result<CasOutcome>;
    /// Reads `key`.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Every key under `prefix` with the store revision of the read.
    async fn list(&self, prefix: &str) -> Result<(i64, Vec<(String, Vec<u8>)>)>;
    /// Deletes `key` if it holds exactly `value` (one transaction); whether it did.
    async fn delete_if(&self, key: &str, value: &[u8]) -> Result<bool>;
    /// Changes under `prefix` from `from_revision` (inclusive) on, in revision order,
    /// without gaps or repeats across reconnects: the implementation re-watches from
    /// the last revision seen + 1.
    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream<KvChange>>;
}
