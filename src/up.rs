//! `kvfleet up`: the embedded cluster — one router and N workers in one process, each
//! worker with its own engine and block pool, talking real gRPC over loopback.

use crate::serve_args::{init_logging, serve_http_with_drain, EngineArgs, RoutingArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_router::{fleet_metrics, Fleet};
use kvfleet_worker::spawn_worker;
use std::io::Write;

/// Arguments of `kvfleet up`.
#[derive(Args)]
pub struct UpArgs {
    /// Workers to start.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// HTTP address of the OpenAI-compatible API (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: String,
    #[command(flatten)]
    model: crate::serve_args::ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    routing: RoutingArgs,
    #[command(flatten)]
    security: crate::security_args::SecurityArgs,
    #[command(flatten)]
    tls: crate::tls_args::HttpTlsArgs,
}

/// Runs the embedded cluster until Ctrl-C / SIGTERM.
pub fn run(args: UpArgs) -> Result<()> {
    init_logging();
    let rt = crate::serve_args::runtime()?;
    rt.block_on(serve(args))
}

async fn serve(args: UpArgs) -> Result<()> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    let admission = args.security.admission()?;
    let tls = args.tls.server_config()?;
    fleet_metrics::prometheus_handle();
    kvfleet_worker::describe_metrics();
    // Load the weights once (none for --engine sim); every in-process worker shares them.
    let model = args.model.served(&args.engine)?;
    let mut workers = Vec::new();
    for i in 0..args.workers {
        let mut config = args
            .engine
            .worker_config(format!("worker-{i}"), model.worker.clone());
        // The workers share one device and start one after another, each measuring what
        // the ones before it hold: worker i may bring the process to (i+1)/n of the
        // fraction, so each gets about an n-th.
        config.gpu_memory_utilization = config
            .gpu_memory_utilization
            .map(|u| u * (i + 1) as f64 / args.workers as f64);
        workers.push(spawn_worker(config).await.context("starting a worker")?);
    }
    let fleet = Fleet::new(
        args.routing
            .fleet_config(model.prompt.clone(), args.engine.block_size)?,
    )
    .map_err(anyhow::Error::msg)?;
    for w in &workers {
        fleet
            .add_worker(&w.endpoint())
            .await
            .map_err(anyhow::Error::msg)
            .context("adding a worker to the router")?;
    }
    let listener = tokio::net::TcpListener::bind(&args.http)
        .await
        .with_context(|| format!("binding {}", args.http))?;
    let addr = listener.local_addr()?;
    // Scripts and tests read this line to find the port.
    println!(
        "kvfleet up: {}://{addr} ({} workers, model {}, policy {})",
        args.tls.scheme(),
        args.workers,
        model.id,
        args.routing.policy.as_str()
    );
    std::io::stdout().flush()?;
    let drain = std::time::Duration::from_secs(args.routing.drain_timeout);
    serve_http_with_drain(listener, admission, tls, fleet, drain)
        .await
        .context("serving HTTP")?;
    for w in workers {
        let _ = w.shutdown().await;
    }
    Ok(())
}
