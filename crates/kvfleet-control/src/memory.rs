//! In-process implementations (the embedded default): [`MemKv`], a key-value store with
//! leases and revisions that behaves like etcd, and [`MemEventStream`], an append-only
//! log per topic with consumer-group offsets that behaves like Kafka.

use crate::error::{ControlError, Result};
use crate::events::{EventStream, Record, StartAt, Subscription, Topic, Topics};
use crate::kv::{CasOutcome, KvChange, KvChangeKind, KvStore};
use crate::watch::WatchStream;
use async_trait::async_trait;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;

/// Changes kept for watches from an old revision.
const HISTORY_KEPT: usize = 1 << 20;

struct Entry {
    value: Vec<u8>,
    lease: Option<i64>,
}

struct Lease {
    ttl: Duration,
    expires: Instant,
    keys: BTreeSet<String>,
}

struct KvState {
    revision: i64,
    kv: BTreeMap<String, Entry>,
    leases: HashMap<i64, Lease>,
    next_lease: i64,
    history: VecDeque<KvChange>,
}

/// An in-process etcd: leases, revisions, compare-and-set, watch from a revision.
pub struct MemKv {
    state: Arc<Mutex<KvState>>,
    live: broadcast::Sender<KvChange>,
}

fn lock_kv<'a>(
    state: &'a Mutex<KvState>,
    live: &broadcast::Sender<KvChange>,
) -> MutexGuard<'a, KvState> {
    let mut st = kvfleet_core::sync::lock(state);
    let now = Instant::now();
    let due: Vec<i64> = st
        .leases
        .iter()
        .filter(|(_, l)| l.expires <= now)
        .map(|(id, _)| *id)
        .collect();
    for id in due {
        drop_lease(&mut st, live, id);
    }
    st
}

fn drop_lease(st: &mut KvState, live: &broadcast::Sender<KvChange>, id: i64) {
    if let Some(l) = st.leases.remove(&id) {
        for key in l.keys {
            if st.kv.remove(&key).is_some() {
                record(st, live, key, KvChangeKind::Delete);
            }
        }
    }
}

fn record(
    st: &mut KvState,
    live: &broadcast::Sender<KvChange>,
    key: String,
    kind: KvChangeKind,
) -> i64 {
    st.revision += 1;
    let change = KvChange {
        revision: st.revision,
        key,
        kind,
    };
    st.history.push_back(change.clone());
    while st.history.len() > HISTORY_KEPT {
        st.history.pop_front();
    }
    let _ = live.send(change);
    st.revision
}

impl MemKv {
    /// An empty store. Inside a tokio runtime it starts a task that expires leases
    /// (outside one, leases expire on the next call).
    pub fn new() -> Arc<Self> {
        let (live, _) = broadcast::channel(4096);
        let kv = Arc::new(MemKv {
            state: Arc::new(Mutex::new(KvState {
                revision: 1,
                kv: BTreeMap::new(),
                leases: HashMap::new(),
                next_lease: 1,
                history: VecDeque::new(),
            })),
            live,
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let weak: Weak<MemKv> = Arc::downgrade(&kv);
            rt.spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let Some(kv) = weak.upgrade() else { return };
                    drop(kv.lock());
                }
            });
        }
        kv
    }

    /// Locks the state, expiring due leases first.
    fn lock(&self) -> MutexGuard<'_, KvState> {
        lock_kv(&self.state, &self.live)
    }

    fn drop_lease(&self, st: &mut KvState, id: i64) {
        drop_lease(st, &self.live, id)
    }

    fn record(&self, st: &mut KvState, key: String, kind: KvChangeKind) -> i64 {
        record(st, &self.live, key, kind)
    }

    fn write(
        &self,
        st: &mut KvState,
        key: &str,
        value: Vec<u8>,
        lease: Option<i64>,
    ) -> Result<i64> {
        if let Some(id) = lease {
            let l = st.leases.get_mut(&id).ok_or(ControlError::LeaseLost(id))?;
            l.keys.insert(key.to_string());
        }
        if let Some(old) = st.kv.insert(
            key.to_string(),
            Entry {
                value: value.clone(),
                lease,
            },
        ) {
            if let Some(old_lease) = old.lease.filter(|l| Some(*l) != lease) {
                if let Some(l) = st.leases.get_mut(&old_lease) {
                    l.keys.remove(key);
                }
            }
        }
        Ok(self.record(st, key.to_string(), KvChangeKind::Put(value)))
    }
}

#[async_trait]
impl KvStore for MemKv {
    async fn grant_lease(&self, ttl: Duration) -> Result<i64> {
        if ttl.is_zero() {
            return Err(ControlError::Invalid("lease TTL must be positive".into()));
        }
        let mut st = self.lock();
        let id = st.next_lease;
        st.next_lease += 1;
        st.leases.insert(
            id,
            Lease {
                ttl,
                expires: Instant::now() + ttl,
                keys: BTreeSet::new(),
            },
        );
        Ok(id)
    }

    async fn keep_alive(&self, lease: i64) -> Result<()> {
        let mut st = self.lock();
        let l = st
            .leases
            .get_mut(&lease)
            .ok_or(ControlError::LeaseLost(lease))?;
        l.expires = Instant::now() + l.ttl;
        Ok(())
    }

    async fn revoke_lease(&self, lease: i64) -> Result<()> {
        let mut st = self.lock();
        self.drop_lease(&mut st, lease);
        Ok(())
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<i64>) -> Result<i64> {
        let mut st = self.lock();
        self.write(&mut st, key, value, lease)
    }

    async fn create_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: Option<i64>,
    ) -> Result<CasOutcome> {
        let mut st = self.lock();
        if let Some(e) = st.kv.get(key) {
            return Ok(CasOutcome::Exists(e.value.clone()));
        }
        self.write(&mut st, key, value, lease)
            .map(CasOutcome::Created)
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().kv.get(key).map(|e| e.value.clone()))
    }

    async fn list(&self, prefix: &str) -> Result<(i64, Vec<(String, Vec<u8>)>)> {
        let st = self.lock();
        let kvs = st
            .kv
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, e)| (k.clone(), e.value.clone()))
            .collect();
        Ok((st.revision, kvs))
    }

    async fn delete_if(&self, key: &str, value: &[u8]) -> Result<bool> {
        let mut st = self.lock();
        if st.kv.get(key).is_none_or(|e| e.value != value) {
            return Ok(false);
        }
        if let Some(e) = st.kv.remove(key) {
            if let Some(l) = e.lease.and_then(|l| st.leases.get_mut(&l)) {
                l.keys.remove(key);
            }
        }
        self.record(&mut st, key.to_string(), KvChangeKind::Delete);
        Ok(true)
    }

    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<WatchStream<KvChange>> {
        {
            let st = self.lock();
            if let Some(oldest) = st.history.front() {
                if from_revision < oldest.revision && st.history.len() >= HISTORY_KEPT {
                    return Err(ControlError::Compacted(from_revision));
                }
            }
        }
        let (tx, rx) = mpsc::channel(1024);
        let prefix = prefix.to_string();
        let (state, live_tx) = (self.state.clone(), self.live.clone());
        let task = tokio::spawn(async move {
            let mut next = from_revision.max(1);
            loop {
                let (replay, mut live) = {
                    let st = lock_kv(&state, &live_tx);
                    let replay: Vec<KvChange> = st
                        .history
                        .iter()
                        .filter(|c| c.revision >= next && c.key.starts_with(&prefix))
                        .cloned()
                        .collect();
                    (replay, live_tx.subscribe())
                };
                for c in replay {
                    next = c.revision + 1;
                    if tx.send(Ok(c)).await.is_err() {
                        return;
                    }
                }
                loop {
                    match live.recv().await {
                        Ok(c) => {
                            if c.revision < next || !c.key.starts_with(&prefix) {
                                continue;
                            }
                            next = c.revision + 1;
                            if tx.send(Ok(c)).await.is_err() {
                                return;
                            }
                        }
                        // Fell behind: replay the missed changes from the history.
                        Err(broadcast::error::RecvError::Lagged(_)) => break,
                        Err(broadcast::error::RecvError::Closed) => return,
                    }
                }
            }
        });
        Ok(WatchStream::new(rx, Some(task)))
    }
}

struct TopicLog {
    base: i64,
    records: VecDeque<(String, Vec<u8>)>,
    end: watch::Sender<i64>,
}

struct StreamState {
    topics: HashMap<String, TopicLog>,
    committed: HashMap<(String, String), i64>,
}

/// An in-process event stream: one partition per topic, records kept up to a cap,
/// committed offsets per consumer group.
pub struct MemEventStream {
    topics: Topics,
    retain: usize,
    state: Arc<Mutex<StreamState>>,
}

impl MemEventStream {
    /// A stream keeping the last `retain` records of each topic.
    pub fn new(topics: Topics, retain: usize) -> Self {
        MemEventStream {
            topics,
            retain: retain.max(1),
            state: Arc::new(Mutex::new(StreamState {
                topics: HashMap::new(),
                committed: HashMap::new(),
            })),
        }
    }
}

impl Default for MemEventStream {
    fn default() -> Self {
        MemEventStream::new(Topics::default(), 1 << 20)
    }
}

fn lock_state(s: &Mutex<StreamState>) -> MutexGuard<'_, StreamState> {
    kvfleet_core::sync::lock(s)
}

fn topic_log<'a>(st: &'a mut StreamState, name: &str) -> &'a mut TopicLog {
    st.topics
        .entry(name.to_string())
        .or_insert_with(|| TopicLog {
            base: 0,
            records: VecDeque::new(),
            end: watch::channel(0).0,
        })
}

#[async_trait]
impl EventStream for MemEventStream {
    async fn publish(&self, topic: Topic, key: &str, payload: Vec<u8>) -> Result<(i32, i64)> {
        let mut st = lock_state(&self.state);
        let log = topic_log(&mut st, self.topics.name(topic));
        let offset = log.base + log.records.len() as i64;
        log.records.push_back((key.to_string(), payload));
        while log.records.len() > self.retain {
            log.records.pop_front();
            log.base += 1;
        }
        log.end.send_replace(offset + 1);
        Ok((0, offset))
    }

    async fn subscribe(
        &self,
        topic: Topic,
        group: &str,
        start: StartAt,
    ) -> Result<Box<dyn Subscription>> {
        let name = self.topics.name(topic).to_string();
        let mut st = lock_state(&self.state);
        let committed = st
            .committed
            .get(&(name.clone(), group.to_string()))
            .copied();
        let log = topic_log(&mut st, &name);
        let end = log.base + log.records.len() as i64;
        let position = committed.unwrap_or(match start {
            StartAt::Earliest => log.base,
            StartAt::Latest => end,
        });
        let end_rx = log.end.subscribe();
        Ok(Box::new(MemSubscription {
            state: self.state.clone(),
            topic: name,
            group: group.to_string(),
            position,
            end_rx,
        }))
    }
}

struct MemSubscription {
    state: Arc<Mutex<StreamState>>,
    topic: String,
    group: String,
    position: i64,
    end_rx: watch::Receiver<i64>,
}

#[async_trait]
impl Subscription for MemSubscription {
    async fn next(&mut self, wait: Duration) -> Result<Option<Record>> {
        let deadline = Instant::now() + wait;
        loop {
            {
                let mut st = lock_state(&self.state);
                let log = topic_log(&mut st, &self.topic);
                self.position = self.position.max(log.base);
                let i = (self.position - log.base) as usize;
                if let Some((key, payload)) = log.records.get(i) {
                    let rec = Record {
                        key: key.clone(),
                        payload: payload.clone(),
                        partition: 0,
                        offset: self.position,
                    };
                    self.position += 1;
                    return Ok(Some(rec));
                }
                self.end_rx.mark_unchanged();
            }
            match tokio::time::timeout_at(deadline, self.end_rx.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return Err(ControlError::Closed),
                Err(_) => return Ok(None),
            }
        }
    }

    async fn commit(&mut self, record: &Record) -> Result<()> {
        let mut st = lock_state(&self.state);
        st.committed
            .insert((self.topic.clone(), self.group.clone()), record.offset + 1);
        Ok(())
    }
}
