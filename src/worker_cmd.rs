//! `kvfleet worker`: one worker process serving the gRPC worker API.

use crate::control_plane::{ControlArgs, WorkerControl};
use crate::serve_args::{init_logging, shutdown_signal, EngineArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_worker::{serve_service_tls, WorkerModel, WorkerService};
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
    #[command(flatten)]
    control: ControlArgs,
    /// Membership lease TTL in seconds (with --etcd): a worker that stops answering
    /// leaves every router this long after its last keep-alive.
    #[arg(long, default_value_t = 10)]
    lease_ttl: u64,
    /// Address routers connect to (default: the bound --grpc address).
    #[arg(long)]
    advertise: Option<String>,
    #[command(flatten)]
    tls: crate::tls_args::WorkerServerTlsArgs,
}

/// Serves until Ctrl-C / SIGTERM.
pub fn run(args: WorkerArgs) -> Result<()> {
    init_logging();
    let rt = crate::serve_args::runtime()?;
    rt.block_on(async move {
        let tls = args.tls.server_config()?;
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
        let control = if args.control.enabled() {
            let record = kvfleet_control::WorkerRecord {
                id: id.clone(),
                grpc_addr: args.advertise.clone().unwrap_or_else(|| addr.to_string()),
                model: service.info().model_id.clone(),
                block_size: service.info().block_size,
                incarnation: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_micros() as u64)
                    .unwrap_or(1),
            };
            let ttl = std::time::Duration::from_secs(args.lease_ttl.max(1));
            Some(
                WorkerControl::start(&args.control, ttl, record, service.event_log().clone())
                    .await
                    .context("joining the control plane")?,
            )
        } else {
            None
        };
        println!(
            "kvfleet worker {id}: {}://{addr} (model {})",
            if tls.is_some() { "grpcs" } else { "grpc" },
            args.model
        );
        std::io::stdout().flush()?;
        let served = serve_service_tls(service, listener, tls, shutdown_signal())
            .await
            .context("serving gRPC");
        if let Some(c) = control {
            c.shutdown().await;
        }
        served
    })
}
