//! A worker's part in the control plane (`kvfleet-control`): `--etcd` / `--kafka`.
//!
//! A worker registers in membership under a lease (10 s by default) and publishes its
//! KV events to `kvfleet.kv-events`, keyed by its id. (The router's part, following
//! membership and the event stream, is `kvfleet_router::control_plane`.)

use crate::EventLog;
use anyhow::{Context, Result};
use futures::StreamExt;
use kvfleet_control::etcd::EtcdKv;
use kvfleet_control::kafka::KafkaEventStream;
use kvfleet_control::{
    encode_kv_events, ControlConfig, EventStream, KvMembership, Membership, Registration, Topic,
    WorkerRecord,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// A worker's presence in the control plane: its registration and event publisher.
pub struct WorkerControl {
    registration: Option<JoinHandle<Option<Registration>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    publisher: Option<JoinHandle<()>>,
}

impl WorkerControl {
    /// Registers `record` (if etcd is configured) and starts publishing `log`'s events
    /// (if Kafka is).
    pub async fn start(
        control: impl Into<ControlConfig>,
        ttl: Duration,
        record: WorkerRecord,
        log: Arc<EventLog>,
    ) -> Result<Self> {
        let args: ControlConfig = control.into();
        let publisher = args
            .kafka()
            .await?
            .map(|stream: Arc<KafkaEventStream>| spawn_publisher(stream, record.clone(), log));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let registration = match args.etcd().await? {
            Some(kv) => {
                let m = KvMembership::new(kv);
                let first = m
                    .register(&record, ttl)
                    .await
                    .context("registering in membership")?;
                Some(tokio::spawn(keep_registered(
                    m, record, ttl, first, stop_rx,
                )))
            }
            None => None,
        };
        Ok(WorkerControl {
            registration,
            stop: Some(stop_tx),
            publisher,
        })
    }

    /// Leaves membership at once (revokes the lease) and stops publishing.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(r) = self.registration.take() {
            if let Ok(Some(reg)) = r.await {
                let _ = reg.deregister().await;
            }
        }
        if let Some(p) = self.publisher.take() {
            p.abort();
        }
    }
}

/// Keeps the worker registered: registers again if the lease is lost (a long etcd
/// outage). Returns the live registration when asked to stop.
async fn keep_registered(
    m: KvMembership<EtcdKv>,
    record: WorkerRecord,
    ttl: Duration,
    mut reg: Registration,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Option<Registration> {
    loop {
        let lost = tokio::select! {
            _ = &mut stop => None,
            e = reg.lost() => Some(e),
        };
        let Some(e) = lost else { return Some(reg) };
        tracing::warn!("membership lease lost ({e}); registering again");
        loop {
            match m.register(&record, ttl).await {
                Ok(r) => {
                    reg = r;
                    break;
                }
                Err(e) => {
                    tracing::warn!("registering again failed: {e}");
                    tokio::select! {
                        _ = &mut stop => return None,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }
}

/// Publishes every event of `log`, in order, keyed by the worker id. A failed publish
/// is retried (the idempotent producer drops the duplicates a retry could cause; the
/// routers drop any that remain by seq).
fn spawn_publisher(
    stream: Arc<dyn EventStream>,
    record: WorkerRecord,
    log: Arc<EventLog>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let (_closing_tx, closing) = tokio::sync::watch::channel(false);
        let mut from = 1;
        loop {
            let sub = match log.subscribe(from) {
                Ok(s) => s,
                Err(e) => {
                    // Fell out of the ring: routers see the gap and resync from a dump.
                    tracing::warn!("KV event publisher: {e}");
                    from = log.oldest_seq();
                    continue;
                }
            };
            let mut batches = Box::pin(log.clone().into_batches(sub, closing.clone()));
            while let Some(item) = batches.next().await {
                let batch = match item {
                    Ok(b) => b,
                    Err(status) => {
                        tracing::warn!("KV event publisher fell behind: {}", status.message());
                        break;
                    }
                };
                if let Some(last) = batch.events.last() {
                    from = last.seq + 1;
                }
                let payload = encode_kv_events(record.incarnation, &batch);
                let mut backoff = Duration::from_millis(100);
                while let Err(e) = stream
                    .publish(Topic::KvEvents, &record.id, payload.clone())
                    .await
                {
                    tracing::warn!("publishing KV events failed: {e}; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
            from = from.max(log.oldest_seq());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_control::memory::MemEventStream;
    use kvfleet_control::{decode_kv_events, StartAt, Topics};
    use kvfleet_core::BlockHash;
    use kvfleet_engine::{KvEvent, KvEventKind, KvEventSink};

    #[tokio::test]
    async fn the_publisher_sends_every_event_in_order_keyed_by_worker_and_the_load() {
        let stream = Arc::new(MemEventStream::new(Topics::default(), 1024));
        let log = Arc::new(EventLog::new("w0", 64, 16));
        for seq in 1..=3u64 {
            log.publish(&KvEvent {
                seq,
                kind: KvEventKind::Stored {
                    medium: Default::default(),
                    parent_hash: (seq > 1).then(|| BlockHash(seq - 1)),
                    block_hashes: vec![BlockHash(seq)],
                },
            });
        }
        let record = WorkerRecord {
            id: "w0".into(),
            grpc_addr: "127.0.0.1:1".into(),
            model: "tiny".into(),
            block_size: 16,
            incarnation: 5,
        };
        let task = spawn_publisher(stream.clone(), record, log.clone());
        let mut sub = stream
            .subscribe(Topic::KvEvents, "test", StartAt::Earliest)
            .await
            .expect("subscribe");
        let mut seqs = Vec::new();
        while seqs.len() < 3 {
            let rec = sub
                .next(Duration::from_secs(5))
                .await
                .expect("stream")
                .expect("a record within 5 s");
            assert_eq!(rec.key, "w0");
            let env = decode_kv_events(&rec.payload).expect("envelope");
            assert_eq!(env.incarnation, 5);
            let batch = env.batch.expect("batch");
            assert_eq!(batch.worker_id, "w0");
            seqs.extend(batch.events.iter().map(|e| e.seq));
        }
        assert_eq!(seqs, vec![1, 2, 3]);
        // The load the engine publishes next goes out too, stamped with the events.
        log.publish_load(kvfleet_proto::v1::LoadResponse {
            queued_prefill_tokens: 0,
            total_blocks: 64,
            load_seq: 9,
            ..Default::default()
        });
        let load = loop {
            let rec = sub
                .next(Duration::from_secs(5))
                .await
                .expect("stream")
                .expect("the load within 5 s");
            let batch = decode_kv_events(&rec.payload).expect("envelope").batch;
            if let Some(l) = batch.and_then(|b| b.load) {
                break l;
            }
        };
        assert_eq!((load.load_seq, load.last_event_seq), (9, 3));
        task.abort();
    }

    #[tokio::test]
    async fn no_services_named_means_nothing_to_join() {
        let record = WorkerRecord {
            id: "w0".into(),
            grpc_addr: "127.0.0.1:1".into(),
            model: "tiny".into(),
            block_size: 16,
            incarnation: 1,
        };
        let log = Arc::new(EventLog::new("w0", 8, 4));
        let c = WorkerControl::start(
            ControlConfig::default(),
            Duration::from_secs(1),
            record,
            log,
        )
        .await
        .expect("start");
        assert!(c.registration.is_none() && c.publisher.is_none());
        c.shutdown().await;
    }
}
