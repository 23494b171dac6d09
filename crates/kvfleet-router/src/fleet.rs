//! The router's fleet: the parts a serving router is made of, each owning one concern
//! and its own state, assembled once and shared by every HTTP handler.
//!
//! | part | owns |
//! |---|---|
//! | [`Fleet::routing`] ([`RoutingState`]) | the routing core ([`kvfleet_routing::KvRouter`]) and the reservation clock |
//! | [`Fleet::workers`] ([`WorkerSupervision`]) | connections, circuit breakers, event following, load polls |
//! | [`Fleet::sessions`] ([`Sessions`]) | per-session memory and cache-break diagnostics |
//! | [`Fleet::decisions`] ([`Decisions`]) | the decision log and fork-group co-location |
//! | [`Fleet::tokens`] ([`TokenizerMemo`]) | the incremental tokenizer's conversation memo |
//! | [`Fleet::control`] ([`ControlLink`]) | control-plane hooks and component reachability |
//! | [`Fleet::pins`] ([`PinTable`]) | pinned prefixes (worker, expiry) and each tenant's pin budget |
//!
//! The parts do not reach into each other's locks: supervision feeds the routing core
//! through its methods, and no part hands out a lock guard.

use crate::circuit_breaker::BreakerConfig;
use crate::control_hooks::{ComponentStatus, ControlHooks, ControlLink};
use crate::decision_log::Decisions;
use crate::pin_table::PinTable;
use crate::prompt_model::PromptModel;
use crate::routing_state::RoutingState;
use crate::sessions::Sessions;
use crate::supervision::{SupervisionConfig, WorkerSupervision};
use crate::tokenizer_memo::TokenizerMemo;
use crate::worker_conn::{ConnTimeouts, WorkerConn};
use kvfleet_routing::{PolicyKind, RouterConfig};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Default bound of the tokenizer memo: 256 MiB.
pub const DEFAULT_TOKENIZER_MEMO_BYTES: usize = 256 << 20;
/// Default bound of the session memory: 256 MiB.
pub const DEFAULT_SESSION_MEMORY_BYTES: usize = 256 << 20;

/// How the router runs.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// The served model's tokenizer and chat template (the router never loads weights;
    /// the binary reads them from the model's files).
    pub prompt: PromptModel,
    /// Routing core settings (block size, reservation TTL, policy weights).
    pub router: RouterConfig,
    /// Policy when a request names none.
    pub default_policy: PolicyKind,
    /// How often each worker's load is polled.
    pub load_poll_interval: Duration,
    /// Acceptance deadline: how long to wait for a worker to acknowledge a request (or,
    /// from a worker that sends no acknowledgement, for its first token) before trying
    /// another one (the request was never accepted there, or the worker hangs).
    pub first_message_timeout: Duration,
    /// Queue deadline: how long an acknowledged request may wait for its first token.
    /// Past it the request is aborted and the client gets a 503; it is not retried
    /// elsewhere (that would prefill it twice) and the worker's breaker is not charged.
    pub queued_timeout: Duration,
    /// Stall deadline: the longest gap between two messages of a started stream; past
    /// it the client gets an error and the worker a failure on its breaker.
    pub stall_timeout: Duration,
    /// Connect and unary-call (Info, Load, CacheDump, Abort) deadlines.
    pub conn_timeouts: ConnTimeouts,
    /// Per-worker circuit breaker settings.
    pub breaker: BreakerConfig,
    /// Most workers tried for one request.
    pub max_attempts: usize,
    /// Bytes of rendered conversations and their ids remembered for incremental
    /// tokenization (least recently used forgotten first).
    pub tokenizer_memo_bytes: usize,
    /// Bytes of session memory (status fields, cache-break fingerprints; least
    /// recently seen session forgotten first).
    pub session_memory_bytes: usize,
    /// Most prompt ids kept per session for the diagnostics.
    pub session_max_tokens: usize,
    /// Most children of one `/v1/forks` request sent to one worker in one `Fork` call;
    /// more are split over further calls (routed like any request).
    pub fork_children_per_worker: usize,
    /// Follow each worker's `KvEvents` gRPC stream (true: the default). False when a
    /// control plane feeds the index from the event stream instead; supervisors then
    /// only poll load.
    pub follow_worker_events: bool,
    /// TLS to workers (CA to verify them by, and a client certificate for workers that
    /// require one); `None`: plaintext. With it, an endpoint without a scheme is
    /// reached as `https://`.
    pub worker_tls: Option<tonic::transport::ClientTlsConfig>,
    /// Bytes of KV blocks each tenant may keep pinned (Anthropic `cache_control` ttl);
    /// a pin past it is not asked for, and the response says so.
    pub pin_budget_bytes_per_tenant: u64,
    /// Most pinned blocks the router tracks, all tenants together.
    pub pin_table_blocks: usize,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            prompt: PromptModel::byte_level(),
            router: RouterConfig::default(),
            default_policy: PolicyKind::CacheAware,
            load_poll_interval: Duration::from_millis(100),
            first_message_timeout: Duration::from_secs(120),
            queued_timeout: Duration::from_secs(300),
            stall_timeout: Duration::from_secs(60),
            conn_timeouts: ConnTimeouts::default(),
            breaker: BreakerConfig::default(),
            max_attempts: 3,
            tokenizer_memo_bytes: DEFAULT_TOKENIZER_MEMO_BYTES,
            session_memory_bytes: DEFAULT_SESSION_MEMORY_BYTES,
            session_max_tokens: 256 * 1024,
            fork_children_per_worker: 32,
            follow_worker_events: true,
            worker_tls: None,
            pin_budget_bytes_per_tenant: crate::pin_table::DEFAULT_PIN_BUDGET_BYTES,
            pin_table_blocks: crate::pin_table::DEFAULT_PIN_TABLE_BLOCKS,
        }
    }
}

/// The router's fleet: shared by every HTTP handler.
pub struct Fleet {
    /// Settings.
    pub config: FleetConfig,
    /// Tokenizer and chat template.
    pub prompt: PromptModel,
    /// The routing core.
    pub routing: Arc<RoutingState>,
    /// The workers: connections, breakers, supervisor tasks.
    pub workers: Arc<WorkerSupervision>,
    /// Session memory.
    pub sessions: Sessions,
    /// Decision log and fork-group statistics.
    pub decisions: Decisions,
    /// The tokenizer memo.
    pub tokens: TokenizerMemo,
    /// The control-plane link.
    pub control: ControlLink,
    /// Pinned prefixes and pin budgets.
    pub pins: Arc<PinTable>,
    draining: AtomicBool,
}

impl Fleet {
    /// A fleet with no workers yet.
    pub fn new(config: FleetConfig) -> Result<Arc<Self>, String> {
        let prompt = config.prompt.clone();
        let routing = Arc::new(RoutingState::new(config.router.clone()));
        let supervision = SupervisionConfig {
            conn_timeouts: config.conn_timeouts,
            worker_tls: config.worker_tls.clone(),
            load_poll_interval: config.load_poll_interval,
            follow_worker_events: config.follow_worker_events,
            breaker: config.breaker,
        };
        Ok(Arc::new(Fleet {
            workers: Arc::new(WorkerSupervision::new(supervision, routing.clone())),
            routing,
            sessions: Sessions::new(config.session_memory_bytes, config.session_max_tokens),
            decisions: Decisions::new(),
            tokens: TokenizerMemo::new(config.tokenizer_memo_bytes),
            control: ControlLink::new(),
            pins: Arc::new(PinTable::new(
                config.pin_budget_bytes_per_tenant,
                config.pin_table_blocks,
            )),
            prompt,
            config,
            draining: AtomicBool::new(false),
        }))
    }

    /// Starts a graceful shutdown: `/health` answers 503 `draining` from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether a graceful shutdown has started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Milliseconds since the router started (the clock of reservations).
    pub fn now_ms(&self) -> u64 {
        self.routing.now_ms()
    }

    /// The served model id and context length, once a worker has reported them.
    pub fn model(&self) -> Option<(String, usize)> {
        self.workers.model()
    }

    /// Connects to a worker, checks it, indexes its cache and starts following it
    /// ([`WorkerSupervision::add_worker`]). Returns its id.
    pub async fn add_worker(&self, endpoint: &str) -> Result<String, String> {
        self.workers.add_worker(endpoint).await
    }

    /// Stops following a worker and drops it from routing.
    pub fn remove_worker(&self, id: &str) {
        self.workers.remove_worker(id);
    }

    /// The connection to a healthy worker.
    pub fn conn(&self, id: &str) -> Option<WorkerConn> {
        self.workers.conn(id)
    }

    /// Rebuilds worker `id`'s part of the index from its cache dump.
    pub async fn resync_worker(&self, id: &str) -> Result<u64, String> {
        self.workers.resync_worker(id).await
    }

    /// Installs a control plane's hooks (placement, usage records).
    pub fn set_control_hooks(&self, hooks: Arc<dyn ControlHooks>) {
        self.control.set_hooks(hooks);
    }

    /// Records whether control-plane `component` (`etcd`, `kafka`) is reachable.
    pub fn set_control_plane_up(&self, component: &'static str, up: bool) {
        self.control.set_up(component, up);
    }

    /// Every control-plane component reported so far.
    pub fn control_plane_status(&self) -> BTreeMap<&'static str, ComponentStatus> {
        self.control.status()
    }
}
