//! `kvfleet worker`: one worker process serving the gRPC worker API.

use crate::control_plane::{ControlArgs, WorkerControl};
use crate::serve_args::{init_logging, shutdown_signal, EngineArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_worker::{serve_service_tls, WorkerService};
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
    /// Fault test hook: panic on the engine thread once this many engine steps have
    /// run (the worker must then leave routing and exit non-zero).
    #[arg(long, hide = true)]
    fault_panic_after_steps: Option<u64>,
    /// Fault test hook: exit (as if killed) after sending this many blocks of a
    /// FetchBlocks stream to a peer.
    #[arg(long, hide = true)]
    fault_exit_mid_fetch: Option<usize>,
    /// TLS for pulling blocks from peer workers that serve TLS (--worker-tls-ca, and a
    /// client certificate where peers require one).
    #[command(flatten)]
    peer_tls: crate::tls_args::WorkerClientTlsArgs,
}

/// After the engine has failed, how long the gRPC server may take to deliver the
/// UNAVAILABLE its streams ended with before the process exits. Well inside any lease
/// TTL: the worker is gone (lease revoked, then exited) before routers would have
/// expired it.
const FAILED_ENGINE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Why serving ended.
enum Stop {
    /// Ctrl-C or SIGTERM: drain.
    Signal,
    /// The engine thread failed: leave, and exit non-zero.
    EngineFailed,
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
        let model = args.model.served(&args.engine)?;
        let mut config = args.engine.worker_config(id.clone(), model.worker);
        config.faults.panic_after_steps = args.fault_panic_after_steps;
        config.faults.exit_mid_fetch_after = args.fault_exit_mid_fetch;
        config.peer_tls = args.peer_tls.client_config()?;
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
        let health = service.health();
        // The engine is up: from here on `/health` answers 200, until it fails.
        let metrics = match &args.metrics {
            Some(a) => Some(crate::worker_http::serve(a, health.clone()).await?),
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
        // running ones finish, within --drain-timeout. A failed engine: the same, at
        // once (its requests have already ended with UNAVAILABLE), then exit non-zero
        // so the worker is restarted rather than left holding its lease and port.
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<Stop>();
        let ttl = std::time::Duration::from_secs(args.lease_ttl.max(1));
        let failed = health.clone();
        let shutdown = async move {
            let stop = tokio::select! {
                _ = shutdown_signal() => Stop::Signal,
                (reason, _) = failed.failed() => {
                    tracing::error!(worker = %id, %reason, "engine failed: leaving membership and exiting");
                    Stop::EngineFailed
                }
            };
            let _ = stop_tx.send(stop);
            if let Some(c) = control {
                // A revoke that does not answer: the lease expires by itself once the
                // process is gone.
                if tokio::time::timeout(ttl, c.shutdown()).await.is_err() {
                    tracing::warn!("leaving membership timed out; the lease will expire");
                }
            }
        };
        let drain = std::time::Duration::from_secs(args.drain_timeout);
        let deadline = async move {
            match stop_rx.await {
                Ok(Stop::Signal) => tokio::time::sleep(drain).await,
                Ok(Stop::EngineFailed) => tokio::time::sleep(FAILED_ENGINE_GRACE).await,
                Err(_) => std::future::pending::<()>().await,
            }
        };
        let served = tokio::select! {
            r = serve_service_tls(service, listener, tls, shutdown) => r.context("serving gRPC"),
            _ = deadline => {
                tracing::warn!("deadline: exiting with streams still open");
                Ok(())
            }
        };
        // The metrics server is left running: it ends with the runtime, so `/health`
        // answers (503 after a failure) until the process is gone.
        drop(metrics);
        if let kvfleet_worker::EngineStatus::Failed { reason, .. } = health.status() {
            anyhow::bail!("the worker's engine failed ({reason}); exiting so it is restarted");
        }
        served
    })
}
