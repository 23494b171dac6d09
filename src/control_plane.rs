//! `--etcd` / `--kafka`: joining worker and router processes through the control
//! plane (`kvfleet-control`).
//!
//! A worker registers in membership under a lease (10 s by default) and publishes its
//! KV events to `kvfleet.kv-events`, keyed by its id. A router discovers workers by
//! watching membership (and drops them when their lease expires), indexes each one from
//! its `CacheDump`, then follows every worker's events on the stream with its own
//! consumer group; it shares fork-group and prefix-root placements with the other
//! routers through compare-and-set, and publishes a usage record per request.

use anyhow::{Context, Result};
use clap::Args;
use futures::future::BoxFuture;
use futures::StreamExt;
use kvfleet_control::etcd::EtcdKv;
use kvfleet_control::kafka::{KafkaConfig, KafkaEventStream};
use kvfleet_control::{
    decode_kv_events, encode_kv_events, EventStream, KvMembership, KvPlacement, MemberEvent,
    Membership, Placement, PlacementEvent, PlacementKey, PlacementKind, Record, Registration,
    StartAt, Topic, Topics, UsageRecord, WorkerRecord,
};
use kvfleet_router::control_hooks::{ControlHooks, PlacementRef, RequestUsage};
use kvfleet_router::fleet::router_event;
use kvfleet_router::Fleet;
use kvfleet_worker::EventLog;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Control-plane flags shared by `worker` and `router`.
#[derive(Args, Clone, Debug, Default)]
pub struct ControlArgs {
    /// etcd endpoints (comma-separated, e.g. `http://10.0.0.5:2379`): membership and
    /// placement.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Kafka bootstrap brokers (`host:port,…`): KV events and usage records.
    #[arg(long)]
    pub kafka: Option<String>,
    /// Prefix of the topic names (`<prefix>kvfleet.kv-events`, `<prefix>kvfleet.usage`).
    #[arg(long, default_value = "")]
    pub topic_prefix: String,
    /// Consumer group session timeout, milliseconds.
    #[arg(long, default_value_t = 6000)]
    pub kafka_session_timeout_ms: u64,
}

impl ControlArgs {
    /// Whether any control-plane service was named.
    pub fn enabled(&self) -> bool {
        !self.etcd.is_empty() || self.kafka.is_some()
    }

    /// The etcd store, if `--etcd` was given.
    pub async fn etcd(&self) -> Result<Option<Arc<EtcdKv>>> {
        if self.etcd.is_empty() {
            return Ok(None);
        }
        let kv = EtcdKv::connect(&self.etcd, kvfleet_control::DEFAULT_CALL_TIMEOUT)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))?;
        Ok(Some(kv))
    }

    /// The event stream, if `--kafka` was given.
    pub async fn kafka(&self) -> Result<Option<Arc<KafkaEventStream>>> {
        let Some(brokers) = &self.kafka else {
            return Ok(None);
        };
        let mut config = KafkaConfig::new(brokers.clone());
        config.topics = Topics::prefixed(&self.topic_prefix);
        config.session_timeout = Duration::from_millis(self.kafka_session_timeout_ms);
        let s = KafkaEventStream::connect(config)
            .await
            .with_context(|| format!("connecting to Kafka at {brokers}"))?;
        Ok(Some(Arc::new(s)))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A worker's presence in the control plane: its registration and event publisher.
pub struct WorkerControl {
    registration: Option<JoinHandle<Option<Registration>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    publisher: Option<JoinHandle<()>>,
}

impl WorkerControl {
    /// Registers `record` (if etcd is configured) and starts publishing `log`'s events
    /// (if Kafka is).
    pub async fn start(
        args: &ControlArgs,
        ttl: Duration,
        record: WorkerRecord,
        log: Arc<EventLog>,
    ) -> Result<Self> {
        let publisher = args
            .kafka()
            .await?
            .map(|stream| spawn_publisher(stream, record.clone(), log));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let registration = match args.etcd().await? {
            Some(kv) => {
                let m = KvMembership::new(kv);
                let first = m
                    .register(&record, ttl)
                    .await
                    .context("registering in membership")?;
                Some(tokio::spawn(keep_registered(
                    m, record, ttl, first, stop_rx,
                )))
            }
            None => None,
        };
        Ok(WorkerControl {
            registration,
            stop: Some(stop_tx),
            publisher,
        })
    }

    /// Leaves membership at once (revokes the lease) and stops publishing.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(r) = self.registration.take() {
            if let Ok(Some(reg)) = r.await {
                let _ = reg.deregister().await;
            }
        }
        if let Some(p) = self.publisher.take() {
            p.abort();
        }
    }
}

/// Keeps the worker registered: registers again if the lease is lost (a long etcd
/// outage). Returns the live registration when asked to stop.
async fn keep_registered(
    m: KvMembership<EtcdKv>,
    record: WorkerRecord,
    ttl: Duration,
    mut reg: Registration,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Option<Registration> {
    loop {
        let lost = tokio::select! {
            _ = &mut stop => None,
            e = reg.lost() => Some(e),
        };
        let Some(e) = lost else { return Some(reg) };
        tracing::warn!("membership lease lost ({e}); registering again");
        loop {
            match m.register(&record, ttl).await {
                Ok(r) => {
                    reg = r;
                    break;
                }
                Err(e) => {
                    tracing::warn!("registering again failed: {e}");
                    tokio::select! {
                        _ = &mut stop => return None,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }
}

/// Publishes every event of `log`, in order, keyed by the worker id. A failed publish
/// is retried (the idempotent producer drops the duplicates a retry could cause; the
/// routers drop any that remain by seq).
fn spawn_publisher(
    stream: Arc<KafkaEventStream>,
    record: WorkerRecord,
    log: Arc<EventLog>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let (_closing_tx, closing) = tokio::sync::watch::channel(false);
        let mut from = 1;
        loop {
            let sub = match log.subscribe(from) {
                Ok(s) => s,
                Err(e) => {
                    // Fell out of the ring: routers see the gap and resync from a dump.
                    tracing::warn!("KV event publisher: {e}");
                    from = log.oldest_seq();
                    continue;
                }
            };
            let mut batches = Box::pin(log.clone().into_batches(sub, closing.clone()));
            while let Some(item) = batches.next().await {
                let batch = match item {
                    Ok(b) => b,
                    Err(status) => {
                        tracing::warn!("KV event publisher fell behind: {}", status.message());
                        break;
                    }
                };
                if let Some(last) = batch.events.last() {
                    from = last.seq + 1;
                }
                let payload = encode_kv_events(record.incarnation, &batch);
                let mut backoff = Duration::from_millis(100);
                while let Err(e) = stream
                    .publish(Topic::KvEvents, &record.id, payload.clone())
                    .await
                {
                    tracing::warn!("publishing KV events failed: {e}; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
            from = from.max(log.oldest_seq());
        }
    })
}

/// Router settings for the control plane.
pub struct RouterControlConfig {
    /// This router's id (its consumer group is `kvfleet-router-<id>`).
    pub router_id: String,
    /// TTL of the placements this router writes.
    pub placement_ttl: Duration,
}

/// A router's part in the control plane: the [`ControlHooks`] it installs in its fleet,
/// and the tasks following membership, placements and KV events.
pub struct RouterControl {
    fleet: Arc<Fleet>,
    placement: Arc<dyn Placement>,
    placement_ttl: Duration,
    placed: Mutex<HashMap<PlacementRef, String>>,
    incarnations: Mutex<HashMap<String, u64>>,
    usage_tx: Option<mpsc::Sender<UsageRecord>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

fn to_key(r: &PlacementRef) -> PlacementKey {
    match r {
        PlacementRef::ForkGroup(g) => PlacementKey::fork_group(g),
        PlacementRef::PrefixRoot(h) => PlacementKey::prefix_root(*h),
    }
}

fn from_key(k: &PlacementKey) -> Option<PlacementRef> {
    match k.kind {
        PlacementKind::ForkGroup => Some(PlacementRef::ForkGroup(k.key.clone())),
        PlacementKind::PrefixRoot => u64::from_str_radix(&k.key, 16)
            .ok()
            .map(PlacementRef::PrefixRoot),
    }
}

impl RouterControl {
    /// Joins the control plane: follows membership (etcd, required) and KV events
    /// (Kafka, optional: without it the router follows each worker's gRPC stream),
    /// installs placement and usage hooks in `fleet`.
    pub async fn start(
        args: &ControlArgs,
        config: RouterControlConfig,
        fleet: Arc<Fleet>,
    ) -> Result<Arc<Self>> {
        let kv = args
            .etcd()
            .await?
            .context("a router in control-plane mode needs --etcd (membership)")?;
        let stream = args.kafka().await?;
        let (usage_tx, usage_rx) = match stream {
            Some(_) => {
                let (tx, rx) = mpsc::channel(8192);
                (Some(tx), Some(rx))
            }
            None => (None, None),
        };
        let placement: Arc<dyn Placement> = Arc::new(KvPlacement::new(kv.clone()));
        let me = Arc::new(RouterControl {
            fleet: fleet.clone(),
            placement,
            placement_ttl: config.placement_ttl,
            placed: Mutex::new(HashMap::new()),
            incarnations: Mutex::new(HashMap::new()),
            usage_tx,
            tasks: Mutex::new(Vec::new()),
        });
        let mut tasks = Vec::new();
        if let (Some(stream), Some(rx)) = (stream.clone(), usage_rx) {
            tasks.push(tokio::spawn(publish_usage(stream.clone(), rx)));
            // Subscribe before listing workers: no event falls between a worker's dump
            // and the stream (a new group replays from the earliest record; seqs at or
            // below a dump's are dropped).
            let group = format!("kvfleet-router-{}", config.router_id);
            let sub = stream
                .subscribe(Topic::KvEvents, &group, StartAt::Earliest)
                .await
                .context("subscribing to KV events")?;
            tasks.push(tokio::spawn(me.clone().consume_kv_events(sub)));
            fleet.set_control_plane_up("kafka", true);
            tasks.push(tokio::spawn(probe_kafka(fleet.clone(), stream.clone())));
        }
        let (rev, placements) = me.placement.list().await.context("listing placements")?;
        {
            let mut placed = lock(&me.placed);
            for (k, w) in placements {
                if let Some(r) = from_key(&k) {
                    placed.insert(r, w);
                }
            }
        }
        tasks.push(tokio::spawn(me.clone().follow_placements(rev + 1)));
        let membership = Arc::new(KvMembership::new(kv));
        let snapshot = membership.list().await.context("listing workers")?;
        let watch = membership
            .watch(snapshot.revision + 1)
            .await
            .context("watching workers")?;
        fleet.set_control_plane_up("etcd", true);
        tasks.push(tokio::spawn(me.clone().follow_members_forever(
            membership.clone(),
            snapshot.workers,
            watch,
        )));
        tasks.push(tokio::spawn(probe_etcd(fleet.clone(), membership)));
        *lock(&me.tasks) = tasks;
        fleet.set_control_hooks(me.clone());
        Ok(me)
    }

    /// Stops the background tasks.
    pub fn shutdown(&self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    /// Follows membership; when the watch fails (etcd unreachable) keeps serving on
    /// the workers it knows and lists + watches again once etcd answers.
    async fn follow_members_forever(
        self: Arc<Self>,
        membership: Arc<KvMembership<EtcdKv>>,
        mut initial: Vec<WorkerRecord>,
        mut watch: kvfleet_control::WatchStream<MemberEvent>,
    ) {
        loop {
            self.clone().follow_members(initial, watch).await;
            self.fleet.set_control_plane_up("etcd", false);
            loop {
                tokio::time::sleep(ETCD_PROBE_INTERVAL).await;
                let Ok(Ok(snap)) =
                    tokio::time::timeout(ETCD_PROBE_TIMEOUT, membership.list()).await
                else {
                    continue;
                };
                let w =
                    tokio::time::timeout(ETCD_PROBE_TIMEOUT, membership.watch(snap.revision + 1));
                if let Ok(Ok(w)) = w.await {
                    initial = snap.workers;
                    watch = w;
                    break;
                }
            }
            tracing::info!("membership watch resumed");
            self.fleet.set_control_plane_up("etcd", true);
        }
    }

    async fn follow_members(
        self: Arc<Self>,
        initial: Vec<WorkerRecord>,
        mut watch: kvfleet_control::WatchStream<MemberEvent>,
    ) {
        let mut adders: HashMap<String, JoinHandle<()>> = HashMap::new();
        for w in initial {
            let id = w.id.clone();
            adders.insert(id, self.clone().spawn_add(w));
        }
        while let Some(item) = watch.next().await {
            match item {
                Ok(MemberEvent::Joined { worker, .. }) => {
                    if let Some(old) = adders.remove(&worker.id) {
                        old.abort();
                    }
                    let id = worker.id.clone();
                    adders.insert(id, self.clone().spawn_add(worker));
                }
                Ok(MemberEvent::Left { id, .. }) => {
                    tracing::info!(worker = %id, "worker left the fleet (lease expired or revoked)");
                    if let Some(old) = adders.remove(&id) {
                        old.abort();
                    }
                    lock(&self.incarnations).remove(&id);
                    self.fleet.remove_worker(&id);
                    lock(&self.placed).retain(|_, w| *w != id);
                    match self.placement.release_worker(&id).await {
                        Ok(n) if n > 0 => tracing::info!(worker = %id, "freed {n} placements"),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(worker = %id, "freeing placements: {e}"),
                    }
                }
                Err(e) => {
                    tracing::error!("membership watch failed: {e}");
                    return;
                }
            }
        }
    }

    /// Adds a worker to the fleet, retrying until it answers (or leaves).
    fn spawn_add(self: Arc<Self>, w: WorkerRecord) -> JoinHandle<()> {
        tokio::spawn(async move {
            lock(&self.incarnations).insert(w.id.clone(), w.incarnation);
            // A new incarnation restarts its seqs: forget the old one first.
            self.fleet.remove_worker(&w.id);
            let mut backoff = Duration::from_millis(100);
            loop {
                match self.fleet.add_worker(&w.grpc_addr).await {
                    Ok(id) if id == w.id => {
                        tracing::info!(worker = %id, addr = %w.grpc_addr, "worker joined");
                        return;
                    }
                    Ok(id) => {
                        tracing::warn!(
                            "{} answers as worker {id}, not {}; dropping it",
                            w.grpc_addr,
                            w.id
                        );
                        self.fleet.remove_worker(&id);
                        return;
                    }
                    Err(e) => tracing::debug!(worker = %w.id, "cannot add yet: {e}"),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        })
    }

    async fn follow_placements(self: Arc<Self>, from: i64) {
        let mut watch = match self.placement.watch(from).await {
            Ok(w) => w,
            Err(e) => {
                tracing::error!("placement watch failed: {e}");
                return;
            }
        };
        while let Some(item) = watch.next().await {
            match item {
                Ok(PlacementEvent::Placed { key, worker, .. }) => {
                    if let Some(r) = from_key(&key) {
                        lock(&self.placed).insert(r, worker);
                    }
                }
                Ok(PlacementEvent::Freed { key, .. }) => {
                    if let Some(r) = from_key(&key) {
                        lock(&self.placed).remove(&r);
                    }
                }
                Err(e) => {
                    tracing::error!("placement watch failed: {e}");
                    return;
                }
            }
        }
    }

    /// Applies every worker's KV events from the stream, committing as it goes.
    async fn consume_kv_events(self: Arc<Self>, mut sub: Box<dyn kvfleet_control::Subscription>) {
        let mut pending: Option<Record> = None;
        let mut last_commit = tokio::time::Instant::now();
        loop {
            match sub.next(Duration::from_millis(500)).await {
                Ok(Some(rec)) => {
                    self.fleet.set_control_plane_up("kafka", true);
                    self.apply_record(&rec).await;
                    pending = Some(rec);
                }
                // Nothing new is not proof of a live broker (librdkafka reports a dead
                // one once per reconnect attempt, then stays quiet): `probe_kafka`
                // decides.
                Ok(None) => {}
                Err(e) => {
                    // Unreachable: routing goes on from the router's own reservations
                    // and load polls; the stream resumes from the committed offset.
                    self.fleet.set_control_plane_up("kafka", false);
                    tracing::warn!("KV event stream: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            if last_commit.elapsed() >= Duration::from_millis(500) {
                if let Some(rec) = pending.take() {
                    if let Err(e) = sub.commit(&rec).await {
                        tracing::warn!("committing KV event offset: {e}");
                    }
                }
                last_commit = tokio::time::Instant::now();
            }
        }
    }

    async fn apply_record(&self, rec: &Record) {
        let env = match decode_kv_events(&rec.payload) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(offset = rec.offset, "skipping a KV event record: {e}");
                return;
            }
        };
        let Some(batch) = env.batch else { return };
        let id = batch.worker_id.as_str();
        // Events of a worker this router does not follow (yet), or of another
        // incarnation, are covered by its dump.
        if lock(&self.incarnations).get(id) != Some(&env.incarnation) {
            return;
        }
        let gap = {
            let mut kv = self.fleet.kv();
            let mut gap = false;
            for e in &batch.events {
                match kv.apply_event(id, &router_event(e)) {
                    Ok(()) => {}
                    Err(kvfleet_router::IndexError::UnknownWorker(_)) => break,
                    Err(e) => {
                        tracing::info!(worker = id, "{e}");
                        gap = true;
                        break;
                    }
                }
            }
            gap
        };
        if gap {
            if let Err(e) = self.fleet.resync_worker(id).await {
                tracing::warn!(worker = id, "resync after a gap failed: {e}");
            }
        }
    }
}

async fn publish_usage(stream: Arc<KafkaEventStream>, mut rx: mpsc::Receiver<UsageRecord>) {
    while let Some(rec) = rx.recv().await {
        if let Err(e) = stream
            .publish(Topic::Usage, &rec.worker, rec.encode())
            .await
        {
            tracing::warn!("publishing a usage record failed: {e}");
        }
    }
}

impl ControlHooks for RouterControl {
    fn placed_worker(&self, key: &PlacementRef) -> Option<String> {
        let w = lock(&self.placed).get(key).cloned()?;
        self.fleet.conn(&w).map(|_| w)
    }

    fn claim(&self, key: PlacementRef, worker: String) -> BoxFuture<'static, Option<String>> {
        let placement = self.placement.clone();
        let ttl = self.placement_ttl;
        Box::pin(async move {
            match placement.place(&to_key(&key), &worker, ttl).await {
                Ok(owner) => Some(owner),
                Err(e) => {
                    tracing::warn!("placing {key:?}: {e}");
                    None
                }
            }
        })
    }

    fn request_done(&self, u: RequestUsage) {
        let Some(tx) = &self.usage_tx else { return };
        let rec = UsageRecord {
            tenant: u.tenant,
            model: u.model,
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            output_tokens: u.output_tokens,
            worker: u.worker,
            ttft_ms: u.ttft.map_or(0.0, |t| t.as_secs_f64() * 1000.0),
            fork_group: u.fork_group,
            session_id: u.session_id,
            block_hashes: u.block_hashes,
            block_size: u.block_size,
            timestamp_ms: u.timestamp_ms,
        };
        if tx.try_send(rec).is_err() {
            tracing::warn!("usage record dropped: the publisher is behind");
        }
    }
}

/// How often Kafka's reachability is checked.
const KAFKA_PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Deadline of one Kafka probe (a metadata request).
const KAFKA_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Asks a broker for the KV event topic's metadata every [`KAFKA_PROBE_INTERVAL`]:
/// the consumer alone cannot tell an idle topic from an unreachable broker.
async fn probe_kafka(fleet: Arc<Fleet>, stream: Arc<KafkaEventStream>) {
    loop {
        tokio::time::sleep(KAFKA_PROBE_INTERVAL).await;
        let up = stream.probe(KAFKA_PROBE_TIMEOUT).await.is_ok();
        fleet.set_control_plane_up("kafka", up);
    }
}

/// How often etcd's reachability is checked.
const ETCD_PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Deadline of one etcd probe (a membership list).
const ETCD_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Lists membership every [`ETCD_PROBE_INTERVAL`]: a cut connection may leave a watch
/// silent rather than failed, so reachability is probed, not inferred from the watch.
async fn probe_etcd(fleet: Arc<Fleet>, membership: Arc<KvMembership<EtcdKv>>) {
    loop {
        tokio::time::sleep(ETCD_PROBE_INTERVAL).await;
        let up = matches!(
            tokio::time::timeout(ETCD_PROBE_TIMEOUT, membership.list()).await,
            Ok(Ok(_))
        );
        fleet.set_control_plane_up("etcd", up);
    }
}
