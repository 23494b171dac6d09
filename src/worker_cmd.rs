//! `kvfleet worker`: one worker process serving the gRPC worker API.

use crate::serve_args::{init_logging, shutdown_signal, EngineArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_worker::{serve_service, WorkerModel, WorkerService};
use std::io::Write;

/// Arguments of `kvfleet worker`.
#[derive(Args)]
pub struct WorkerArgs {
    /// gRPC address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    grpc: String,
    /// This worker's id (default: worker-<port>).
    #[arg(long)]
    worker_id: Option<String>,
    /// `tiny`, `small` or a Hugging Face model directory.
    #[arg(long, default_value = "tiny")]
    model: String,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Serves until Ctrl-C / SIGTERM.
pub fn run(args: WorkerArgs) -> Result<()> {
    init_logging();
    let rt = crate::serve_args::runtime()?;
    rt.block_on(async move {
        kvfleet_router::fleet_metrics::prometheus_handle();
        kvfleet_worker::describe_metrics();
        let listener = tokio::net::TcpListener::bind(&args.grpc)
            .await
            .with_context(|| format!("binding {}", args.grpc))?;
        let addr = listener.local_addr()?;
        let id = args
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("worker-{}", addr.port()));
        let config = args
            .engine
            .worker_config(id.clone(), WorkerModel::Spec(args.model.clone()));
        // Load the model before announcing the address, so whoever reads it can connect.
        let service = WorkerService::start(config)
            .await
            .context("starting the engine")?;
        println!("kvfleet worker {id}: grpc://{addr} (model {})", args.model);
        std::io::stdout().flush()?;
        serve_service(service, listener, shutdown_signal())
            .await
            .context("serving gRPC")
    })
}
