//! [`KafkaEventStream`]: the [`EventStream`] on Kafka through rdkafka and its bundled
//! librdkafka (built from source by `rdkafka-sys`; no system library needed).
//!
//! Topics are created with the admin API when missing. The producer is idempotent
//! (`enable.idempotence=true`: no duplicates or reordering from retries). Consumers
//! join a consumer group with auto-commit off and commit explicitly, so a restarted
//! consumer resumes right after the last record it committed. Nothing relies on
//! high watermarks (some Kafka-protocol brokers report them low).

use crate::error::{timeout, ControlError, Result};
use crate::events::{EventStream, Record, StartAt, Subscription, Topic, Topics};
use async_trait::async_trait;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use std::sync::Arc;
use std::time::Duration;

/// How to reach Kafka.
#[derive(Clone, Debug)]
pub struct KafkaConfig {
    /// `host:port[,host:port…]`.
    pub brokers: String,
    /// Topic names.
    pub topics: Topics,
    /// Partitions of topics this client creates.
    pub partitions: i32,
    /// Consumer group session timeout (some brokers hold a join for half of it).
    pub session_timeout: Duration,
    /// Deadline of every call (produce, commit, topic creation).
    pub call_timeout: Duration,
}

impl KafkaConfig {
    /// Defaults for `brokers`: the standard topics, 1 partition, 6 s sessions, 10 s
    /// calls.
    pub fn new(brokers: impl Into<String>) -> Self {
        KafkaConfig {
            brokers: brokers.into(),
            topics: Topics::default(),
            partitions: 1,
            session_timeout: Duration::from_secs(6),
            call_timeout: Duration::from_secs(10),
        }
    }
}

/// Longest a consumer's fetch waits at the broker for new records: the bound on how
/// late a KV event reaches a router from a broker that answers a held fetch only when
/// its wait ends. An idle consumer then sends 100 fetches a second.
const FETCH_WAIT_MAX_MS: &str = "10";
/// Longest wait between two reconnect attempts to a broker (librdkafka's default is
/// 10 s): bounds how long after a broker comes back events flow again.
const RECONNECT_BACKOFF_MAX_MS: &str = "1000";

fn kafka_err(e: KafkaError) -> ControlError {
    ControlError::Kafka(e.to_string())
}

/// Kafka as an [`EventStream`].
pub struct KafkaEventStream {
    config: KafkaConfig,
    producer: FutureProducer,
}

impl KafkaEventStream {
    /// Connects, creating the topics if they do not exist.
    pub async fn connect(config: KafkaConfig) -> Result<Self> {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &config.brokers)
            .create()
            .map_err(kafka_err)?;
        let topics = [
            NewTopic::new(
                &config.topics.kv_events,
                config.partitions,
                TopicReplication::Fixed(1),
            ),
            NewTopic::new(
                &config.topics.usage,
                config.partitions,
                TopicReplication::Fixed(1),
            ),
        ];
        let opts = AdminOptions::new().operation_timeout(Some(config.call_timeout));
        let results = timeout(config.call_timeout, "kafka create topics", async {
            admin.create_topics(&topics, &opts).await.map_err(kafka_err)
        })
        .await?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, code)) => {
                    return Err(ControlError::Kafka(format!("creating topic {t}: {code}")))
                }
            }
        }
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &config.brokers)
            .set("enable.idempotence", "true")
            .set("reconnect.backoff.max.ms", RECONNECT_BACKOFF_MAX_MS)
            .set("acks", "all")
            .set("linger.ms", "2")
            .set(
                "message.timeout.ms",
                config.call_timeout.as_millis().to_string(),
            )
            .create()
            .map_err(kafka_err)?;
        Ok(KafkaEventStream { config, producer })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// Checks that a broker answers: a metadata request for the KV event topic, within
    /// `deadline`. A consumer with no broker only reports the failure once per
    /// reconnect attempt and is otherwise silent, so reachability is probed.
    pub async fn probe(&self, deadline: Duration) -> Result<()> {
        let producer = self.producer.clone();
        let topic = self.config.topics.kv_events.clone();
        // librdkafka's metadata call blocks for a broker round trip: off the async
        // threads, bounded by `deadline` on both sides.
        let call = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&topic), deadline)
                .map(|_| ())
                .map_err(kafka_err)
        });
        match tokio::time::timeout(deadline + Duration::from_millis(500), call).await {
            Err(_) => Err(ControlError::Timeout {
                what: "kafka metadata probe",
                after: deadline,
            }),
            Ok(Err(e)) => Err(ControlError::Kafka(format!("probe task failed: {e}"))),
            Ok(Ok(r)) => r,
        }
    }
}

#[async_trait]
impl EventStream for KafkaEventStream {
    async fn publish(&self, topic: Topic, key: &str, payload: Vec<u8>) -> Result<(i32, i64)> {
        let name = self.config.topics.name(topic);
        let record = FutureRecord::to(name).key(key).payload(&payload);
        let sent = timeout(self.config.call_timeout, "kafka produce", async {
            self.producer
                .send(record, self.config.call_timeout)
                .await
                .map_err(|(e, _)| kafka_err(e))
        })
        .await?;
        Ok((sent.partition, sent.offset))
    }

    async fn subscribe(
        &self,
        topic: Topic,
        group: &str,
        start: StartAt,
    ) -> Result<Box<dyn Subscription>> {
        let session = self.config.session_timeout.as_millis().max(1000);
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.config.brokers)
            .set("group.id", group)
            .set("reconnect.backoff.max.ms", RECONNECT_BACKOFF_MAX_MS)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set(
                "auto.offset.reset",
                match start {
                    StartAt::Earliest => "earliest",
                    StartAt::Latest => "latest",
                },
            )
            .set("session.timeout.ms", session.to_string())
            .set("heartbeat.interval.ms", (session / 3).to_string())
            // KV events are routing state, and the loads they carry are stale within
            // a load poll (100 ms): a broker that holds a fetch to its full wait
            // rather than answer when data arrives (tansu does) delayed every event by
            // up to librdkafka's default 500 ms.
            .set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS)
            .create()
            .map_err(kafka_err)?;
        let name = self.config.topics.name(topic).to_string();
        consumer.subscribe(&[&name]).map_err(kafka_err)?;
        Ok(Box::new(KafkaSubscription {
            consumer: Arc::new(consumer),
            topic: name,
            call_timeout: self.config.call_timeout,
        }))
    }
}

struct KafkaSubscription {
    consumer: Arc<StreamConsumer>,
    topic: String,
    call_timeout: Duration,
}

#[async_trait]
impl Subscription for KafkaSubscription {
    async fn next(&mut self, wait: Duration) -> Result<Option<Record>> {
        match tokio::time::timeout(wait, self.consumer.recv()).await {
            Err(_) => Ok(None),
            Ok(Err(e)) => Err(kafka_err(e)),
            Ok(Ok(m)) => Ok(Some(Record {
                key: m
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                    .unwrap_or_default(),
                payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                partition: m.partition(),
                offset: m.offset(),
            })),
        }
    }

    async fn commit(&mut self, record: &Record) -> Result<()> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(
            &self.topic,
            record.partition,
            Offset::Offset(record.offset + 1),
        )
        .map_err(kafka_err)?;
        let consumer = self.consumer.clone();
        // A synchronous commit blocks for a broker round trip: off the async threads.
        let done = tokio::task::spawn_blocking(move || consumer.commit(&tpl, CommitMode::Sync));
        match tokio::time::timeout(self.call_timeout, done).await {
            Err(_) => Err(ControlError::Timeout {
                what: "kafka commit",
                after: self.call_timeout,
            }),
            Ok(Err(e)) => Err(ControlError::Kafka(format!("commit task failed: {e}"))),
            Ok(Ok(r)) => r.map_err(kafka_err),
        }
    }
}
