//! `kvfleet router`: one router process in front of worker processes.

use crate::control_plane::{ControlArgs, RouterControl, RouterControlConfig};
use crate::serve_args::{init_logging, serve_http_with_drain, RoutingArgs};
use anyhow::{Context, Result};
use clap::Args;
use kvfleet_router::{fleet_metrics, Fleet};
use std::io::Write;

/// Arguments of `kvfleet router`.
#[derive(Args)]
pub struct RouterArgs {
    /// HTTP address of the OpenAI-compatible API.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: String,
    /// Worker gRPC endpoints (comma-separated `host:port`); with --etcd, workers are
    /// discovered from membership instead.
    #[arg(long, value_delimiter = ',', required_unless_present = "etcd")]
    workers: Vec<String>,
    /// The model the workers serve, as `kvfleet worker --model` takes it: only its
    /// tokenizer and chat template are loaded (a GGUF file's header, not its weights).
    #[arg(long, default_value = kvfleet_engine::model_cache::DEFAULT_MODEL)]
    model: String,
    /// Tokens per KV block; workers with another size are refused.
    #[arg(long, default_value_t = kvfleet_core::DEFAULT_BLOCK_SIZE)]
    block_size: usize,
    #[command(flatten)]
    routing: RoutingArgs,
    #[command(flatten)]
    security: crate::security_args::SecurityArgs,
    #[command(flatten)]
    control: ControlArgs,
    #[command(flatten)]
    tls: crate::tls_args::HttpTlsArgs,
    #[command(flatten)]
    worker_tls: crate::tls_args::WorkerClientTlsArgs,
    /// This router's id (default `router-<http port>`): its KV event consumer group is
    /// `kvfleet-router-<id>`, resumed after a restart.
    #[arg(long)]
    router_id: Option<String>,
    /// TTL in seconds of the fork-group / prefix-root placements this router writes.
    #[arg(long, default_value_t = 600)]
    placement_ttl: u64,
}

/// Serves until Ctrl-C / SIGTERM.
pub fn run(args: RouterArgs) -> Result<()> {
    init_logging();
    let rt = crate::serve_args::runtime()?;
    rt.block_on(async move {
        let admission = args.security.admission()?;
        let tls = args.tls.server_config()?;
        fleet_metrics::prometheus_handle();
        let side = kvfleet_engine::load_prompt_model(&args.model)
            .with_context(|| format!("loading the tokenizer of `{}`", args.model))?;
        let prompt = kvfleet_router::prompt_model::PromptModel {
            tokenizer: side.tokenizer,
            chat_template: side.chat_template,
        };
        let mut config = args.routing.fleet_config(prompt, args.block_size)?;
        // With Kafka, every worker's KV events come from the stream.
        config.follow_worker_events = args.control.kafka.is_none();
        config.worker_tls = args.worker_tls.client_config()?;
        let fleet = Fleet::new(config).map_err(anyhow::Error::msg)?;
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
        let addr = listener.local_addr()?;
        let control = if args.control.etcd.is_empty() {
            None
        } else {
            let config = RouterControlConfig {
                router_id: args
                    .router_id
                    .clone()
                    .unwrap_or_else(|| format!("router-{}", addr.port())),
                placement_ttl: std::time::Duration::from_secs(args.placement_ttl.max(1)),
            };
            Some(
                RouterControl::start(&args.control, config, fleet.clone())
                    .await
                    .context("joining the control plane")?,
            )
        };
        println!(
            "kvfleet router: {}://{addr} ({} workers{})",
            args.tls.scheme(),
            args.workers.len(),
            if control.is_some() {
                ", more from membership"
            } else {
                ""
            }
        );
        std::io::stdout().flush()?;
        let drain = std::time::Duration::from_secs(args.routing.drain_timeout);
        serve_http_with_drain(listener, admission, tls, fleet, drain)
            .await
            .context("serving HTTP")?;
        if let Some(c) = control {
            c.shutdown();
        }
        Ok(())
    })
}
