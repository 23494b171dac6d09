//! Worker supervision: the connections to workers, their circuit breakers, and the
//! tasks that keep the routing core current with each worker's KV events and load.
//!
//! One supervisor task per worker connects, rebuilds the worker's part of the index
//! from a `CacheDump`, then follows its `KvEvents` stream and polls `Load`. Any gap in
//! event sequence numbers triggers another dump; a lost worker is dropped from the
//! index (so nothing is routed to it) until it answers again.

use crate::circuit_breaker::{BreakerConfig, CircuitBreaker, CircuitState};
use crate::fleet_metrics as m;
use crate::routing_state::RoutingState;
use crate::worker_conn::{ConnError, ConnTimeouts, WorkerConn};
use crate::worker_tiers::WorkerTiers;
use futures::StreamExt;
use kvfleet_core::sync::lock;

use kvfleet_proto::kv_events::from_wire;
use kvfleet_proto::v1 as pb;
use kvfleet_routing::{IndexError, RouterKvEvent, WorkerLoad};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// How workers are reached and followed.
#[derive(Clone, Debug)]
pub struct SupervisionConfig {
    /// Connect and unary-call deadlines.
    pub conn_timeouts: ConnTimeouts,
    /// TLS to workers; `None`: plaintext.
    pub worker_tls: Option<tonic::transport::ClientTlsConfig>,
    /// How often each worker's load is polled.
    pub load_poll_interval: Duration,
    /// Follow each worker's `KvEvents` stream (false: a control plane feeds the index).
    pub follow_worker_events: bool,
    /// Per-worker circuit breaker settings.
    pub breaker: BreakerConfig,
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
    pub load: Option<WorkerLoad>,
    /// KV-tier totals from the same report.
    pub tiers: Option<WorkerTiers>,
    /// Its circuit breaker's state.
    pub circuit: CircuitState,
}

struct WorkerSlot {
    conn: Option<WorkerConn>,
    endpoint: String,
    healthy: bool,
    load: Option<WorkerLoad>,
    tiers: Option<WorkerTiers>,
    task: Option<JoinHandle<()>>,
}

/// The workers of a fleet: connections, breakers, supervisor tasks.
pub struct WorkerSupervision {
    config: SupervisionConfig,
    routing: Arc<RoutingState>,
    workers: RwLock<BTreeMap<String, WorkerSlot>>,
    breakers: Mutex<HashMap<String, CircuitBreaker>>,
    model: RwLock<Option<(String, usize)>>,
}

/// The router's view of a worker's `Load` answer: the one conversion from the wire to
/// the load type the policies score and `/fleet` shows.
pub fn worker_load(l: &pb::LoadResponse) -> WorkerLoad {
    WorkerLoad {
        running: l.running as usize,
        waiting: l.waiting as usize,
        queued_prefill_tokens: l.queued_prefill_tokens as usize,
        free_blocks: l.free_blocks as usize,
        total_blocks: l.total_blocks as usize,
        admit_blocks: l.admit_blocks.map(|b| b as usize),
        cached_blocks: l.cached_blocks as usize,
        prompt_tokens: l.prompt_tokens,
        prompt_tokens_computed: l.prompt_tokens_computed,
        cached_tokens: l.cached_tokens,
        generated_tokens: l.generated_tokens,
        preemptions: l.preemptions,
        report_seq: l.load_seq,
        ..WorkerLoad::default()
    }
}

/// The router's view of the tier totals in a worker's `Load` answer (the one
/// conversion from the wire; a worker without tiers reports only its usage totals).
pub fn worker_tiers(l: &pb::LoadResponse) -> WorkerTiers {
    let t = l.kv_tiers.unwrap_or_default();
    WorkerTiers {
        tiered_workers: u64::from(l.kv_tiers.is_some()),
        prompt_tokens: l.prompt_tokens,
        cached_tokens: l.cached_tokens,
        host_cached_tokens: l.host_cached_tokens,
        disk_cached_tokens: l.disk_cached_tokens,
        peer_cached_tokens: l.peer_cached_tokens,
        host_blocks: t.host_blocks,
        host_bytes: t.host_bytes,
        disk_blocks: t.disk_blocks,
        disk_bytes: t.disk_bytes,
        demoted_blocks: t.demoted_blocks,
        demoted_bytes: t.demoted_bytes,
        demoted_off_thread_blocks: t.demoted_off_thread_blocks,
        promoted_host_blocks: t.promoted_host_blocks,
        promoted_disk_blocks: t.promoted_disk_blocks,
        promoted_peer_blocks: t.promoted_peer_blocks,
        promoted_bytes: t.promoted_bytes,
        peer_pulled_blocks: l.peer_pulled_blocks,
        peer_pulled_bytes: l.peer_pulled_bytes,
        demotion_misses: t.demotion_misses,
        disk_faults: t.disk_faults,
    }
}

/// Applies a wire batch of worker `id`'s events, and the load it carries, to `routing`
/// (both event followers, the gRPC stream here and the control plane's Kafka consumer,
/// go through this).
pub async fn apply_wire_batch(
    routing: &RoutingState,
    id: &str,
    batch: &pb::KvEventBatch,
) -> Result<(), IndexError> {
    let events: Vec<RouterKvEvent> = batch.events.iter().map(from_wire).collect();
    let applied = routing.apply_events(id, &events).await;
    // Taken after these events (or alone): true whether or not they left a gap.
    if let Some(l) = &batch.load {
        routing.apply_pushed_load(id, &worker_load(l));
    }
    applied
}

impl WorkerSupervision {
    /// No workers yet.
    pub fn new(config: SupervisionConfig, routing: Arc<RoutingState>) -> Self {
        WorkerSupervision {
            config,
            routing,
            workers: RwLock::new(BTreeMap::new()),
            breakers: Mutex::new(HashMap::new()),
            model: RwLock::new(None),
        }
    }

    /// The served model id and context length, once a worker has reported them.
    pub fn model(&self) -> Option<(String, usize)> {
        self.model.read().ok().and_then(|m| m.clone())
    }

    /// Connects to a worker, checks that it serves this fleet's model and block size,
    /// indexes its cache and starts following it. Returns its id.
    pub async fn add_worker(self: &Arc<Self>, endpoint: &str) -> Result<String, String> {
        let conn = self.connect_and_admit(endpoint, None).await?;
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
                    tiers: None,
                    task: None,
                },
            ) {
                if let Some(t) = old.task {
                    t.abort();
                }
            }
        }
        // The slot exists before its supervisor starts, so the supervisor finds it.
        let me = self.clone();
        let (wid, ep) = (id.clone(), endpoint.to_string());
        let task = tokio::spawn(async move { me.supervise(wid, ep).await });
        if let Ok(mut workers) = self.workers.write() {
            if let Some(slot) = workers.get_mut(&id) {
                slot.task = Some(task);
            }
        }
        Ok(id)
    }

    /// Stops following a worker and drops it from routing, with its breaker (a
    /// worker back under the same id starts closed; departed workers leave nothing).
    pub fn remove_worker(&self, id: &str) {
        if let Ok(mut w) = self.workers.write() {
            if let Some(slot) = w.remove(id) {
                if let Some(t) = slot.task {
                    t.abort();
                }
            }
            // Under the table's lock: `breaker_failure` checks the table under it too,
            // so no breaker is made for a worker removed meanwhile.
            lock(&self.breakers).remove(id);
        }
        self.routing.remove_worker(id);
    }

    /// The connection to a healthy worker.
    pub fn conn(&self, id: &str) -> Option<WorkerConn> {
        let w = self.workers.read().ok()?;
        w.get(id).filter(|s| s.healthy).and_then(|s| s.conn.clone())
    }

    /// Every worker's status.
    pub fn statuses(&self) -> Vec<WorkerStatus> {
        let Ok(w) = self.workers.read() else {
            return Vec::new();
        };
        w.iter()
            .map(|(id, s)| WorkerStatus {
                id: id.clone(),
                endpoint: s.endpoint.clone(),
                healthy: s.healthy,
                load: s.load,
                tiers: s.tiers,
                circuit: self.circuit_state(id),
            })
            .collect()
    }

    /// Number of healthy workers.
    pub fn healthy_count(&self) -> usize {
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
        self.routing.remove_worker(id);
    }

    /// Rebuilds worker `id`'s part of the index from its cache dump (after an event
    /// gap seen by an external event consumer); returns the dump's seq.
    pub async fn resync_worker(&self, id: &str) -> Result<u64, String> {
        let conn = self
            .conn_for(id)
            .ok_or_else(|| format!("worker {id} is not connected"))?;
        self.resync(&conn).await.map_err(|e| e.to_string())
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

    // --- circuit breakers ---

    /// Whether worker `id` may be routed to now by its breaker (moving an open
    /// breaker whose cool-down passed to half-open).
    fn refresh_breaker(&self, id: &str, b: &mut CircuitBreaker, now: Instant) {
        if let Some(t) = b.poll(now) {
            breaker_transition(id, t);
        }
        self.routing.set_fenced(id, !b.routable(now));
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
                breaker_transition(id, t);
            }
            self.routing.set_breaker_verdict(id, false, true);
        }
    }

    /// Worker `id` failed a request or missed a deadline. Nothing for a worker not in
    /// the table (removed while its request or supervisor was finishing).
    pub fn breaker_failure(&self, id: &str) {
        let now = Instant::now();
        let Ok(workers) = self.workers.read() else {
            return;
        };
        if !workers.contains_key(id) {
            return;
        }
        // Lock order: the worker table, then the breakers (as `statuses`).
        let mut br = lock(&self.breakers);
        let b = br
            .entry(id.to_string())
            .or_insert_with(|| CircuitBreaker::new(self.config.breaker));
        if let Some(t) = b.on_failure(now) {
            breaker_transition(id, t);
        }
        // It may be hung: no peer pulls from it until it answers a request again.
        self.routing
            .set_breaker_verdict(id, !b.routable(now), false);
    }

    /// Worker `id`'s consecutive failures, as its breaker counts them.
    pub fn breaker_failures(&self, id: &str) -> u32 {
        lock(&self.breakers)
            .get(id)
            .map_or(0, CircuitBreaker::consecutive_failures)
    }

    /// Worker `id`'s breaker state.
    pub fn circuit_state(&self, id: &str) -> CircuitState {
        lock(&self.breakers)
            .get(id)
            .map_or(CircuitState::Closed, CircuitBreaker::state)
    }

    // --- admission of a worker ---

    fn check_model(&self, conn: &WorkerConn) -> Result<(), String> {
        let info = &conn.info;
        let bs = self.routing.block_size();
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

    /// Connects to a worker (which must answer as `expect`, when given), checks it
    /// serves this fleet's model and block size, adds it to the routing core and
    /// indexes its cache from a dump. The one path for first connections and
    /// reconnections.
    async fn connect_and_admit(
        &self,
        endpoint: &str,
        expect: Option<&str>,
    ) -> Result<WorkerConn, String> {
        let conn = WorkerConn::connect_with(
            endpoint,
            self.config.conn_timeouts,
            self.config.worker_tls.as_ref(),
        )
        .await
        .map_err(|e| e.to_string())?;
        if let Some(id) = expect {
            if conn.id() != id {
                return Err(format!("{endpoint} is now worker {}, not {id}", conn.id()));
            }
        }
        self.check_model(&conn)?;
        self.routing
            .add_worker(conn.id(), conn.info.block_size as usize)
            .map_err(|e| e.to_string())?;
        // Tier hits are priced by the served model's KV bytes, not a default model's;
        // a worker with none to move (the simulated engine) takes no part in pulls.
        self.routing.set_kv_block_bytes(
            conn.id(),
            conn.info.kv_block_bytes,
            conn.info.block_size as usize,
        );
        self.resync(&conn).await.map_err(|e| e.to_string())?;
        Ok(conn)
    }

    /// Rebuilds a worker's part of the index from its dump; returns the dump's seq.
    async fn resync(&self, conn: &WorkerConn) -> Result<u64, ConnError> {
        let dump = conn.cache_dump().await?;
        let blocks: Vec<_> = dump
            .blocks
            .iter()
            .map(kvfleet_proto::kv_events::dumped_block_from_wire)
            .collect();
        m::resync(conn.id());
        if let Err(e) = self
            .routing
            .rebuild_worker(conn.id(), &blocks, dump.seq)
            .await
        {
            tracing::warn!(worker = conn.id(), "rebuild failed: {e}");
        }
        Ok(dump.seq)
    }

    // --- following a worker ---

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
        let conn = self.connect_and_admit(endpoint, Some(id)).await?;
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
            let from = self.routing.last_seq(&id).unwrap_or(0) + 1;
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
                            if !self.routing.is_registered(&id) {
                                // Dropped from routing after a failed request: reconnect
                                // and re-register rather than resync forever.
                                return "dropped from routing".to_string();
                            }
                            if let Err(e) = apply_wire_batch(&self.routing, &id, &batch).await {
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

    async fn poll_load(&self, conn: &WorkerConn) -> Result<(), ConnError> {
        let l = conn.load().await?;
        let load = worker_load(&l);
        let tiers = worker_tiers(&l);
        let Ok(applied_seq) = self.routing.update_load(conn.id(), load) else {
            // Dropped from routing after a failed request: the supervisor reconnects
            // and re-registers it.
            return Err(ConnError::Status(tonic::Status::unavailable(
                "dropped from routing",
            )));
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
                s.load = Some(load);
                s.tiers = Some(tiers);
            }
        }
        Ok(())
    }
}

fn breaker_transition(id: &str, (from, to): (CircuitState, CircuitState)) {
    tracing::warn!(
        worker = id,
        from = from.as_str(),
        to = to.as_str(),
        "circuit breaker"
    );
    m::circuit(id, from, to);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_answer_converts_once_into_the_policy_type() {
        let wire = pb::LoadResponse {
            running: 3,
            waiting: 2,
            free_blocks: 10,
            cached_blocks: 7,
            total_blocks: 40,
            queued_prefill_tokens: 900,
            prompt_tokens: 5_000,
            prompt_tokens_computed: 1_200,
            cached_tokens: 3_800,
            generated_tokens: 640,
            preemptions: 1,
            ..pb::LoadResponse::default()
        };
        let l = worker_load(&wire);
        assert_eq!((l.running, l.waiting, l.queued_prefill_tokens), (3, 2, 900));
        assert_eq!(
            (l.free_blocks, l.cached_blocks, l.total_blocks),
            (10, 7, 40)
        );
        assert_eq!(
            (l.prompt_tokens, l.prompt_tokens_computed, l.cached_tokens),
            (5_000, 1_200, 3_800)
        );
        assert_eq!((l.generated_tokens, l.preemptions), (640, 1));
        assert_eq!(l.inflight_requests, 0, "router-side counters start at zero");
        assert_eq!(l.active_sequences(), 5);
        let t = worker_tiers(&wire);
        assert_eq!(t.tiered_workers, 0, "no kv_tiers: a worker without tiers");
        assert_eq!((t.prompt_tokens, t.cached_tokens), (5_000, 3_800));
        assert_eq!(t.device_cached_tokens(), 3_800);
    }

    #[tokio::test]
    async fn a_wire_batch_lowers_a_stale_polled_load_with_the_load_it_carries() {
        let routing = RoutingState::new(kvfleet_routing::RouterConfig::default());
        routing.add_worker("w0", 16).unwrap();
        let busy = pb::LoadResponse {
            running: 1,
            queued_prefill_tokens: 714,
            free_blocks: 30,
            total_blocks: 40,
            load_seq: 5,
            ..pb::LoadResponse::default()
        };
        routing.update_load("w0", worker_load(&busy)).unwrap();
        let backlog = |r: &RoutingState| {
            let l = r.snapshot().workers[0].load;
            (l.active_sequences(), l.prefill_backlog_tokens())
        };
        assert_eq!(backlog(&routing), (1, 714));
        let batch = |load_seq| pb::KvEventBatch {
            worker_id: "w0".into(),
            events: Vec::new(),
            load: Some(pb::LoadResponse {
                free_blocks: 40,
                total_blocks: 40,
                load_seq,
                ..pb::LoadResponse::default()
            }),
        };
        // The poll's own load pushed again changes nothing; a newer one says idle.
        apply_wire_batch(&routing, "w0", &batch(5)).await.unwrap();
        assert_eq!(backlog(&routing), (1, 714));
        apply_wire_batch(&routing, "w0", &batch(6)).await.unwrap();
        assert_eq!(backlog(&routing), (0, 0));
        // A worker no longer routed to is skipped.
        apply_wire_batch(&routing, "gone", &batch(7)).await.unwrap();
    }

    #[test]
    fn tier_totals_convert_from_the_load_answer() {
        let wire = pb::LoadResponse {
            prompt_tokens: 2_000,
            cached_tokens: 1_500,
            host_cached_tokens: 640,
            disk_cached_tokens: 160,
            peer_cached_tokens: 48,
            peer_pulled_blocks: 3,
            peer_pulled_bytes: 3 * 4096,
            kv_tiers: Some(pb::KvTierTotals {
                host_blocks: 90,
                host_bytes: 90 * 4096,
                disk_blocks: 200,
                disk_bytes: 200 * 4200,
                demoted_blocks: 120,
                demoted_bytes: 120 * 4096,
                demoted_off_thread_blocks: 100,
                promoted_host_blocks: 40,
                promoted_disk_blocks: 10,
                promoted_peer_blocks: 3,
                promoted_bytes: 53 * 4096,
                demotion_misses: 2,
                disk_faults: 1,
            }),
            ..pb::LoadResponse::default()
        };
        let t = worker_tiers(&wire);
        assert_eq!(t.tiered_workers, 1);
        assert_eq!(
            (
                t.host_cached_tokens,
                t.disk_cached_tokens,
                t.peer_cached_tokens
            ),
            (640, 160, 48)
        );
        assert_eq!(t.device_cached_tokens(), 1_500 - 640 - 160 - 48);
        assert_eq!((t.host_blocks, t.disk_blocks), (90, 200));
        assert_eq!((t.host_bytes, t.disk_bytes), (90 * 4096, 200 * 4200));
        assert_eq!((t.demoted_blocks, t.demoted_bytes), (120, 120 * 4096));
        assert_eq!(t.demoted_off_thread_blocks, 100);
        assert_eq!(
            (
                t.promoted_host_blocks,
                t.promoted_disk_blocks,
                t.promoted_peer_blocks
            ),
            (40, 10, 3)
        );
        assert_eq!(t.promoted_bytes, 53 * 4096);
        assert_eq!((t.peer_pulled_blocks, t.peer_pulled_bytes), (3, 3 * 4096));
        assert_eq!((t.demotion_misses, t.disk_faults), (2, 1));
    }
}
