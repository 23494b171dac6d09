//! The event stream: KV events and usage records on two topics, keyed by worker, with
//! per-partition offsets that consumer groups commit and resume from.

use crate::error::{ControlError, Result};
use async_trait::async_trait;
use kvfleet_proto::v1 as pb;
use prost::Message;
use std::time::Duration;

/// The two topics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topic {
    /// KV events (key = worker id; payload = [`KvEventEnvelope`], protobuf).
    KvEvents,
    /// Usage records (key = worker id; payload = [`crate::UsageRecord`], JSON).
    Usage,
}

/// Topic names (defaults `kvfleet.kv-events` and `kvfleet.usage`; tests sharing one
/// broker use their own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topics {
    /// Name of the KV event topic.
    pub kv_events: String,
    /// Name of the usage topic.
    pub usage: String,
}

impl Default for Topics {
    fn default() -> Self {
        Topics {
            kv_events: "kvfleet.kv-events".into(),
            usage: "kvfleet.usage".into(),
        }
    }
}

impl Topics {
    /// Both names prefixed with `prefix`.
    pub fn prefixed(prefix: &str) -> Self {
        let d = Topics::default();
        Topics {
            kv_events: format!("{prefix}{}", d.kv_events),
            usage: format!("{prefix}{}", d.usage),
        }
    }

    /// The name of `topic`.
    pub fn name(&self, topic: Topic) -> &str {
        match topic {
            Topic::KvEvents => &self.kv_events,
            Topic::Usage => &self.usage,
        }
    }
}

/// Where a consumer group with no committed offset starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartAt {
    /// The oldest record kept.
    Earliest,
    /// Only records published from now on.
    Latest,
}

/// One consumed record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Its key (the worker id).
    pub key: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// Partition.
    pub partition: i32,
    /// Offset within the partition.
    pub offset: i64,
}

/// Publishing and consuming records.
#[async_trait]
pub trait EventStream: Send + Sync {
    /// Publishes `payload` under `key`; returns (partition, offset) once durable.
    async fn publish(&self, topic: Topic, key: &str, payload: Vec<u8>) -> Result<(i32, i64)>;
    /// Joins consumer group `group` on `topic`. Consumption resumes after the group's
    /// committed offsets; `start` applies only where the group has none.
    async fn subscribe(
        &self,
        topic: Topic,
        group: &str,
        start: StartAt,
    ) -> Result<Box<dyn Subscription>>;
}

/// A consumer-group member.
#[async_trait]
pub trait Subscription: Send {
    /// The next record, or `None` if none arrives within `wait`.
    async fn next(&mut self, wait: Duration) -> Result<Option<Record>>;
    /// Commits `record` as consumed: the group resumes after it.
    async fn commit(&mut self, record: &Record) -> Result<()>;
}

/// The KV event payload: a worker's batch and the incarnation that produced it.
#[derive(Clone, PartialEq, Message)]
pub struct KvEventEnvelope {
    /// The producing worker's incarnation (see [`crate::WorkerRecord::incarnation`]).
    #[prost(uint64, tag = "1")]
    pub incarnation: u64,
    /// Consecutive events of one worker, with their seqs (gap/duplicate detection).
    #[prost(message, optional, tag = "2")]
    pub batch: Option<pb::KvEventBatch>,
}

/// Encodes a KV event batch for the stream (protobuf: ~10 bytes per block hash).
pub fn encode_kv_events(incarnation: u64, batch: &pb::KvEventBatch) -> Vec<u8> {
    KvEventEnvelope {
        incarnation,
        batch: Some(batch.clone()),
    }
    .encode_to_vec()
}

/// Decodes [`encode_kv_events`]' output.
pub fn decode_kv_events(bytes: &[u8]) -> Result<KvEventEnvelope> {
    KvEventEnvelope::decode(bytes).map_err(|e| ControlError::Decode {
        what: "KV event envelope",
        message: e.to_string(),
    })
}
