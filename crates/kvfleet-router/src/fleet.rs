//! The router's live view of its fleet: connections to workers, the pure [`KvRouter`]
//! kept current by each worker's KV events and load reports, and the per-request
//! bookkeeping around it.
//!
//! One supervisor task per worker connects, rebuilds the worker's part of the index
//! from a `CacheDump`, then follows its `KvEvents` stream and polls `Load`. Any gap in
//! event sequence numbers triggers another dump; a lost worker is dropped from the
//! index (so nothing is routed to it) until it answers again.

use crate::circuit_breaker::{BreakerConfig, CircuitBreaker, CircuitState};
use crate::control_hooks::ControlHooks;
use crate::decision_log::{DecisionLog, NewDecision};
use crate::events::{RouterKvEvent, RouterKvEventKind};
use crate::fleet_metrics as m;
use crate::incremental_tokenizer::IncrementalTokenizer;
use crate::kv_router::{KvRouter, RouterConfig};
use crate::load::WorkerLoad;
use crate::policy::PolicyKind;
use crate::prefix_index::IndexError;
use crate::prompt_model::PromptModel;
use crate::sessions::SessionStore;
use crate::worker_conn::{ConnError, ConnTimeouts, WorkerConn};
use futures::StreamExt;
use kvfleet_core::BlockHash;
use kvfleet_proto::v1 as pb;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

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
    /// First-token deadline: how long to wait for a request's first message from a
    /// worker before trying another one (the request has not started there, or the
    /// worker hangs).
    pub first_message_timeout: Duration,
    /// Stall deadline: the longest gap between two messages of a started stream; past
    /// it the client gets an error and the worker a failure on its breaker.
    pub stall_timeout: Duration,
    /// Connect and unary-call (Info, Load, CacheDump, Abort) deadlines.
    pub conn_timeouts: ConnTimeouts,
    /// Per-worker circuit breaker settings.
    pub breaker: BreakerConfig,
    /// Most workers tried for one request.
    pub max_attempts: usize,
    /// Conversations remembered for incremental tokenization.
    pub tokenizer_cache_entries: usize,
    /// Sessions remembered for status fields and cache-break diagnostics.
    pub session_capacity: usize,
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
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            prompt: PromptModel::byte_level(),
            router: RouterConfig::default(),
            default_policy: PolicyKind::CacheAware,
            load_poll_interval: Duration::from_millis(100),
            first_message_timeout: Duration::from_secs(120),
            stall_timeout: Duration::from_secs(60),
            conn_timeouts: ConnTimeouts::default(),
            breaker: BreakerConfig::default(),
            max_attempts: 3,
            tokenizer_cache_entries: 4096,
            session_capacity: 4096,
            session_max_tokens: 256 * 1024,
            fork_children_per_worker: 32,
            follow_worker_events: true,
            worker_tls: None,
        }
    }
}

/// A worker as the fleet tracks it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct WorkerStatus {
    /// Worker id.
    pub id: String,
    /// gRPC endpoint.
    pub endpoint: String,
    /// Whether it is in the routing index now.
    pub healthy: bool,
    /// Last load report.
    pub load: Option<LoadReport>,
    /// Its circuit breaker's state.
    pub circuit: CircuitState,
}

/// A worker's last `Load` answer.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LoadReport {
    /// Running sequences.
    pub running: u32,
    /// Queued sequences.
    pub waiting: u32,
    /// Free blocks.
    pub free_blocks: u32,
    /// Cached blocks.
    pub cached_blocks: u32,
    /// All blocks.
    pub total_blocks: u32,
    /// Prompt tokens not computed yet.
    pub queued_prefill_tokens: u64,
    /// Prompt tokens received since start.
    pub prompt_tokens: u64,
    /// Prompt tokens actually computed since start.
    pub prompt_tokens_computed: u64,
    /// Prompt tokens served from cache since start.
    pub cached_tokens: u64,
    /// Tokens generated since start.
    pub generated_tokens: u64,
    /// Preemptions since start.
    pub preemptions: u64,
}

struct WorkerSlot {
    conn: Option<WorkerConn>,
    endpoint: String,
    healthy: bool,
    load: Option<LoadReport>,
    task: Option<JoinHandle<()>>,
}

pub use crate::decision_log::DecisionRecord;

/// The router's fleet: shared by every HTTP handler.
pub struct Fleet {
    /// Settings.
    pub config: FleetConfig,
    /// Tokenizer and chat template.
    pub prompt: PromptModel,
    kv: Mutex<KvRouter>,
    workers: RwLock<BTreeMap<String, WorkerSlot>>,
    model: RwLock<Option<(String, usize)>>,
    tokenize_cache: Mutex<IncrementalTokenizer>,
    sessions: Mutex<SessionStore>,
    fork_groups: Mutex<ForkGroups>,
    decisions: Mutex<DecisionLog>,
    started: Instant,
    hooks: RwLock<Option<Arc<dyn ControlHooks>>>,
    breakers: Mutex<HashMap<String, CircuitBreaker>>,
    draining: AtomicBool,
    control_plane: Mutex<BTreeMap<&'static str, ComponentStatus>>,
}

/// Whether a control-plane component (etcd, Kafka) is reachable, and since when.
#[derive(Clone, Copy, Debug)]
pub struct ComponentStatus {
    /// Reachable at the last attempt.
    pub up: bool,
    /// When it last changed.
    pub since: Instant,
}

#[derive(Default)]
struct ForkGroups {
    first_worker: HashMap<String, String>,
    order: VecDeque<String>,
    colocated: u64,
    total: u64,
}

const FORK_GROUPS_KEPT: usize = 65_536;

/// Locks a mutex, recovering the data if a panicking thread poisoned it: every
/// structure here stays consistent between calls.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Fleet {
    /// A fleet with no workers yet.
    pub fn new(config: FleetConfig) -> Result<Arc<Self>, String> {
        let prompt = config.prompt.clone();
        let cache = IncrementalTokenizer::new(config.tokenizer_cache_entries);
        let sessions = SessionStore::new(config.session_capacity, config.session_max_tokens);
        Ok(Arc::new(Fleet {
            kv: Mutex::new(KvRouter::new(config.router.clone())),
            prompt,
            config,
            workers: RwLock::new(BTreeMap::new()),
            model: RwLock::new(None),
            tokenize_cache: Mutex::new(cache),
            sessions: Mutex::new(sessions),
            fork_groups: Mutex::new(ForkGroups::default()),
            decisions: Mutex::new(DecisionLog::new()),
            started: Instant::now(),
            hooks: RwLock::new(None),
            breakers: Mutex::new(HashMap::new()),
            draining: AtomicBool::new(false),
            control_plane: Mutex::new(BTreeMap::new()),
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

    /// Records whether control-plane `component` (`etcd`, `kafka`) is reachable; sets
    /// `kvfleet_control_plane_up{component}`.
    pub fn set_control_plane_up(&self, component: &'static str, up: bool) {
        let mut cp = lock(&self.control_plane);
        let changed = cp.get(component).is_none_or(|s| s.up != up);
        if changed {
            cp.insert(
                component,
                ComponentStatus {
                    up,
                    since: Instant::now(),
                },
            );
            if up {
                tracing::info!(component, "control plane reachable");
            } else {
                tracing::warn!(
                    component,
                    "control plane unreachable: serving on what is known"
                );
            }
        }
        m::control_plane_up(component, up);
    }

    /// Every control-plane component reported so far.
    pub fn control_plane_status(&self) -> BTreeMap<&'static str, ComponentStatus> {
        lock(&self.control_plane).clone()
    }

    /// Whether worker `id` may be routed to now by its breaker (moving an open
    /// breaker whose cool-down passed to half-open).
    fn refresh_breaker(&self, id: &str, b: &mut CircuitBreaker, now: Instant) {
        if let Some(t) = b.poll(now) {
            self.breaker_transition(id, t);
        }
        self.kv().set_fenced(id, !b.routable(now));
    }

    /// Moves every open breaker whose cool-down has passed to half-open (and lets
    /// its worker back into routing for one probe). Called before each routing.
    pub fn refresh_breakers(&self) {
        let now = Instant::now();
        let mut br = lock(&self.breakers);
        for (id, b) in br.iter_mut() {
            if b.state() != CircuitState::Closed {
                self.refresh_breaker(id, b, now);
            }
        }
    }

    /// A request was sent to worker `id` (in half-open: the probe; no other request
    /// goes there until it is answered).
    pub fn breaker_request_started(&self, id: &str) {
        let now = Instant::now();
        let mut br = lock(&self.breakers);
        if let Some(b) = br.get_mut(id) {
            if b.state() == CircuitState::HalfOpen {
                b.request_started(now);
                self.refresh_breaker(id, b, now);
            }
        }
    }

    /// Worker `id` answered a request.
    pub fn breaker_success(&self, id: &str) {
        let mut br = lock(&self.breakers);
        if let Some(b) = br.get_mut(id) {
            if let Some(t) = b.on_success() {
                self.breaker_transition(id, t);
            }
            self.kv().set_fenced(id, false);
        }
    }

    /// Worker `id` failed a request or missed a deadline.
    pub fn breaker_failure(&self, id: &str) {
        let now = Instant::now();
        let mut br = lock(&self.breakers);
        let b = br
            .entry(id.to_string())
            .or_insert_with(|| CircuitBreaker::new(self.config.breaker));
        if let Some(t) = b.on_failure(now) {
            self.breaker_transition(id, t);
        }
        self.kv().set_fenced(id, !b.routable(now));
    }

    /// Worker `id`'s breaker state.
    pub fn circuit_state(&self, id: &str) -> CircuitState {
        lock(&self.breakers)
            .get(id)
            .map_or(CircuitState::Closed, CircuitBreaker::state)
    }

    fn breaker_transition(&self, id: &str, (from, to): (CircuitState, CircuitState)) {
        tracing::warn!(
            worker = id,
            from = from.as_str(),
            to = to.as_str(),
            "circuit breaker"
        );
        m::circuit(id, from, to);
    }

    /// Installs a control plane's hooks (placement, usage records).
    pub fn set_control_hooks(&self, hooks: Arc<dyn ControlHooks>) {
        if let Ok(mut h) = self.hooks.write() {
            *h = Some(hooks);
        }
    }

    /// The installed control-plane hooks.
    pub fn control_hooks(&self) -> Option<Arc<dyn ControlHooks>> {
        self.hooks.read().ok().and_then(|h| h.clone())
    }

    /// Rebuilds worker `id`'s part of the index from its cache dump (after an event
    /// gap seen by an external event consumer); returns the dump's seq.
    pub async fn resync_worker(&self, id: &str) -> Result<u64, String> {
        let conn = self
            .conn_for(id)
            .ok_or_else(|| format!("worker {id} is not connected"))?;
        self.resync(&conn).await.map_err(|e| e.to_string())
    }

    /// Milliseconds since the router started (the clock of reservations).
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The routing core (locked).
    pub fn kv(&self) -> MutexGuard<'_, KvRouter> {
        lock(&self.kv)
    }

    /// The incremental tokenizer (locked).
    pub fn tokenize_cache(&self) -> MutexGuard<'_, IncrementalTokenizer> {
        lock(&self.tokenize_cache)
    }

    /// The session memory (locked).
    pub fn sessions(&self) -> MutexGuard<'_, SessionStore> {
        lock(&self.sessions)
    }

    /// The served model id and context length, once a worker has reported them.
    pub fn model(&self) -> Option<(String, usize)> {
        self.model.read().ok().and_then(|m| m.clone())
    }

    /// Connects to a worker, checks that it serves this fleet's model and block size,
    /// indexes its cache and starts following it. Returns its id.
    pub async fn add_worker(self: &Arc<Self>, endpoint: &str) -> Result<String, String> {
        let conn = self.connect_and_register(endpoint).await?;
        let id = conn.id().to_string();
        {
            let mut workers = self
                .workers
                .write()
                .map_err(|_| "worker table poisoned".to_string())?;
            if let Some(old) = workers.insert(
                id.clone(),
                WorkerSlot {
                    conn: Some(conn),
                    endpoint: endpoint.to_string(),
                    healthy: true,
                    load: None,
                    task: None,
                },
            ) {
                if let Some(t) = old.task {
                    t.abort();
                }
            }
        }
        // The slot exists before its supervisor starts, so the supervisor finds it.
        let fleet = self.clone();
        let (wid, ep) = (id.clone(), endpoint.to_string());
        let task = tokio::spawn(async move { fleet.supervise(wid, ep).await });
        if let Ok(mut workers) = self.workers.write() {
            if let Some(slot) = workers.get_mut(&id) {
                slot.task = Some(task);
            }
        }
        Ok(id)
    }

    /// Stops following a worker and drops it from routing.
    pub fn remove_worker(&self, id: &str) {
        if let Ok(mut w) = self.workers.write() {
            if let Some(slot) = w.remove(id) {
                if let Some(t) = slot.task {
                    t.abort();
                }
            }
        }
        self.kv().remove_worker(id);
    }

    /// The connection to a healthy worker.
    pub fn conn(&self, id: &str) -> Option<WorkerConn> {
        let w = self.workers.read().ok()?;
        w.get(id).filter(|s| s.healthy).and_then(|s| s.conn.clone())
    }

    /// Every worker's status.
    pub fn worker_statuses(&self) -> Vec<WorkerStatus> {
        let Ok(w) = self.workers.read() else {
            return Vec::new();
        };
        w.iter()
            .map(|(id, s)| WorkerStatus {
                id: id.clone(),
                endpoint: s.endpoint.clone(),
                healthy: s.healthy,
                load: s.load.clone(),
                circuit: self.circuit_state(id),
            })
            .collect()
    }

    /// Number of healthy workers.
    pub fn healthy_workers(&self) -> usize {
        self.workers
            .read()
            .map(|w| w.values().filter(|s| s.healthy).count())
            .unwrap_or(0)
    }

    /// Marks a worker failed after a request could not reach it: it leaves the index
    /// until its supervisor reconnects.
    pub fn worker_failed(&self, id: &str) {
        if let Ok(mut w) = self.workers.write() {
            if let Some(s) = w.get_mut(id) {
                s.healthy = false;
            }
        }
        self.kv().remove_worker(id);
    }

    /// Records a routing decision for the dashboard and fork-group co-location;
    /// returns its number in the decision log, for [`Self::decision_outcome`].
    pub fn record_decision(&self, rec: NewDecision, hashes: &[BlockHash]) -> u64 {
        if let Some(group) = &rec.fork_group {
            let mut fg = lock(&self.fork_groups);
            let first = match fg.first_worker.get(group) {
                Some(w) => w.clone(),
                None => {
                    fg.first_worker.insert(group.clone(), rec.worker.clone());
                    fg.order.push_back(group.clone());
                    if fg.order.len() > FORK_GROUPS_KEPT {
                        if let Some(old) = fg.order.pop_front() {
                            fg.first_worker.remove(&old);
                        }
                    }
                    rec.worker.clone()
                }
            };
            let colocated = first == rec.worker;
            fg.total += 1;
            if colocated {
                fg.colocated += 1;
            }
            m::fork_group(colocated, fg.colocated as f64 / fg.total as f64);
        }
        lock(&self.decisions).record(rec, hashes)
    }

    /// Fills in a logged decision's cached tokens and, when given, its outcome.
    pub fn decision_outcome(
        &self,
        seq: u64,
        actual_cached_tokens: Option<usize>,
        outcome: Option<&'static str>,
    ) {
        let now = unix_ms();
        lock(&self.decisions).complete(seq, actual_cached_tokens, outcome, now);
    }

    /// The most recent routing decisions, oldest first.
    pub fn recent_decisions(&self) -> Vec<DecisionRecord> {
        lock(&self.decisions).decisions()
    }

    /// The decision log (locked), for the dashboard's snapshot.
    pub fn decision_log(&self) -> MutexGuard<'_, DecisionLog> {
        lock(&self.decisions)
    }

    /// Fork-group requests served by their group's first worker / all of them.
    pub fn fork_colocation(&self) -> (u64, u64) {
        let fg = lock(&self.fork_groups);
        (fg.colocated, fg.total)
    }

    fn check_model(&self, conn: &WorkerConn) -> Result<(), String> {
        let info = &conn.info;
        let bs = self.config.router.block_size;
        if info.block_size as usize != bs {
            return Err(format!(
                "worker {} uses KV block size {}, this router uses {bs}: a router never mixes block sizes",
                info.worker_id, info.block_size
            ));
        }
        let mut model = self
            .model
            .write()
            .map_err(|_| "model lock poisoned".to_string())?;
        match &*model {
            Some((id, _)) if *id != info.model_id => Err(format!(
                "worker {} serves model {:?}, this fleet serves {id:?}",
                info.worker_id, info.model_id
            )),
            Some(_) => Ok(()),
            None => {
                *model = Some((info.model_id.clone(), info.max_context as usize));
                Ok(())
            }
        }
    }

    /// Connects to a worker and admits it (see [`Self::check_and_register`]).
    async fn connect_and_register(&self, endpoint: &str) -> Result<WorkerConn, String> {
        let conn = WorkerConn::connect_with(
            endpoint,
            self.config.conn_timeouts,
            self.config.worker_tls.as_ref(),
        )
        .await
        .map_err(|e| e.to_string())?;
        self.check_and_register(&conn).await?;
        Ok(conn)
    }

    /// Checks the worker serves this fleet's model and block size, adds it to the
    /// routing core and indexes its cache from a dump.
    async fn check_and_register(&self, conn: &WorkerConn) -> Result<(), String> {
        self.check_model(conn)?;
        self.register(conn).await.map(|_| ())
    }

    /// Adds the worker to the routing core and indexes its cache from a dump.
    async fn register(&self, conn: &WorkerConn) -> Result<u64, String> {
        let id = conn.id().to_string();
        self.kv()
            .add_worker(&id, conn.info.block_size as usize)
            .map_err(|e| e.to_string())?;
        self.resync(conn).await.map_err(|e| e.to_string())
    }

    /// Rebuilds a worker's part of the index from its dump; returns the dump's seq.
    async fn resync(&self, conn: &WorkerConn) -> Result<u64, ConnError> {
        let dump = conn.cache_dump().await?;
        let blocks: Vec<(BlockHash, Option<BlockHash>)> = dump
            .blocks
            .iter()
            .map(|b| (BlockHash(b.hash), b.parent_hash.map(BlockHash)))
            .collect();
        m::resync(conn.id());
        if let Err(e) = self.kv().rebuild_worker(conn.id(), &blocks, dump.seq) {
            tracing::warn!(worker = conn.id(), "rebuild failed: {e}");
        }
        Ok(dump.seq)
    }

    /// Follows one worker for as long as it is in the table.
    async fn supervise(self: Arc<Self>, id: String, endpoint: String) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let conn = match self.conn_for(&id) {
                Some(c) => Ok(c),
                None => self.reconnect(&id, &endpoint).await,
            };
            match conn {
                Ok(conn) => {
                    backoff = Duration::from_millis(100);
                    let err = self.follow(&conn).await;
                    tracing::warn!(worker = %id, "lost worker: {err}");
                }
                Err(e) => tracing::debug!(worker = %id, "reconnect failed: {e}"),
            }
            self.worker_failed(&id);
            // A lost or unreachable worker counts against its breaker, so it stays out
            // of routing for a cool-down after it answers again.
            self.breaker_failure(&id);
            if let Ok(mut w) = self.workers.write() {
                match w.get_mut(&id) {
                    Some(s) => s.conn = None,
                    None => return,
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    fn conn_for(&self, id: &str) -> Option<WorkerConn> {
        let w = self.workers.read().ok()?;
        w.get(id).and_then(|s| s.conn.clone())
    }

    async fn reconnect(&self, id: &str, endpoint: &str) -> Result<WorkerConn, String> {
        let conn = WorkerConn::connect_with(
            endpoint,
            self.config.conn_timeouts,
            self.config.worker_tls.as_ref(),
        )
        .await
        .map_err(|e| e.to_string())?;
        if conn.id() != id {
            return Err(format!("{endpoint} is now worker {}, not {id}", conn.id()));
        }
        self.check_and_register(&conn).await?;
        if let Ok(mut w) = self.workers.write() {
            if let Some(s) = w.get_mut(id) {
                s.conn = Some(conn.clone());
                s.healthy = true;
            }
        }
        Ok(conn)
    }

    /// Applies the worker's events and polls its load until something fails.
    async fn follow(&self, conn: &WorkerConn) -> String {
        let id = conn.id().to_string();
        let mut poll = tokio::time::interval(self.config.load_poll_interval);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        if !self.config.follow_worker_events {
            // The index is fed from the event stream; only load is polled here.
            loop {
                poll.tick().await;
                if let Err(e) = self.poll_load(conn).await {
                    return e.to_string();
                }
            }
        }
        'subscribe: loop {
            let from = self.kv().last_seq(&id).unwrap_or(0) + 1;
            let mut stream = match conn.kv_events(from).await {
                Ok(s) => s,
                Err(ConnError::Status(s)) if s.code() == tonic::Code::OutOfRange => {
                    if let Err(e) = self.resync(conn).await {
                        return e.to_string();
                    }
                    continue 'subscribe;
                }
                Err(e) => return e.to_string(),
            };
            loop {
                tokio::select! {
                    batch = stream.next() => match batch {
                        Some(Ok(batch)) => {
                            if self.kv().worker_index(&id).is_none() {
                                // Dropped from routing after a failed request: reconnect
                                // and re-register rather than resync forever.
                                return "dropped from routing".to_string();
                            }
                            if let Err(e) = self.apply_batch(&id, &batch) {
                                tracing::info!(worker = %id, "event gap ({e}); resyncing from a dump");
                                if let Err(e) = self.resync(conn).await {
                                    return e.to_string();
                                }
                                continue 'subscribe;
                            }
                        }
                        Some(Err(s)) if s.code() == tonic::Code::OutOfRange => {
                            if let Err(e) = self.resync(conn).await {
                                return e.to_string();
                            }
                            continue 'subscribe;
                        }
                        Some(Err(s)) => return format!("event stream failed: {s}"),
                        None => return "event stream ended".to_string(),
                    },
                    _ = poll.tick() => {
                        if let Err(e) = self.poll_load(conn).await {
                            return e.to_string();
                        }
                    }
                }
            }
        }
    }

    fn apply_batch(&self, id: &str, batch: &pb::KvEventBatch) -> Result<(), IndexError> {
        let mut kv = self.kv();
        for e in &batch.events {
            kv.apply_event(id, &router_event(e))?;
        }
        Ok(())
    }

    async fn poll_load(&self, conn: &WorkerConn) -> Result<(), ConnError> {
        let l = conn.load().await?;
        let report = WorkerLoad {
            running: l.running as usize,
            waiting: l.waiting as usize,
            queued_prefill_tokens: l.queued_prefill_tokens as usize,
            free_blocks: l.free_blocks as usize,
            total_blocks: l.total_blocks as usize,
            ..WorkerLoad::default()
        };
        let applied_seq = {
            let mut kv = self.kv();
            if kv.update_load(conn.id(), report).is_err() {
                // Dropped from routing after a failed request: the supervisor reconnects
                // and re-registers it.
                return Err(ConnError::Status(tonic::Status::unavailable(
                    "dropped from routing",
                )));
            }
            kv.last_seq(conn.id()).unwrap_or(0)
        };
        // Events the worker has published that this router's index has not applied yet
        // (from the gRPC stream or, with Kafka, from the event topic).
        m::worker_events_behind(conn.id(), l.last_event_seq.saturating_sub(applied_seq));
        m::worker_load(
            conn.id(),
            l.running.into(),
            l.waiting.into(),
            l.free_blocks.into(),
            l.cached_blocks.into(),
            l.queued_prefill_tokens,
        );
        if let Ok(mut w) = self.workers.write() {
            if let Some(s) = w.get_mut(conn.id()) {
                s.load = Some(LoadReport {
                    running: l.running,
                    waiting: l.waiting,
                    free_blocks: l.free_blocks,
                    cached_blocks: l.cached_blocks,
                    total_blocks: l.total_blocks,
                    queued_prefill_tokens: l.queued_prefill_tokens,
                    prompt_tokens: l.prompt_tokens,
                    prompt_tokens_computed: l.prompt_tokens_computed,
                    cached_tokens: l.cached_tokens,
                    generated_tokens: l.generated_tokens,
                    preemptions: l.preemptions,
                });
            }
        }
        Ok(())
    }

    /// Polls every healthy worker's load now (tests and `/fleet` want fresh counters).
    pub async fn refresh_loads(&self) {
        let conns: Vec<WorkerConn> = self
            .workers
            .read()
            .map(|w| {
                w.values()
                    .filter(|s| s.healthy)
                    .filter_map(|s| s.conn.clone())
                    .collect()
            })
            .unwrap_or_default();
        for c in conns {
            let _ = self.poll_load(&c).await;
        }
    }
}

/// Wall-clock Unix milliseconds (0 before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Converts a wire event into the router's own type.
pub fn router_event(e: &pb::KvEvent) -> RouterKvEvent {
    use pb::kv_event::Kind;
    let kind = match &e.kind {
        Some(Kind::Stored(s)) => RouterKvEventKind::Stored {
            parent_hash: s.parent_hash.map(BlockHash),
            block_hashes: s.block_hashes.iter().map(|h| BlockHash(*h)).collect(),
        },
        Some(Kind::Removed(r)) => RouterKvEventKind::Removed {
            block_hashes: r.block_hashes.iter().map(|h| BlockHash(*h)).collect(),
        },
        // A kind this router does not know: treat as losing track of the worker's
        // cache, the safe reading.
        Some(Kind::Cleared(_)) | None => RouterKvEventKind::Cleared,
    };
    RouterKvEvent { seq: e.seq, kind }
}
