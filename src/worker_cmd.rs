//! `kvfleet worker`: one worker process serving the gRPC worker API.

use crate::control_plane::{ControlArgs, WorkerControl};
use crate::serve_args::{drain_deadline, init_logging, shutdown_signal, EngineArgs};
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
    #[command(flatten)]
    model: crate::serve_args::ModelArgs,
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
    /// HTTP address serving `/metrics` (Prometheus: the `kvfleet_worker_*` series) and
    /// `/health` (200 once the engine is up); off unless given.
    #[arg(long)]
    metrics: Option<String>,
    /// On SIGTERM, how long (s) running sequences may take to finish before exit.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
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
        // Loaded here, not on the engine thread, so --served-model-name applies.
        let model = args.model.load()?;
        let config = args
            .engine
            .worker_config(id.clone(), WorkerModel::Loaded(model));
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
        // The engine is up: from here on `/health` answers 200.
        let metrics = match &args.metrics {
            Some(a) => Some(serve_metrics(a).await?),
            None => None,
        };
        let scheme = if tls.is_some() { "grpcs" } else { "grpc" };
        match &metrics {
            Some((maddr, _)) => println!(
                "kvfleet worker {id}: {scheme}://{addr} (model {}), metrics http://{maddr}",
                service.info().model_id
            ),
            None => println!(
                "kvfleet worker {id}: {scheme}://{addr} (model {})",
                service.info().model_id
            ),
        }
        std::io::stdout().flush()?;
        // SIGTERM: leave membership first (routers stop sending), then stop accepting;
        // new Generate calls get UNAVAILABLE (the router retries elsewhere) while the
        // running ones finish, within --drain-timeout.
        let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            shutdown_signal().await;
            let _ = signalled_tx.send(());
            if let Some(c) = control {
                c.shutdown().await;
            }
        };
        let drain = std::time::Duration::from_secs(args.drain_timeout);
        let deadline = drain_deadline(signalled_rx, drain);
        let served = tokio::select! {
            r = serve_service_tls(service, listener, tls, shutdown) => r.context("serving gRPC"),
            _ = deadline => {
                tracing::warn!("drain timeout: exiting with sequences still running");
                Ok(())
            }
        };
        if let Some((_, task)) = metrics {
            task.abort();
        }
        served
    })
}

/// Serves `/metrics` and `/health` on `addr` in the background; returns the bound
/// address and the server task.
async fn serve_metrics(addr: &str) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding --metrics {addr}"))?;
    let bound = listener.local_addr()?;
    let app = kvfleet_router::http_front::metrics_app();
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("metrics server stopped: {e}");
        }
    });
    Ok((bound, task))
}
