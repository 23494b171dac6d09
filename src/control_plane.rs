//! `--etcd` / `--kafka`: the control-plane flags shared by `worker` and `router`. The
//! glue they drive is in the libraries, where its tests run without the CLI:
//! [`RouterControl`] (`kvfleet_router::control_plane`) and [`WorkerControl`]
//! (`kvfleet_worker::control_plane`).

use anyhow::Result;
use clap::Args;
use kvfleet_control::kafka::KafkaEventStream;
use kvfleet_control::ControlConfig;
use std::sync::Arc;

pub use kvfleet_router::control_plane::{RouterControl, RouterControlConfig};
pub use kvfleet_worker::control_plane::WorkerControl;

/// Control-plane flags shared by `worker` and `router`.
#[derive(Args, Clone, Debug, Default)]
pub struct ControlArgs {
    /// etcd endpoints (comma-separated, e.g. `http://10.0.0.5:2379`): membership and
    /// placement.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Kafka bootstrap brokers (`host:port,…`): KV events and usage records.
    #[arg(long)]
    pub kafka: Option<String>,
    /// Prefix of the topic names (`<prefix>kvfleet.kv-events`, `<prefix>kvfleet.usage`).
    #[arg(long, default_value = "")]
    pub topic_prefix: String,
    /// Consumer group session timeout, milliseconds.
    #[arg(long, default_value_t = 6000)]
    pub kafka_session_timeout_ms: u64,
}

impl From<&ControlArgs> for ControlConfig {
    fn from(a: &ControlArgs) -> Self {
        ControlConfig {
            etcd: a.etcd.clone(),
            kafka: a.kafka.clone(),
            topic_prefix: a.topic_prefix.clone(),
            kafka_session_timeout_ms: a.kafka_session_timeout_ms,
        }
    }
}

impl ControlArgs {
    /// Whether any control-plane service was named.
    pub fn enabled(&self) -> bool {
        ControlConfig::from(self).enabled()
    }

    /// The event stream, if `--kafka` was given.
    pub async fn kafka(&self) -> Result<Option<Arc<KafkaEventStream>>> {
        ControlConfig::from(self).kafka().await
    }
}
