//! Arguments shared by the serving commands (`up`, `worker`, `router`).

use clap::Args;
use kvfleet_engine::Device;
use kvfleet_router::{FleetConfig, PolicyKind, RouterConfig};
use kvfleet_worker::{WorkerConfig, WorkerModel};

/// Engine sizing of a worker.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Compute device of each worker: cpu or cuda:N (CUDA needs the NVIDIA driver,
    /// NVRTC and cuBLAS 13; a missing one is reported at start).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 2048)]
    pub num_blocks: usize,
    /// Tokens per KV block (routers and workers must agree).
    #[arg(long, default_value_t = kvfleet_core::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Most sequences a worker runs at once.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most tokens per engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_batched_tokens: usize,
    /// Most prompt tokens one sequence runs per step.
    #[arg(long, default_value_t = 1024)]
    pub max_prefill_chunk: usize,
}

impl EngineArgs {
    /// A worker configuration with these sizes.
    pub fn worker_config(&self, worker_id: String, model: WorkerModel) -> WorkerConfig {
        let mut c = WorkerConfig::new(worker_id, model);
        c.device = self.device;
        c.num_blocks = self.num_blocks;
        c.block_size = self.block_size;
        c.max_num_seqs = self.max_num_seqs;
        c.max_batched_tokens = self.max_batched_tokens;
        c.max_prefill_chunk = self.max_prefill_chunk;
        c
    }
}

/// Routing settings of a router.
#[derive(Args, Clone, Debug)]
pub struct RoutingArgs {
    /// Default routing policy: cache-aware, round-robin, least-loaded, consistent-hash
    /// or random (a request may pick another with header `x-kvfleet-policy`).
    #[arg(long, default_value = "cache-aware")]
    pub policy: PolicyKind,
}

impl RoutingArgs {
    /// The fleet configuration for `model` and `block_size`.
    pub fn fleet_config(&self, model: &str, block_size: usize) -> FleetConfig {
        FleetConfig {
            model: model.to_string(),
            router: RouterConfig {
                block_size,
                ..RouterConfig::default()
            },
            default_policy: self.policy,
            ..FleetConfig::default()
        }
    }
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The multi-threaded async runtime the serving commands run on.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    use anyhow::Context;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}
