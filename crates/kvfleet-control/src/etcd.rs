//! [`EtcdKv`]: the [`KvStore`] on etcd (etcd-client, v3 gRPC API; tested against etcd
//! 3.4). Leases with keep-alive, create-if-absent as a transaction comparing
//! `create_revision == 0`, and watches that resume from the last revision seen + 1
//! after a broken stream or a server restart (open streams then fail with an error).
//! Avoids `get_stream` (RangeStream), which etcd 3.4 lacks.

use crate::error::{timeout, ControlError, Result};
use crate::kv::{CasOutcome, KvChange, KvChangeKind, KvStore};
use crate::watch::WatchStream;
use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// An etcd cluster as a [`KvStore`].
pub struct EtcdKv {
    client: Client,
    call_timeout: Duration,
}

fn etcd_err(e: etcd_client::Error) -> ControlError {
    ControlError::Etcd(e.to_string())
}

impl EtcdKv {
    /// Connects to `endpoints` (`http://host:port`, or `host:port`); every later call
    /// fails after `call_timeout`.
    pub async fn connect(endpoints: &[String], call_timeout: Duration) -> Result<Arc<Self>> {
        if endpoints.is_empty() {
            return Err(ControlError::Invalid("no etcd endpoints given".into()));
        }
        let opts = ConnectOptions::new()
            .with_connect_timeout(call_timeout)
            .with_timeout(call_timeout)
            .with_keep_alive(Duration::from_secs(2), call_timeout);
        let client = timeout(call_timeout, "etcd connect", async {
            Client::connect(endpoints, Some(opts))
                .await
                .map_err(etcd_err)
        })
        .await?;
        let kv = EtcdKv {
            client,
            call_timeout,
        };
        // Fail now, not on first use, if nobody answers.
        kv.get("/kvfleet/.ping").await?;
        Ok(Arc::new(kv))
    }

    fn c(&self) -> Client {
        self.client.clone()
    }
}

/// A failed write: [`ControlError::LeaseLost`] when it named a lease etcd no longer has.
fn write_err(e: etcd_client::Error, lease: Option<i64>) -> ControlError {
    if e.to_string().contains("lease not found") {
        ControlError::LeaseLost(lease.unwrap_or_default())
    } else {
        etcd_err(e)
    }
}

fn utf8_key(k: &[u8]) -> Result<String> {
    String::from_utf8(k.to_vec()).map_err(|e| ControlError::Decode {
        what: "etcd key",
        message: e.to_string(),
    })
}

#[async_trait]
impl KvStore for EtcdKv {
    async fn grant_lease(&self, ttl: Duration) -> Result<i64> {
        let secs = ttl.as_secs().max(1) as i64;
        let mut c = self.c();
        timeout(self.call_timeout, "etcd lease grant", async move {
            Ok(c.lease_grant(secs, None).await.map_err(etcd_err)?.id())
        })
        .await
    }

    async fn keep_alive(&self, lease: i64) -> Result<()> {
        let mut c = self.c();
        timeout(self.call_timeout, "etcd lease keep-alive", async move {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await.map_err(etcd_err)?;
            keeper.keep_alive().await.map_err(etcd_err)?;
            match stream.message().await.map_err(etcd_err)? {
                Some(r) if r.ttl() > 0 => Ok(()),
                _ => Err(ControlError::LeaseLost(lease)),
            }
        })
        .await
    }

    async fn revoke_lease(&self, lease: i64) -> Result<()> {
        let mut c = self.c();
        timeout(self.call_timeout, "etcd lease revoke", async move {
            match c.lease_revoke(lease).await {
                Ok(_) => Ok(()),
                // Already gone: that is what we wanted.
                Err(e) if e.to_string().contains("not found") => Ok(()),
                Err(e) => Err(etcd_err(e)),
            }
        })
        .await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<i64>) -> Result<i64> {
        let mut c = self.c();
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        timeout(self.call_timeout, "etcd put", async move {
            let r = c
                .put(key, value, opts)
                .await
                .map_err(|e| write_err(e, lease))?;
            Ok(r.header().map_or(0, |h| h.revision()))
        })
        .await
    }

    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<i64>,
    ) -> Result<CasOutcome> {
        let mut c = self.c();
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, value, opts)])
            .or_else([TxnOp::get(key, None)]);
        timeout(self.call_timeout, "etcd compare-and-set", async move {
            let r = c.txn(txn).await.map_err(|e| write_err(e, lease))?;
            if r.succeeded() {
                return Ok(CasOutcome::Created(r.header().map_or(0, |h| h.revision())));
            }
            for op in r.op_responses() {
                if let TxnOpResponse::Get(g) = op {
                    if let Some(kv) = g.kvs().first() {
                        return Ok(CasOutcome::Exists(kv.value().to_vec()));
                    }
                }
            }
            // Deleted between the compare and the read: report an empty owner; the
            // caller retries or treats it as absent.
            Ok(CasOutcome::Exists(Vec::new()))
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut c = self.c();
        timeout(self.call_timeout, "etcd get", async move {
            let r = c.get(key, None).await.map_err(etcd_err)?;
            Ok(r.kvs().first().map(|kv| kv.value().to_vec()))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<(i64, Vec<(String, Vec<u8>)>)> {
        let mut c = self.c();
        timeout(self.call_timeout, "etcd list", async move {
            let r = c
                .get(prefix, Some(GetOptions::new().with_prefix()))
                .await
                .map_err(etcd_err)?;
            let rev = r.header().map_or(0, |h| h.revision());
            let mut out = Vec::with_capacity(r.kvs().len());
            for kv in r.kvs() {
                out.push((utf8_key(kv.key())?, kv.value().to_vec()));
            }
            Ok((rev, out))
        })
        .await
    }

    async fn delete_if(&self, key: &str, value: &[u8]) -> Result<bool> {
        let mut c = self.c();
        let txn = Txn::new()
            .when([Compare::value(key, CompareOp::Equal, value.to_vec())])
            .and_then([TxnOp::delete(key, None)]);
        timeout(self.call_timeout, "etcd compare-and-delete", async move {
            Ok(c.txn(txn).await.map_err(etcd_err)?.succeeded())
        })
        .await
    }

    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream<KvChange>> {
        let (tx, rx) = mpsc::channel(1024);
        let client = self.c();
        let prefix = prefix.to_string();
        let call_timeout = self.call_timeout;
        let task = tokio::spawn(async move {
            let mut next = from_revision.max(1);
            let mut backoff = Duration::from_millis(100);
            loop {
                let mut c = client.clone();
                let opts = WatchOptions::new().with_prefix().with_start_revision(next);
                let started =
                    tokio::time::timeout(call_timeout, c.watch(prefix.as_str(), Some(opts))).await;
                let mut stream = match started {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!("etcd watch failed to start: {e}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                        continue;
                    }
                    Err(_) => {
                        tracing::debug!("etcd watch start timed out");
                        continue;
                    }
                };
                // Changes below `start` were delivered before the reconnect.
                let start = next;
                loop {
                    match stream.message().await {
                        Ok(Some(resp)) => {
                            backoff = Duration::from_millis(100);
                            if resp.compact_revision() > 0 {
                                let _ = tx.send(Err(ControlError::Compacted(next))).await;
                                return;
                            }
                            let mut last = None;
                            for ev in resp.events() {
                                let Some(kv) = ev.kv() else { continue };
                                let revision = kv.mod_revision();
                                if revision < start {
                                    continue;
                                }
                                let Ok(key) = utf8_key(kv.key()) else {
                                    continue;
                                };
                                let kind = match ev.event_type() {
                                    EventType::Put => KvChangeKind::Put(kv.value().to_vec()),
                                    EventType::Delete => KvChangeKind::Delete,
                                };
                                last = Some(revision);
                                let change = KvChange {
                                    revision,
                                    key,
                                    kind,
                                };
                                if tx.send(Ok(change)).await.is_err() {
                                    return;
                                }
                            }
                            if let Some(r) = last {
                                next = next.max(r + 1);
                            }
                            if resp.canceled() {
                                break;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            // A server restart or a broken connection: re-watch from
                            // the last revision seen + 1.
                            tracing::debug!("etcd watch broke ({e}); resuming from {next}");
                            break;
                        }
                    }
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        });
        Ok(WatchStream::new(rx, Some(task)))
    }
}
