//! `kvfleet router`: one router process in front of worker processes.

use crate::serve_args::{init_logging, shutdown_signal, RoutingArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_router::{fleet_metrics, http_front, Fleet};
use std::io::Write;

/// Arguments of `kvfleet router`.
#[derive(Args)]
pub struct RouterArgs {
    /// HTTP address of the OpenAI-compatible API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: String,
    /// Worker gRPC endpoints (comma-separated `host:port`).
    #[arg(long, value_delimiter = ',', required = true)]
    workers: Vec<String>,
    /// `tiny`, `small` or a Hugging Face model directory (its tokenizer is loaded).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Tokens per KV block; workers with another size are refused.
    #[arg(long, default_value_t = kvfleet_core::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    #[command(flatten)]
    routing: RoutingArgs,
}

/// Serves until Ctrl-C / SIGTERM.
pub fn run(args: RouterArgs) -> Result<()> {
    init_logging();
    let rt = crate::serve_args::runtime()?;
    rt.block_on(async move {
        fleet_metrics::prometheus_handle();
        let fleet = Fleet::new(args.routing.fleet_config(&args.model, args.block_size))
            .map_err(anyhow::Error::msg)?;
        for w in &args.workers {
            fleet
                .add_worker(w)
                .await
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("adding worker {w}"))?;
        }
        let listener = tokio::net::TcpListener::bind(&args.http)
            .await
            .with_context(|| format!("binding {}", args.http))?;
        println!(
            "kvfleet router: http://{} ({} workers)",
            listener.local_addr()?,
            args.workers.len()
        );
        std::io::stdout().flush()?;
        axum::serve(listener, http_front::app(fleet))
            .with_graceful_shutdown(shutdown_signal())
            .await
            .context("serving HTTP")
    })
}
