//! Arguments shared by the serving commands (`up`, `worker`, `router`).

use clap::Args;
use kvfleet_engine::Device;
use kvfleet_router::circuit_breaker::BreakerConfig;
use kvfleet_router::worker_conn::ConnTimeouts;
use kvfleet_router::{default_peer_pull_min_blocks, CacheAwareConfig, PullTrigger, TierCostConfig};
use kvfleet_router::{Fleet, FleetConfig, PolicyKind, RouterConfig};
use kvfleet_worker::{WorkerConfig, WorkerModel};
use std::sync::Arc;
use std::time::Duration;

/// Which model a worker (or `up`, or `generate`) serves, and under which id.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// `smollm2-135m` (the real default, from the model cache: scripts/fetch-model.sh),
    /// a `.gguf` file or a directory holding one, a Hugging Face directory (config.json,
    /// *.safetensors, tokenizer.json), or the seeded presets `tiny` / `small`.
    #[arg(long, default_value = kvfleet_engine::model_cache::DEFAULT_MODEL)]
    pub model: String,
    /// The model id clients name and responses report (default: the GGUF's file stem,
    /// the Hugging Face directory's name, or the preset's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
}

impl ModelArgs {
    /// Loads the model (weights, tokenizer, chat template) under its served id.
    pub fn load(&self) -> anyhow::Result<kvfleet_engine::LoadedModel> {
        use anyhow::Context;
        let mut model = kvfleet_engine::load_model(&self.model)
            .with_context(|| format!("loading the model `{}`", self.model))?;
        if let Some(name) = &self.served_model_name {
            anyhow::ensure!(
                !name.trim().is_empty(),
                "--served-model-name must not be empty"
            );
            model.id = name.clone();
        }
        Ok(model)
    }
}

/// What a serving command's workers serve, and the prompt side its router takes.
#[derive(Clone)]
pub struct ServedModel {
    /// The id clients name and responses report.
    pub id: String,
    /// What each worker runs.
    pub worker: WorkerModel,
    /// Tokenizer and chat template, for an in-process router.
    pub prompt: kvfleet_router::prompt_model::PromptModel,
}

impl ModelArgs {
    /// The model under `engine`: its weights loaded (`--engine model`), or the preset
    /// the simulated engine stands in for with its cost model (`--engine sim`).
    pub fn served(&self, engine: &EngineArgs) -> anyhow::Result<ServedModel> {
        use anyhow::Context;
        let cost = engine.cost_model()?;
        let Some(cost) = cost else {
            let model = self.load()?;
            return Ok(ServedModel {
                id: model.id.clone(),
                prompt: prompt_model_of(&model),
                worker: WorkerModel::Loaded(model),
            });
        };
        let mut sim = kvfleet_engine::load_sim_model(&self.model, cost)
            .with_context(|| format!("--engine sim with --model {}", self.model))?;
        if let Some(name) = &self.served_model_name {
            anyhow::ensure!(
                !name.trim().is_empty(),
                "--served-model-name must not be empty"
            );
            sim.prompt.id = name.clone();
        }
        Ok(ServedModel {
            id: sim.prompt.id.clone(),
            prompt: kvfleet_router::prompt_model::PromptModel {
                tokenizer: sim.prompt.tokenizer.clone(),
                chat_template: sim.prompt.chat_template.clone(),
            },
            worker: WorkerModel::Simulated(Box::new(sim)),
        })
    }
}

/// The prompt side (tokenizer, chat template) of a loaded model, as the router takes it.
pub fn prompt_model_of(
    model: &kvfleet_engine::LoadedModel,
) -> kvfleet_router::prompt_model::PromptModel {
    kvfleet_router::prompt_model::PromptModel {
        tokenizer: model.tokenizer.clone(),
        chat_template: model.chat_template.clone(),
    }
}
/// KV blocks of a worker without `--num-blocks` on the CPU.
const CPU_DEFAULT_BLOCKS: usize = 2048;

/// What computes a worker's engine steps.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineKind {
    /// The model itself, on --device.
    #[default]
    Model,
    /// No compute: each step sleeps as long as --cost-model says (load tests).
    Sim,
}

/// Engine sizing of a worker.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// What computes each step: `model` runs the model on --device; `sim` runs the
    /// real scheduler, block pool, prefix cache and KV events but no model: each
    /// step sleeps as long as --cost-model prices it (the seeded presets only, e.g.
    /// --model tiny; no KV tiers or peer pulls), so many workers fit on one machine.
    #[arg(long, value_enum, default_value_t = EngineKind::Model)]
    pub engine: EngineKind,
    /// With --engine sim: the cost model, a JSON file like
    /// crates/kvfleet-bench/cost-models/h200-llama8b.json (default: that built-in
    /// H200 estimate).
    #[arg(long)]
    pub cost_model: Option<std::path::PathBuf>,
    /// Compute device of each worker: cpu or cuda:N (CUDA needs the NVIDIA driver,
    /// NVRTC and cuBLAS 13; a missing one is reported at start).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// KV blocks per worker. Unset: 2048 on the CPU, and on cuda:N as many as
    /// --gpu-memory-utilization leaves room for. Set, it is used on either.
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// On cuda:N without --num-blocks: the fraction of the device's total memory the
    /// worker may hold (weights, step workspace and KV cache, as in vLLM); the KV pool
    /// gets what is left once the weights are loaded. The workers of one `kvfleet up`
    /// share the fraction.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
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
    /// The share of a request's remaining max_tokens a worker expects it to generate
    /// when it decides whether a waiting request fits beside the running ones (as
    /// SGLang's new_token_ratio: it relaxes to --decode-reserve-min-ratio while nothing
    /// is preempted, and a preemption raises it again). 0 admits on prompt room alone,
    /// which under memory pressure makes running requests preempt each other.
    #[arg(long, default_value_t = kvfleet_engine::DecodeReserveConfig::default().init_ratio)]
    pub decode_reserve_ratio: f64,
    /// The least --decode-reserve-ratio relaxes to.
    #[arg(long, default_value_t = kvfleet_engine::DecodeReserveConfig::default().min_ratio)]
    pub decode_reserve_min_ratio: f64,
    /// Host memory (GiB) per worker for KV blocks evicted from the pool: they are
    /// demoted there and promoted back on a prefix hit instead of being recomputed.
    /// 0 turns the tiers off.
    #[arg(long, default_value_t = 0.0)]
    pub host_cache_gib: f64,
    /// Directory for a disk tier below the host tier (each worker uses its own
    /// subdirectory, emptied at start). Needs --host-cache-gib.
    #[arg(long)]
    pub disk_cache_dir: Option<std::path::PathBuf>,
    /// Most GiB of block files per worker in --disk-cache-dir.
    #[arg(long, default_value_t = 16.0)]
    pub disk_cache_gib: f64,
    /// The share (0 to 1) of each worker's KV pool that pinned prefixes (Anthropic
    /// `cache_control` with a ttl) may hold; a pin past it is refused, its request
    /// served unpinned. The rest of the pool always stays for running requests.
    #[arg(long, default_value_t = kvfleet_engine::DEFAULT_PIN_POOL_FRACTION)]
    pub pin_pool_fraction: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

impl EngineArgs {
    /// The simulated engine's cost model (`None` for the real engine).
    pub fn cost_model(&self) -> anyhow::Result<Option<kvfleet_core::CostModel>> {
        match (self.engine, &self.cost_model) {
            (EngineKind::Model, None) => Ok(None),
            (EngineKind::Model, Some(_)) => {
                anyhow::bail!("--cost-model prices the simulated engine: add --engine sim")
            }
            (EngineKind::Sim, None) => Ok(Some(kvfleet_core::CostModel::h200_llama8b())),
            (EngineKind::Sim, Some(path)) => Ok(Some(kvfleet_core::CostModel::read_path(path)?)),
        }
    }

    /// A worker configuration with these sizes.
    pub fn worker_config(&self, worker_id: String, model: WorkerModel) -> WorkerConfig {
        let mut c = WorkerConfig::new(worker_id, model);
        c.device = self.device;
        c.num_blocks = self.num_blocks.unwrap_or(CPU_DEFAULT_BLOCKS);
        c.gpu_memory_utilization = self
            .num_blocks
            .is_none()
            .then_some(self.gpu_memory_utilization);
        c.block_size = self.block_size;
        c.max_num_seqs = self.max_num_seqs;
        c.max_batched_tokens = self.max_batched_tokens;
        c.max_prefill_chunk = self.max_prefill_chunk;
        c.decode_reserve = kvfleet_engine::DecodeReserveConfig {
            init_ratio: self.decode_reserve_ratio,
            min_ratio: self.decode_reserve_min_ratio,
            ..Default::default()
        };
        c.pin_pool_fraction = self.pin_pool_fraction;
        c.kv_tiers = kvfleet_engine::TierConfig {
            host_bytes: (self.host_cache_gib.max(0.0) * GIB) as usize,
            disk: self
                .disk_cache_dir
                .as_ref()
                .map(|dir| kvfleet_engine::DiskTierConfig {
                    dir: dir.join(&c.worker_id),
                    max_bytes: (self.disk_cache_gib.max(0.0) * GIB) as u64,
                }),
        };
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
    /// Acceptance deadline (ms): a worker that neither acknowledges a request nor sends
    /// its first token this long counts a failure on its breaker and the request is
    /// retried elsewhere.
    #[arg(long, default_value_t = 120_000)]
    pub first_token_timeout_ms: u64,
    /// Queue deadline (ms): how long a request a worker acknowledged may wait there for
    /// its first token; past it the client gets a 503 (no retry, no breaker failure).
    #[arg(long, default_value_t = 300_000)]
    pub queued_timeout_ms: u64,
    /// Stall deadline (ms): the longest gap between two messages of a started stream;
    /// past it the client gets an error event and the worker a breaker failure.
    #[arg(long, default_value_t = 60_000)]
    pub stall_timeout_ms: u64,
    /// Connect deadline (ms) of router→worker connections.
    #[arg(long, default_value_t = 2_000)]
    pub connect_timeout_ms: u64,
    /// Deadline (ms) of unary worker calls: Info, Load, CacheDump, Abort.
    #[arg(long, default_value_t = 10_000)]
    pub rpc_timeout_ms: u64,
    /// How often (ms) each worker's load is polled. Between polls the router counts
    /// its own requests, and the loads workers push with their KV events tell it when
    /// work has ended; a large fleet can poll less often.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub load_poll_interval_ms: u64,
    /// Consecutive failures (errors, missed deadlines) that open a worker's circuit
    /// breaker, taking it out of routing.
    #[arg(long, default_value_t = 3)]
    pub breaker_failures: u32,
    /// How long (ms) an open breaker keeps its worker out before one probe request.
    #[arg(long, default_value_t = 5_000)]
    pub breaker_cooldown_ms: u64,
    /// Bytes of session memory (turn counts, cache-break fingerprints); past it the
    /// least recently seen session is forgotten.
    #[arg(long, default_value_t = kvfleet_router::fleet::DEFAULT_SESSION_MEMORY_BYTES)]
    pub session_memory_bytes: usize,
    /// Bytes of the tokenizer memo (rendered conversations and their ids, so a new
    /// turn tokenizes only its tail); past it the least recently used goes.
    #[arg(long, default_value_t = kvfleet_router::fleet::DEFAULT_TOKENIZER_MEMO_BYTES)]
    pub tokenizer_memo_bytes: usize,
    /// Let the chosen worker pull a prompt's prefix blocks from the worker that holds
    /// them (gRPC FetchBlocks) when that one holds at least this many more blocks;
    /// `cache-aware` moves a request to pull only to end a wait longer than a cold
    /// start (`--peer-pull-trigger`). Default: 16 tokens' worth (one block of 16
    /// tokens). 0 recomputes instead; use it where workers cannot reach each other's
    /// gRPC port. Workers of the simulated engine never pull.
    #[arg(long)]
    pub peer_pull_min_blocks: Option<usize>,
    /// When `cache-aware` moves a request to pull its prefix elsewhere: `idle-wait`
    /// (default) only to end a wait longer than a cold start on an idle worker;
    /// `cost` whenever pricing the pull makes another worker cheapest.
    #[arg(long, default_value = "idle-wait", value_parser = parse_pull_trigger)]
    pub peer_pull_trigger: PullTrigger,
    /// `cache-aware`'s weights as a JSON object, inline or in a file: fields of
    /// `CacheAwareConfig` (crates/kvfleet-routing/src/policy/cache_aware.rs), e.g.
    /// `'{"idle_prefill_weight": 1.2}'`; a field left out keeps its default. Tier
    /// pricing and the pull trigger have their own flags.
    #[arg(long, value_parser = crate::cache_aware_args::parse_cache_aware_config)]
    pub cache_aware_config: Option<crate::cache_aware_args::CacheAwareOverrides>,
    /// Worker-to-worker bandwidth (GB/s) that prices a pulled block's transfer.
    #[arg(long, default_value_t = 12.5, value_parser = positive_f64)]
    pub peer_bandwidth_gbs: f64,
    /// Host-tier → device bandwidth (GB/s) that prices a host-tier hit's load.
    #[arg(long, default_value_t = 50.0, value_parser = positive_f64)]
    pub host_bandwidth_gbs: f64,
    /// Disk-tier → device bandwidth (GB/s) that prices a disk-tier hit's load.
    #[arg(long, default_value_t = 5.0, value_parser = positive_f64)]
    pub disk_bandwidth_gbs: f64,
    /// One worker's prefill throughput (tokens/s), against which tier loads and
    /// pulls are priced.
    #[arg(long, default_value_t = 8_000.0, value_parser = positive_f64)]
    pub prefill_tokens_per_s: f64,
    /// One worker's fixed cost per prefill (ms), on top of its tokens: the pull
    /// trigger counts it for every prefill queued ahead of a request.
    #[arg(long, default_value_t = 20.0, value_parser = non_negative_f64)]
    pub prefill_overhead_ms: f64,
    /// Bytes of KV blocks each tenant may keep pinned (Anthropic `cache_control`
    /// breakpoints pin their prefix for the `ttl`): a pin past it is served unpinned
    /// and the response says so (`x-kvfleet-pin: refused; reason=over-budget`). A
    /// block counts once however often it is pinned; 0 turns pins off.
    #[arg(long, default_value_t = kvfleet_router::pin_table::DEFAULT_PIN_BUDGET_BYTES)]
    pub pin_budget_bytes_per_tenant: u64,
    /// On SIGTERM, how long (s) streams in flight may take to finish before exit.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout: u64,
}

/// Parses `--peer-pull-trigger`.
pub fn parse_pull_trigger(s: &str) -> Result<PullTrigger, String> {
    match s {
        "idle-wait" => Ok(PullTrigger::IdleWait),
        "cost" => Ok(PullTrigger::Cost),
        _ => Err(format!("{s:?} is not a pull trigger (idle-wait or cost)")),
    }
}

/// Parses a finite number that `ok` accepts; otherwise says it is not `what`.
fn finite_f64(s: &str, ok: fn(f64) -> bool, what: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && ok(v) => Ok(v),
        _ => Err(format!("{s:?} is not {what}")),
    }
}

/// Parses a duration flag: a finite number of at least zero.
fn non_negative_f64(s: &str) -> Result<f64, String> {
    finite_f64(s, |v| v >= 0.0, "a number of at least 0")
}

/// Parses a rate flag: a finite number above zero.
fn positive_f64(s: &str) -> Result<f64, String> {
    finite_f64(s, |v| v > 0.0, "a positive number")
}

impl RoutingArgs {
    /// The fleet configuration for a model's prompt side and `block_size`.
    pub fn fleet_config(
        &self,
        prompt: kvfleet_router::prompt_model::PromptModel,
        block_size: usize,
    ) -> anyhow::Result<FleetConfig> {
        Ok(FleetConfig {
            prompt,
            router: RouterConfig {
                block_size,
                cache_aware: self.cache_aware(block_size)?,
                ..RouterConfig::default()
            },
            default_policy: self.policy,
            first_message_timeout: Duration::from_millis(self.first_token_timeout_ms.max(1)),
            queued_timeout: Duration::from_millis(self.queued_timeout_ms.max(1)),
            stall_timeout: Duration::from_millis(self.stall_timeout_ms.max(1)),
            conn_timeouts: ConnTimeouts {
                connect: Duration::from_millis(self.connect_timeout_ms.max(1)),
                unary: Duration::from_millis(self.rpc_timeout_ms.max(1)),
            },
            breaker: BreakerConfig {
                failure_threshold: self.breaker_failures.max(1),
                cooldown: Duration::from_millis(self.breaker_cooldown_ms),
            },
            load_poll_interval: Duration::from_millis(self.load_poll_interval_ms),
            session_memory_bytes: self.session_memory_bytes,
            tokenizer_memo_bytes: self.tokenizer_memo_bytes,
            pin_budget_bytes_per_tenant: self.pin_budget_bytes_per_tenant,
            ..FleetConfig::default()
        })
    }

    /// `cache-aware`'s configuration: tier pricing and the pull trigger from their
    /// flags, the weights from `--cache-aware-config` over the defaults.
    pub fn cache_aware(&self, block_size: usize) -> anyhow::Result<CacheAwareConfig> {
        let base = CacheAwareConfig {
            tiers: TierCostConfig {
                peer_pull_min_blocks: self
                    .peer_pull_min_blocks
                    .unwrap_or_else(|| default_peer_pull_min_blocks(block_size)),
                peer_bytes_per_s: self.peer_bandwidth_gbs * 1e9,
                host_bytes_per_s: self.host_bandwidth_gbs * 1e9,
                disk_bytes_per_s: self.disk_bandwidth_gbs * 1e9,
                prefill_tokens_per_s: self.prefill_tokens_per_s,
                prefill_overhead_ms: self.prefill_overhead_ms,
                ..TierCostConfig::default()
            },
            pull_trigger: self.peer_pull_trigger,
            ..CacheAwareConfig::default()
        };
        let config =
            crate::cache_aware_args::with_overrides(base, self.cache_aware_config.as_ref())?;
        if self.cache_aware_config.is_some() {
            tracing::info!(?config, "cache-aware weights set by --cache-aware-config");
        }
        Ok(config)
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

/// Resolves `drain` after the shutdown signal is reported on `signalled` (never, if
/// it is not): the end of the grace period a draining process gives work in flight.
pub async fn drain_deadline(signalled: tokio::sync::oneshot::Receiver<()>, drain: Duration) {
    if signalled.await.is_ok() {
        tokio::time::sleep(drain).await;
    } else {
        std::future::pending::<()>().await;
    }
}

/// Serves the router's HTTP API (behind `admission`) on `listener` until Ctrl-C /
/// SIGTERM, then drains: `/health` turns 503 `draining`, the listener stops accepting,
/// and streams in flight get up to `drain_timeout` to finish. Returns once they have
/// (or the time is up).
pub async fn serve_http_with_drain(
    listener: tokio::net::TcpListener,
    admission: Arc<kvfleet_router::admission::Admission>,
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    fleet: Arc<Fleet>,
    drain_timeout: Duration,
) -> anyhow::Result<()> {
    let app = kvfleet_router::http_front::app_with(fleet.clone(), admission);
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        shutdown_signal().await;
        fleet.start_draining();
        tracing::info!(
            ?drain_timeout,
            "draining: no new connections, streams in flight finish"
        );
        let _ = signalled_tx.send(());
    };
    let serve = crate::http_serve::serve_http(listener, app, tls, shutdown);
    let started = std::time::Instant::now();
    let deadline = drain_deadline(signalled_rx, drain_timeout);
    tokio::select! {
        r = serve => {
            r?;
            tracing::info!(secs = started.elapsed().as_secs_f64(), "drained");
        }
        _ = deadline => tracing::warn!("drain timeout: exiting with streams still open"),
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The routing flags alone, as `kvfleet router` and `kvfleet up` flatten them.
    #[derive(Parser)]
    struct Routing {
        #[command(flatten)]
        routing: RoutingArgs,
    }

    fn cache_aware(args: &[&str]) -> CacheAwareConfig {
        let parsed =
            Routing::try_parse_from(std::iter::once("kvfleet").chain(args.iter().copied()))
                .expect("flags parse");
        parsed.routing.cache_aware(16).expect("config")
    }

    #[test]
    fn cache_aware_config_sets_the_weights_and_the_other_flags_keep_theirs() {
        let c = cache_aware(&[
            "--cache-aware-config",
            r#"{"idle_prefill_weight": 1.2, "wait_ending_ratio": 0.5}"#,
            "--peer-pull-min-blocks",
            "3",
            "--peer-pull-trigger",
            "cost",
            "--prefill-overhead-ms",
            "45",
        ]);
        assert_eq!((c.idle_prefill_weight, c.wait_ending_ratio), (1.2, 0.5));
        assert_eq!(c.tiers.prefill_overhead_ms, 45.0);
        assert_eq!(c.tiers.peer_pull_min_blocks, 3);
        assert_eq!(c.pull_trigger, PullTrigger::Cost);
        let defaults = cache_aware(&[]);
        assert_eq!(
            defaults.idle_prefill_weight,
            CacheAwareConfig::default().idle_prefill_weight
        );
        assert_eq!(
            defaults.tiers.peer_pull_min_blocks,
            default_peer_pull_min_blocks(16)
        );
        assert_eq!(defaults.tiers.prefill_overhead_ms, 20.0);
        assert!(Routing::try_parse_from(["kvfleet", "--prefill-overhead-ms", "-1"]).is_err());
        let refused = Routing::try_parse_from([
            "kvfleet",
            "--cache-aware-config",
            r#"{"decode_cost_per_sequence": -16}"#,
        ]);
        let e = refused
            .err()
            .expect("a negative weight is refused")
            .to_string();
        assert!(e.contains("decode_cost_per_sequence"), "{e}");
    }
}
