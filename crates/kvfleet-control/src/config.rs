//! Which control-plane services a process joins, and connecting to them. The CLI's
//! `--etcd` / `--kafka` flags fill a [`ControlConfig`]; the router's and the worker's
//! control-plane glue take one.

use crate::etcd::EtcdKv;
use crate::kafka::{KafkaConfig, KafkaEventStream};
use crate::Topics;
use anyhow::{Context, Result};
use std::sync::Arc;
use std::time::Duration;

/// The control-plane services to use; none named: the embedded in-process default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ControlConfig {
    /// etcd endpoints (membership and placement).
    pub etcd: Vec<String>,
    /// Kafka bootstrap brokers, `host:port,…` (KV events and usage records).
    pub kafka: Option<String>,
    /// Prefix of the topic names (`<prefix>kvfleet.kv-events`, `<prefix>kvfleet.usage`).
    pub topic_prefix: String,
    /// Consumer group session timeout, milliseconds.
    pub kafka_session_timeout_ms: u64,
}

impl ControlConfig {
    /// Whether any control-plane service was named.
    pub fn enabled(&self) -> bool {
        !self.etcd.is_empty() || self.kafka.is_some()
    }

    /// The etcd store, if etcd endpoints were given.
    pub async fn etcd(&self) -> Result<Option<Arc<EtcdKv>>> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let kv = EtcdKv::connect(&self.etcd, crate::DEFAULT_CALL_TIMEOUT)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))?;
        Ok(Some(kv))
    }

    /// The event stream, if Kafka brokers were given.
    pub async fn kafka(&self) -> Result<Option<Arc<KafkaEventStream>>> {
        let Some(brokers) = &self.kafka else {
            return Ok(None);
        };
        let mut config = KafkaConfig::new(brokers.clone());
        config.topics = Topics::prefixed(&self.topic_prefix);
        config.session_timeout = Duration::from_millis(self.kafka_session_timeout_ms);
        let s = KafkaEventStream::connect(config)
            .await
            .with_context(|| format!("connecting to Kafka at {brokers}"))?;
        Ok(Some(Arc::new(s)))
    }
}
