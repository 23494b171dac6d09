//! A router's part in the control plane (`kvfleet-control`): `--etcd` / `--kafka`.
//!
//! The router discovers workers by watching membership (and drops them when their
//! lease expires), indexes each one from its `CacheDump`, then follows every worker's
//! events on the stream with its own consumer group; it shares fork-group and
//! prefix-root placements with the other routers through compare-and-set, and
//! publishes a usage record per request. (The worker's part, registering and
//! publishing its KV events, is `kvfleet_worker::control_plane`.)

use crate::control_hooks::{ControlHooks, KnownPlacement, PlacementRef, RequestUsage};
use crate::fleet::Fleet;
use crate::supervision::apply_wire_batch;
use anyhow::{Context, Result};
use futures::future::BoxFuture;
use kvfleet_control::kafka::KafkaEventStream;
use kvfleet_control::{
    decode_kv_events, ControlConfig, EventStream, KvMembership, KvPlacement, MemberEvent,
    Membership, Placement, PlacementEvent, PlacementKey, PlacementKind, Record, StartAt, Topic,
    UsageRecord, WatchStream, WorkerRecord,
};
use kvfleet_core::sync::lock;
use kvfleet_routing::IndexError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

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
    /// Placements as this router knows them: the owner, and when this router saw the
    /// key placed (`None`: found in a listing, so of unknown age).
    placed: Arc<Mutex<HashMap<PlacementRef, Placed>>>,
    incarnations: Mutex<HashMap<String, u64>>,
    usage_tx: Option<mpsc::Sender<UsageRecord>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// The membership follower's state, kept across watch resumes: each worker's record
/// as last seen, and the task adding it to the fleet.
#[derive(Default)]
struct Members {
    known: HashMap<String, WorkerRecord>,
    adders: HashMap<String, JoinHandle<()>>,
}

/// A placement in this router's view.
#[derive(Clone, Debug)]
struct Placed {
    worker: String,
    seen: Option<Instant>,
}

impl Placed {
    fn now(worker: String) -> Self {
        Placed {
            worker,
            seen: Some(Instant::now()),
        }
    }
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
    /// The control-plane link of `fleet` over `placement`, with no background task
    /// yet ([`Self::start`] starts them); `usage_tx` takes the usage records.
    pub fn new(
        fleet: Arc<Fleet>,
        placement: Arc<dyn Placement>,
        placement_ttl: Duration,
        usage_tx: Option<mpsc::Sender<UsageRecord>>,
    ) -> Arc<Self> {
        Arc::new(RouterControl {
            fleet,
            placement,
            placement_ttl,
            placed: Arc::new(Mutex::new(HashMap::new())),
            incarnations: Mutex::new(HashMap::new()),
            usage_tx,
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// Joins the control plane: follows membership (etcd, required) and KV events
    /// (Kafka, optional: without it the router follows each worker's gRPC stream),
    /// installs placement and usage hooks in `fleet`.
    pub async fn start(
        control: impl Into<ControlConfig>,
        config: RouterControlConfig,
        fleet: Arc<Fleet>,
    ) -> Result<Arc<Self>> {
        let args: ControlConfig = control.into();
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
        let me = Self::new(fleet.clone(), placement, config.placement_ttl, usage_tx);
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
        let membership: Arc<dyn Membership> = Arc::new(KvMembership::new(kv));
        tasks.extend(me.follow(membership).await?);
        *lock(&me.tasks) = tasks;
        fleet.set_control_hooks(me.clone());
        Ok(me)
    }

    /// Joins a control plane given as its two traits (the in-memory one in tests; etcd
    /// through [`Self::start`]): follows `membership` and `placement` and installs the
    /// placement hooks in `fleet`. No usage records, no KV event stream.
    pub async fn start_with(
        fleet: Arc<Fleet>,
        placement: Arc<dyn Placement>,
        membership: Arc<dyn Membership>,
        placement_ttl: Duration,
    ) -> Result<Arc<Self>> {
        let me = Self::new(fleet.clone(), placement, placement_ttl, None);
        let tasks = me.follow(membership).await?;
        *lock(&me.tasks) = tasks;
        fleet.set_control_hooks(me.clone());
        Ok(me)
    }

    /// Lists placements and members, and starts the tasks that follow both.
    async fn follow(
        self: &Arc<Self>,
        membership: Arc<dyn Membership>,
    ) -> Result<Vec<JoinHandle<()>>> {
        let mut tasks = Vec::new();
        let (rev, placements) = self.placement.list().await.context("listing placements")?;
        self.replace_placements(placements);
        tasks.push(tokio::spawn(self.clone().follow_placements(rev + 1)));
        let snapshot = membership.list().await.context("listing workers")?;
        let watch = membership
            .watch(snapshot.revision + 1)
            .await
            .context("watching workers")?;
        self.fleet.set_control_plane_up("etcd", true);
        tasks.push(tokio::spawn(self.clone().follow_members_forever(
            membership.clone(),
            snapshot.workers,
            watch,
        )));
        tasks.push(tokio::spawn(probe_etcd(self.fleet.clone(), membership)));
        Ok(tasks)
    }

    /// Replaces this router's view of the placements with a listing.
    fn replace_placements(&self, placements: Vec<(PlacementKey, String)>) {
        let placed = placements
            .into_iter()
            .filter_map(|(k, worker)| from_key(&k).map(|r| (r, Placed { worker, seen: None })))
            .collect();
        *lock(&self.placed) = placed;
    }

    /// Stops the background tasks.
    pub fn shutdown(&self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }

    /// Follows membership; when the watch fails (etcd unreachable) keeps serving on
    /// the workers it knows and lists + watches again once etcd answers. What it knows
    /// outlives each watch: a resume changes only the workers whose records changed.
    async fn follow_members_forever(
        self: Arc<Self>,
        membership: Arc<dyn Membership>,
        mut listed: Vec<WorkerRecord>,
        mut watch: WatchStream<MemberEvent>,
    ) {
        let mut members = Members::default();
        loop {
            self.reconcile_members(&mut members, listed).await;
            self.follow_members(&mut members, watch).await;
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
                    listed = snap.workers;
                    watch = w;
                    break;
                }
            }
            tracing::info!("membership watch resumed");
            self.fleet.set_control_plane_up("etcd", true);
        }
    }

    /// Brings `members` in line with a listing: adds new and changed records, removes
    /// the workers the listing lacks (they left while no watch was looking).
    async fn reconcile_members(self: &Arc<Self>, members: &mut Members, listed: Vec<WorkerRecord>) {
        let listed_ids: std::collections::HashSet<&str> =
            listed.iter().map(|w| w.id.as_str()).collect();
        let gone: Vec<String> = members
            .known
            .keys()
            .filter(|id| !listed_ids.contains(id.as_str()))
            .cloned()
            .collect();
        for id in gone {
            self.worker_left(members, &id).await;
        }
        for w in listed {
            self.worker_joined(members, w);
        }
    }

    /// Applies a membership watch until it fails or closes.
    async fn follow_members(
        self: &Arc<Self>,
        members: &mut Members,
        mut watch: WatchStream<MemberEvent>,
    ) {
        while let Some(item) = watch.next().await {
            match item {
                Ok(MemberEvent::Joined { worker, .. }) => self.worker_joined(members, worker),
                Ok(MemberEvent::Left { id, .. }) => {
                    tracing::info!(worker = %id, "worker left the fleet (lease expired or revoked)");
                    self.worker_left(members, &id).await;
                }
                Err(e) => {
                    tracing::error!("membership watch failed: {e}");
                    return;
                }
            }
        }
    }

    /// A worker's record was seen (listed or put): (re)adds it unless it is the record
    /// already followed, since re-adding drops its index and forces a full dump.
    fn worker_joined(self: &Arc<Self>, members: &mut Members, worker: WorkerRecord) {
        if members.known.get(&worker.id) == Some(&worker) {
            return;
        }
        if let Some(old) = members.adders.remove(&worker.id) {
            old.abort();
        }
        let id = worker.id.clone();
        members.known.insert(id.clone(), worker.clone());
        members.adders.insert(id, self.clone().spawn_add(worker));
    }

    /// Worker `id` left: drops it from the fleet and frees its placements.
    async fn worker_left(&self, members: &mut Members, id: &str) {
        members.known.remove(id);
        if let Some(old) = members.adders.remove(id) {
            old.abort();
        }
        lock(&self.incarnations).remove(id);
        self.fleet.remove_worker(id);
        lock(&self.placed).retain(|_, p| p.worker != id);
        match self.placement.release_worker(id).await {
            Ok(n) if n > 0 => tracing::info!(worker = %id, "freed {n} placements"),
            Ok(_) => {}
            Err(e) => tracing::warn!(worker = %id, "freeing placements: {e}"),
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

    /// Follows placements from revision `from` for as long as the router runs: after
    /// any watch error (or a closed watch) lists them again with backoff, replaces the
    /// map with the listing and watches from that revision on, so nothing placed or
    /// freed while the watch was down is missed.
    async fn follow_placements(self: Arc<Self>, mut from: i64) {
        let mut backoff = WATCH_BACKOFF_MIN;
        loop {
            match self.placement.watch(from).await {
                Ok(watch) => {
                    if self.apply_placements(watch).await {
                        backoff = WATCH_BACKOFF_MIN;
                    }
                }
                Err(e) => tracing::warn!("placement watch failed: {e}"),
            }
            loop {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(WATCH_BACKOFF_MAX);
                match tokio::time::timeout(ETCD_PROBE_TIMEOUT, self.placement.list()).await {
                    Ok(Ok((rev, placements))) => {
                        self.replace_placements(placements);
                        from = rev + 1;
                        break;
                    }
                    Ok(Err(e)) => tracing::warn!("listing placements: {e}"),
                    Err(_) => tracing::warn!("listing placements timed out"),
                }
            }
            tracing::info!("placement watch resumed");
        }
    }

    /// Applies a placement watch until it fails or closes; whether it applied any
    /// change (a watch that worked, so the backoff starts over).
    async fn apply_placements(&self, mut watch: WatchStream<PlacementEvent>) -> bool {
        let mut applied = false;
        while let Some(item) = watch.next().await {
            match item {
                Ok(PlacementEvent::Placed { key, worker, .. }) => {
                    if let Some(r) = from_key(&key) {
                        lock(&self.placed).insert(r, Placed::now(worker));
                    }
                }
                Ok(PlacementEvent::Freed { key, .. }) => {
                    if let Some(r) = from_key(&key) {
                        lock(&self.placed).remove(&r);
                    }
                }
                Err(e) => {
                    tracing::warn!("placement watch failed: {e}");
                    return applied;
                }
            }
            applied = true;
        }
        tracing::warn!("placement watch closed");
        applied
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
        let gap = match apply_wire_batch(&self.fleet.routing, id, &batch).await {
            Ok(()) | Err(IndexError::UnknownWorker(_)) => false,
            Err(e) => {
                tracing::info!(worker = id, "{e}");
                true
            }
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
    fn placement(&self, key: &PlacementRef) -> Option<KnownPlacement> {
        let p = lock(&self.placed).get(key).cloned()?;
        self.fleet.conn(&p.worker).map(|_| KnownPlacement {
            age: p.seen.map(|t| t.elapsed()),
            worker: p.worker,
        })
    }

    fn claim(&self, key: PlacementRef, worker: String) -> BoxFuture<'static, Option<String>> {
        let placement = self.placement.clone();
        let ttl = self.placement_ttl;
        let placed = self.placed.clone();
        Box::pin(async move {
            match placement.place(&to_key(&key), &worker, ttl).await {
                Ok(owner) => {
                    // Known here at once, not only when the watch brings it back: the
                    // next sibling on this router follows it without a round trip.
                    lock(&placed).insert(key, Placed::now(owner.clone()));
                    Some(owner)
                }
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
            cached_by_tier: u.promoted,
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

/// First wait before a failed placement watch is listed and watched again.
const WATCH_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between two attempts to list and watch placements again.
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How often etcd's reachability is checked.
const ETCD_PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Deadline of one etcd probe (a membership list).
const ETCD_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Lists membership every [`ETCD_PROBE_INTERVAL`]: a cut connection may leave a watch
/// silent rather than failed, so reachability is probed, not inferred from the watch.
async fn probe_etcd(fleet: Arc<Fleet>, membership: Arc<dyn Membership>) {
    loop {
        tokio::time::sleep(ETCD_PROBE_INTERVAL).await;
        let up = matches!(
            tokio::time::timeout(ETCD_PROBE_TIMEOUT, membership.list()).await,
            Ok(Ok(_))
        );
        fleet.set_control_plane_up("etcd", up);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::FleetConfig;
    use kvfleet_control::encode_kv_events;
    use kvfleet_control::memory::MemKv;
    use kvfleet_core::BlockHash;
    use kvfleet_proto::v1 as pb;

    fn control(usage_tx: Option<mpsc::Sender<UsageRecord>>) -> (Arc<Fleet>, Arc<RouterControl>) {
        let fleet = Fleet::new(FleetConfig::default()).expect("fleet");
        let placement: Arc<dyn Placement> = Arc::new(KvPlacement::new(MemKv::new()));
        let rc = RouterControl::new(fleet.clone(), placement, Duration::from_secs(60), usage_tx);
        (fleet, rc)
    }

    fn record(worker: &str, incarnation: u64, seq: u64, hashes: &[u64]) -> Record {
        use pb::kv_event::{Kind, Stored};
        let batch = pb::KvEventBatch {
            worker_id: worker.to_string(),
            events: vec![pb::KvEvent {
                seq,
                kind: Some(Kind::Stored(Stored {
                    medium: Default::default(),
                    parent_hash: None,
                    block_hashes: hashes.to_vec(),
                })),
            }],
            load: None,
        };
        Record {
            key: worker.to_string(),
            payload: encode_kv_events(incarnation, &batch),
            partition: 0,
            offset: seq as i64,
        }
    }

    #[tokio::test]
    async fn stream_records_feed_the_index_of_the_followed_incarnation_only() {
        let (fleet, rc) = control(None);
        let bs = fleet.routing.block_size();
        fleet.routing.add_worker("w0", bs).unwrap();
        lock(&rc.incarnations).insert("w0".into(), 7);

        rc.apply_record(&record("w0", 7, 1, &[10, 11])).await;
        assert_eq!(fleet.routing.last_seq("w0"), Some(1));
        assert_eq!(fleet.routing.worker_blocks("w0").map(|b| b.len()), Some(2));

        // Another incarnation's events are covered by that incarnation's dump.
        rc.apply_record(&record("w0", 8, 2, &[12])).await;
        assert_eq!(fleet.routing.last_seq("w0"), Some(1));

        // A gap is not applied (the resync it triggers fails: no connection here).
        rc.apply_record(&record("w0", 7, 3, &[13])).await;
        assert_eq!(fleet.routing.last_seq("w0"), Some(1));

        rc.apply_record(&record("w0", 7, 2, &[12])).await;
        assert_eq!(fleet.routing.last_seq("w0"), Some(2));
        let chain = [10, 11, 12].map(BlockHash);
        assert!(fleet.routing.holds_prefix(&chain));

        // A worker this router does not follow: ignored, nothing registered.
        rc.apply_record(&record("w9", 7, 1, &[10])).await;
        assert!(!fleet.routing.is_registered("w9"));
    }

    #[tokio::test]
    async fn claims_follow_the_first_owner_and_keys_round_trip() {
        let (_fleet, rc) = control(None);
        let key = PlacementRef::ForkGroup("g1".into());
        assert_eq!(
            rc.claim(key.clone(), "w0".into()).await.as_deref(),
            Some("w0")
        );
        assert_eq!(
            rc.claim(key.clone(), "w1".into()).await.as_deref(),
            Some("w0")
        );
        let root = PlacementRef::PrefixRoot(0xdead_beef);
        assert_eq!(
            rc.claim(root.clone(), "w1".into()).await.as_deref(),
            Some("w1")
        );
        for r in [key, root] {
            assert_eq!(from_key(&to_key(&r)), Some(r));
        }
        // Placed, but on a worker this router has no connection to: not used.
        lock(&rc.placed).insert(
            PlacementRef::ForkGroup("g1".into()),
            Placed::now("w0".into()),
        );
        assert_eq!(
            rc.placed_worker(&PlacementRef::ForkGroup("g1".into())),
            None
        );
    }

    #[tokio::test]
    async fn a_finished_request_becomes_one_usage_record() {
        let (tx, mut rx) = mpsc::channel(4);
        let (_fleet, rc) = control(Some(tx));
        rc.request_done(RequestUsage {
            tenant: "t".into(),
            model: "m".into(),
            prompt_tokens: 100,
            cached_tokens: 64,
            promoted: kvfleet_core::kv_events::PromotedTokens {
                host: 32,
                ..Default::default()
            },
            output_tokens: 5,
            worker: "w0".into(),
            ttft: Some(Duration::from_millis(250)),
            fork_group: Some("g".into()),
            session_id: None,
            block_hashes: vec![1, 2, 3, 4],
            block_size: 16,
            timestamp_ms: 1_700_000_000_000,
        });
        let rec = rx.try_recv().expect("one record");
        assert_eq!(
            (rec.prompt_tokens, rec.cached_tokens, rec.output_tokens),
            (100, 64, 5)
        );
        assert_eq!(rec.worker, "w0");
        assert_eq!(
            rec.cached_by_tier.host, 32,
            "the tier split reaches the record"
        );
        assert!((rec.ttft_ms - 250.0).abs() < 1e-9, "{}", rec.ttft_ms);
        assert_eq!(rec.block_hashes, vec![1, 2, 3, 4]);
        assert_eq!(rec.fork_group.as_deref(), Some("g"));
        assert!(rx.try_recv().is_err(), "exactly one record");
    }
}
