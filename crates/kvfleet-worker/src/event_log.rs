//! The worker's KV event log: the engine's event sink, a bounded ring of recent events
//! for replay, and live fan-out to `KvEvents` subscribers.
//!
//! A subscriber asks for events from a sequence number on. It gets the ring's events
//! from there, then live ones, with no gap and no duplicate at the hand-over: the
//! replay snapshot and the live subscription are taken under the same lock that
//! [`EventLog::publish`] holds while it appends and broadcasts. A subscriber that falls
//! behind the live buffer continues from the ring if its next event is still there;
//! otherwise its stream ends with an error telling it to resync. No event is ever
//! skipped silently.
//!
//! The log also carries the engine's current load ([`EventLog::publish_load`]): each
//! batch takes it along when it changed, and a stream sends it alone when it changed
//! with no event to carry it, at most every [`LOAD_PUSH_INTERVAL`]. A router polls
//! load every 100 ms; a poll taken mid-request would otherwise show the worker busy
//! with work that has ended until the next one, and steer requests away from it.

use crate::convert;
use futures::Stream;
use kvfleet_core::BlockHash;
use kvfleet_engine::{DumpedBlock, KvEvent, KvEventKind, KvEventSink, Medium};
use kvfleet_proto::v1::{KvEventBatch, LoadResponse};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tonic::Status;

/// Most events sent in one `KvEventBatch`.
const MAX_BATCH: usize = 256;

/// Shortest time between two loads one stream sends: an engine steps every few
/// milliseconds, and each step changes its load.
pub const LOAD_PUSH_INTERVAL: Duration = Duration::from_millis(10);

/// The engine's load as published, stamped with the last event before it.
type PublishedLoad = Option<Arc<LoadResponse>>;

/// Whether two loads have the same current-load fields (the stamps aside).
fn same_load(a: &LoadResponse, b: &LoadResponse) -> bool {
    let fields = |l: &LoadResponse| {
        (
            l.running,
            l.waiting,
            l.queued_prefill_tokens,
            l.free_blocks,
            l.cached_blocks,
            l.total_blocks,
        )
    };
    fields(a) == fields(b)
}

/// Why a subscription cannot start at the requested sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubscribeError {
    /// The event was dropped from the ring; `oldest` is the oldest one still held.
    TooOld {
        /// Sequence number asked for.
        from_seq: u64,
        /// Oldest event still in the ring (the next one to be published when empty).
        oldest: u64,
    },
    /// The event has not happened yet: the subscriber saw a previous incarnation of
    /// this worker (sequence numbers restart at 1 with the process).
    Ahead {
        /// Sequence number asked for.
        from_seq: u64,
        /// The next sequence number this worker will publish.
        next: u64,
    },
}

impl std::fmt::Display for SubscribeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubscribeError::TooOld { from_seq, oldest } => write!(
                f,
                "KV event {from_seq} is no longer in this worker's event ring (oldest held: \
                 {oldest}); resync with CacheDump and resume from its seq + 1"
            ),
            SubscribeError::Ahead { from_seq, next } => write!(
                f,
                "KV event {from_seq} is ahead of this worker (next event: {next}); the worker \
                 probably restarted: resync with CacheDump and resume from its seq + 1"
            ),
        }
    }
}

impl From<SubscribeError> for Status {
    fn from(e: SubscribeError) -> Self {
        Status::out_of_range(e.to_string())
    }
}

struct Ring {
    events: VecDeque<Arc<KvEvent>>,
    capacity: usize,
    last_seq: u64,
    /// Every cached block ((hash, tier) → parent) as the events up to `cached_seq`
    /// describe it: `CacheDump` answers from here instead of waiting for the engine thread.
    cached: HashMap<(BlockHash, Medium), Option<BlockHash>>,
    /// The last event applied to `cached`. The engine numbers its events 1, 2, 3...;
    /// an event out of that sequence is forwarded but not applied, so the dump (what a
    /// router resyncs from after a gap) stays the engine's own state.
    cached_seq: u64,
}

impl Ring {
    fn apply(&mut self, kind: &KvEventKind) {
        match kind {
            KvEventKind::Stored {
                parent_hash,
                block_hashes,
                medium,
            } => {
                let mut parent = *parent_hash;
                for &h in block_hashes {
                    self.cached.insert((h, *medium), parent);
                    parent = Some(h);
                }
            }
            KvEventKind::Removed {
                block_hashes,
                medium,
            } => {
                for h in block_hashes {
                    self.cached.remove(&(*h, *medium));
                }
            }
            KvEventKind::Cleared => self.cached.clear(),
        }
    }
}

/// The engine's [`KvEventSink`]: keeps the last `capacity` events and forwards every
/// event to live subscribers.
pub struct EventLog {
    worker_id: String,
    ring: Mutex<Ring>,
    live: broadcast::Sender<Arc<KvEvent>>,
    load: watch::Sender<PublishedLoad>,
}

impl EventLog {
    /// A log keeping `capacity` events, buffering up to `subscriber_buffer` live events
    /// per subscriber. Both are raised to at least 1.
    pub fn new(worker_id: impl Into<String>, capacity: usize, subscriber_buffer: usize) -> Self {
        let capacity = capacity.max(1);
        let (live, _) = broadcast::channel(subscriber_buffer.max(1));
        EventLog {
            worker_id: worker_id.into(),
            ring: Mutex::new(Ring {
                events: VecDeque::with_capacity(capacity.min(4096)),
                capacity,
                last_seq: 0,
                cached: HashMap::new(),
                cached_seq: 0,
            }),
            live,
            load: watch::Sender::new(None),
        }
    }

    /// Publishes the engine's current load (its current-load fields, as
    /// `KvEventBatch.load` describes them), stamped with the last event published
    /// before it. Subscribers are woken only when it changed.
    pub fn publish_load(&self, mut load: LoadResponse) {
        // Stamped under the ring's lock: every event up to the stamp has been sent to
        // the live subscribers, none after it.
        let ring = self.lock();
        load.last_event_seq = ring.last_seq;
        // An unchanged load keeps its first `load_seq`: the state it describes has
        // held since, so it still orders right against any poll taken meanwhile.
        self.load.send_if_modified(|cur| {
            let changed = !cur
                .as_deref()
                .is_some_and(|c| same_load(c, &load) && c.last_event_seq == load.last_event_seq);
            if changed {
                *cur = Some(Arc::new(load));
            }
            changed
        });
    }

    /// The worker id stamped on every batch.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Sequence number of the last event published (0 before any).
    pub fn last_seq(&self) -> u64 {
        self.lock().last_seq
    }

    /// Sequence number of the oldest event still held (the next one when none is).
    pub fn oldest_seq(&self) -> u64 {
        let ring = self.lock();
        ring.events.front().map_or(ring.last_seq + 1, |e| e.seq)
    }

    /// Every cached block (hash, parent, tier) and the last event sequence number the
    /// list reflects, taken together.
    pub fn cache_dump(&self) -> (u64, Vec<DumpedBlock>) {
        let ring = self.lock();
        (
            ring.cached_seq,
            ring.cached
                .iter()
                .map(|(&(hash, medium), &parent)| DumpedBlock {
                    hash,
                    parent,
                    medium,
                })
                .collect(),
        )
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        kvfleet_core::sync::lock(&self.ring)
    }

    /// Starts a subscription at `from_seq` (inclusive; 0 means 1): the events still in
    /// the ring from there, and a live receiver positioned right after them.
    pub fn subscribe(&self, from_seq: u64) -> Result<Subscription, SubscribeError> {
        let from = from_seq.max(1);
        let ring = self.lock();
        let next = ring.last_seq + 1;
        if from > next {
            return Err(SubscribeError::Ahead {
                from_seq: from,
                next,
            });
        }
        let oldest = ring.events.front().map_or(next, |e| e.seq);
        if from < oldest {
            return Err(SubscribeError::TooOld {
                from_seq: from,
                oldest,
            });
        }
        let start = ring.events.partition_point(|e| e.seq < from);
        let replay: VecDeque<Arc<KvEvent>> = ring.events.range(start..).cloned().collect();
        // Subscribing while holding the lock: every event published after the
        // snapshot above reaches this receiver, and none before it does.
        let live = self.live.subscribe();
        drop(ring);
        Ok(Subscription {
            replay,
            live,
            next_seq: from,
        })
    }

    /// The subscription as a stream of batches for `KvEvents`. It ends when `closing`
    /// turns true (the server is shutting down) with UNAVAILABLE, and with OUT_OF_RANGE
    /// when the subscriber can no longer be served without a gap.
    pub fn into_batches(
        self: Arc<Self>,
        subscription: Subscription,
        closing: watch::Receiver<bool>,
    ) -> impl Stream<Item = Result<KvEventBatch, Status>> + Send + 'static {
        let load = self.load.subscribe();
        let state = BatchState {
            log: self,
            sub: subscription,
            closing,
            done: false,
            load,
            sent_load: None,
            sent_load_at: None,
            push_due: None,
        };
        futures::stream::unfold(state, |mut st| async move {
            if st.done {
                return None;
            }
            let item = st.next_batch().await;
            if item.is_err() {
                st.done = true;
            }
            Some((item, st))
        })
    }
}

impl KvEventSink for EventLog {
    fn publish(&self, event: &KvEvent) {
        let event = Arc::new(event.clone());
        let mut ring = self.lock();
        ring.last_seq = event.seq;
        if event.seq == ring.cached_seq + 1 {
            ring.apply(&event.kind);
            ring.cached_seq = event.seq;
        }
        ring.events.push_back(Arc::clone(&event));
        while ring.events.len() > ring.capacity {
            ring.events.pop_front();
        }
        // Fails only when nobody listens, which is fine.
        let _ = self.live.send(event);
    }
}

/// A position in the event log: events to replay, then a live receiver.
pub struct Subscription {
    replay: VecDeque<Arc<KvEvent>>,
    live: broadcast::Receiver<Arc<KvEvent>>,
    next_seq: u64,
}

impl Subscription {
    /// The sequence number of the next event this subscription yields.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }
}

struct BatchState {
    log: Arc<EventLog>,
    sub: Subscription,
    closing: watch::Receiver<bool>,
    done: bool,
    /// The engine's published load (its sender is `log`'s, so it never closes while
    /// this stream lives).
    load: watch::Receiver<PublishedLoad>,
    /// The last load this stream sent, and when.
    sent_load: Option<Arc<LoadResponse>>,
    sent_load_at: Option<Instant>,
    /// When a changed load held back by [`LOAD_PUSH_INTERVAL`] is due.
    push_due: Option<Instant>,
}

/// What woke a stream waiting for its next batch.
enum Wake {
    Event(Result<Arc<KvEvent>, broadcast::error::RecvError>),
    Load,
}

impl BatchState {
    /// Appends `ev` to `out` if it is the next expected event. Duplicates (which the
    /// hand-over makes impossible, but cost nothing to rule out) are dropped; a gap is
    /// an error.
    fn accept(
        &mut self,
        ev: Arc<KvEvent>,
        out: &mut Vec<kvfleet_proto::v1::KvEvent>,
    ) -> Result<(), Status> {
        if ev.seq < self.sub.next_seq {
            return Ok(());
        }
        if ev.seq > self.sub.next_seq {
            return Err(Status::out_of_range(format!(
                "KV event stream gap: expected event {}, got {}; resync with CacheDump",
                self.sub.next_seq, ev.seq
            )));
        }
        self.sub.next_seq += 1;
        out.push(convert::kv_event(&ev));
        Ok(())
    }

    /// A batch of `events`, with the load when it changed and was taken after them.
    fn batch(&mut self, events: Vec<kvfleet_proto::v1::KvEvent>) -> KvEventBatch {
        let last = events.last().map_or(0, |e| e.seq);
        let load = self
            .load
            .borrow()
            .clone()
            .filter(|l| l.last_event_seq >= last && !self.already_sent(l));
        if let Some(l) = &load {
            self.sent(l.clone());
        }
        KvEventBatch {
            worker_id: self.log.worker_id.clone(),
            events,
            load: load.map(|l| LoadResponse::clone(&l)),
        }
    }

    fn already_sent(&self, load: &LoadResponse) -> bool {
        self.sent_load
            .as_deref()
            .is_some_and(|s| same_load(s, load))
    }

    fn sent(&mut self, load: Arc<LoadResponse>) {
        self.sent_load = Some(load);
        self.sent_load_at = Some(Instant::now());
        self.push_due = None;
    }

    /// The load alone, if it changed since this stream last sent one and
    /// [`LOAD_PUSH_INTERVAL`] has passed since; otherwise `None`, with the push
    /// scheduled for when the interval ends.
    fn load_push(&mut self) -> Option<KvEventBatch> {
        let current = self.load.borrow_and_update().clone()?;
        if self.already_sent(&current) {
            self.push_due = None;
            return None;
        }
        let due = self
            .sent_load_at
            .map_or_else(Instant::now, |t| t + LOAD_PUSH_INTERVAL);
        if Instant::now() < due {
            self.push_due = Some(due);
            return None;
        }
        self.sent(current.clone());
        Some(KvEventBatch {
            worker_id: self.log.worker_id.clone(),
            events: Vec::new(),
            load: Some(LoadResponse::clone(&current)),
        })
    }

    /// Re-reads the ring from the next expected event after the live receiver lagged.
    fn recover(&mut self) -> Result<(), Status> {
        match self.log.subscribe(self.sub.next_seq) {
            Ok(sub) => {
                self.sub = sub;
                Ok(())
            }
            Err(e) => Err(Status::out_of_range(format!(
                "this KvEvents subscriber fell behind: {e}"
            ))),
        }
    }

    async fn next_batch(&mut self) -> Result<KvEventBatch, Status> {
        loop {
            if *self.closing.borrow() {
                return Err(Status::unavailable("the worker is shutting down"));
            }
            let mut out = Vec::new();
            while out.len() < MAX_BATCH {
                let Some(ev) = self.sub.replay.pop_front() else {
                    break;
                };
                self.accept(ev, &mut out)?;
            }
            if !out.is_empty() {
                return Ok(self.batch(out));
            }
            let push_due = self.push_due;
            let wake = tokio::select! {
                biased;
                _ = self.closing.wait_for(|c| *c) => {
                    return Err(Status::unavailable("the worker is shutting down"));
                }
                r = self.sub.live.recv() => Wake::Event(r),
                _ = self.load.changed() => Wake::Load,
                _ = tokio::time::sleep_until(push_due.unwrap_or_else(Instant::now)), if push_due.is_some() => Wake::Load,
            };
            let first = match wake {
                Wake::Event(r) => r,
                Wake::Load => match self.load_push() {
                    Some(b) => return Ok(b),
                    None => continue,
                },
            };
            match first {
                Ok(ev) => self.accept(ev, &mut out)?,
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.recover()?;
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(Status::unavailable("the worker's event log closed"));
                }
            }
            // Batch whatever else is already buffered.
            while out.len() < MAX_BATCH {
                match self.sub.live.try_recv() {
                    Ok(ev) => self.accept(ev, &mut out)?,
                    Err(broadcast::error::TryRecvError::Lagged(_)) => {
                        // Send what we have; the next call replays from the ring.
                        self.recover()?;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if !out.is_empty() {
                return Ok(self.batch(out));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use kvfleet_core::BlockHash;
    use kvfleet_engine::KvEventKind;
    use kvfleet_proto::v1::kv_event::Kind;

    fn ev(seq: u64) -> KvEvent {
        KvEvent {
            seq,
            kind: KvEventKind::Removed {
                medium: Default::default(),
                block_hashes: vec![BlockHash(seq)],
            },
        }
    }

    fn seqs(b: &KvEventBatch) -> Vec<u64> {
        b.events.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn subscribe_bounds() {
        let log = EventLog::new("w", 4, 8);
        assert!(log.subscribe(0).is_ok());
        assert!(log.subscribe(1).is_ok());
        assert_eq!(
            log.subscribe(2).err(),
            Some(SubscribeError::Ahead {
                from_seq: 2,
                next: 1
            })
        );
        for s in 1..=6 {
            log.publish(&ev(s));
        }
        assert_eq!(log.oldest_seq(), 3);
        assert_eq!(log.last_seq(), 6);
        assert!(matches!(
            log.subscribe(2),
            Err(SubscribeError::TooOld { oldest: 3, .. })
        ));
        let sub = log.subscribe(4).unwrap();
        assert_eq!(
            sub.replay.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![4, 5, 6]
        );
        assert!(log.subscribe(7).is_ok());
        assert!(log.subscribe(8).is_err());
    }

    #[tokio::test]
    async fn replay_then_live_without_gaps() {
        let log = Arc::new(EventLog::new("w", 100, 8));
        for s in 1..=3 {
            log.publish(&ev(s));
        }
        let (_tx, closing) = watch::channel(false);
        let sub = log.subscribe(2).unwrap();
        let mut stream = Box::pin(Arc::clone(&log).into_batches(sub, closing));
        let b = stream.next().await.unwrap().unwrap();
        assert_eq!(b.worker_id, "w");
        assert_eq!(seqs(&b), vec![2, 3]);
        assert!(matches!(b.events[0].kind, Some(Kind::Removed(_))));
        log.publish(&ev(4));
        log.publish(&ev(5));
        let b = stream.next().await.unwrap().unwrap();
        assert_eq!(seqs(&b), vec![4, 5]);
    }

    #[tokio::test]
    async fn lagging_subscriber_recovers_from_the_ring_or_is_told_to_resync() {
        let log = Arc::new(EventLog::new("w", 10, 2));
        let (_tx, closing) = watch::channel(false);
        let sub = log.subscribe(1).unwrap();
        let mut stream = Box::pin(Arc::clone(&log).into_batches(sub, closing.clone()));
        for s in 1..=6 {
            log.publish(&ev(s));
        }
        let mut got = Vec::new();
        while got.len() < 6 {
            got.extend(seqs(&stream.next().await.unwrap().unwrap()));
        }
        assert_eq!(got, (1..=6).collect::<Vec<_>>());

        // Now lag past the ring too: the stream must end with OUT_OF_RANGE.
        let sub = log.subscribe(7).unwrap();
        let mut stream = Box::pin(Arc::clone(&log).into_batches(sub, closing));
        for s in 7..=30 {
            log.publish(&ev(s));
        }
        let err = stream.next().await.unwrap().unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange);
        assert!(err.message().contains("resync"), "{}", err.message());
        assert!(stream.next().await.is_none());
    }

    #[tokio::test]
    async fn closing_ends_the_stream() {
        let log = Arc::new(EventLog::new("w", 10, 2));
        let (tx, closing) = watch::channel(false);
        let sub = log.subscribe(1).unwrap();
        let mut stream = Box::pin(Arc::clone(&log).into_batches(sub, closing));
        let waiter = tokio::spawn(async move { stream.next().await.map(|r| r.map(|_| ())) });
        tx.send(true).unwrap();
        let r = waiter.await.unwrap().unwrap();
        assert_eq!(r.unwrap_err().code(), tonic::Code::Unavailable);
    }

    fn load(running: u32, queued: u64, load_seq: u64) -> LoadResponse {
        LoadResponse {
            running,
            queued_prefill_tokens: queued,
            total_blocks: 64,
            load_seq,
            ..LoadResponse::default()
        }
    }

    /// The next message within `wait`, if any.
    async fn next_within(
        stream: &mut (impl Stream<Item = Result<KvEventBatch, Status>> + Unpin),
        wait: Duration,
    ) -> Option<KvEventBatch> {
        tokio::time::timeout(wait, stream.next())
            .await
            .ok()
            .map(|b| b.expect("stream open").expect("no error"))
    }

    #[tokio::test]
    async fn a_batch_carries_the_load_taken_after_its_events_and_a_change_follows_alone() {
        let log = Arc::new(EventLog::new("w", 16, 16));
        let (_tx, closing) = watch::channel(false);
        let sub = log.subscribe(1).unwrap();
        let mut stream = Box::pin(Arc::clone(&log).into_batches(sub, closing));
        // A load taken before the events does not ride with them.
        log.publish_load(load(1, 500, 1));
        log.publish(&ev(1));
        let b = next_within(&mut stream, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!((seqs(&b), b.load), (vec![1], None));
        // Taken after them, it is sent alone, stamped with the last event before it.
        log.publish_load(load(1, 100, 2));
        let b = next_within(&mut stream, Duration::from_secs(1))
            .await
            .unwrap();
        assert!(b.events.is_empty());
        let l = b.load.expect("the load");
        assert_eq!(
            (l.queued_prefill_tokens, l.last_event_seq, l.load_seq),
            (100, 1, 2)
        );
        // Taken after the next events, it rides with them.
        log.publish(&ev(2));
        log.publish_load(load(0, 0, 3));
        let b = next_within(&mut stream, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(seqs(&b), vec![2]);
        let l = b.load.expect("the load with the events");
        assert_eq!((l.running, l.last_event_seq, l.load_seq), (0, 2, 3));
        // An unchanged load is not sent again, however often it is published.
        for seq in 4..10 {
            log.publish_load(load(0, 0, seq));
        }
        assert!(next_within(&mut stream, Duration::from_millis(100))
            .await
            .is_none());
    }

    #[tokio::test]
    async fn a_stream_sends_a_changing_load_at_most_once_per_interval_and_always_the_last() {
        let log = Arc::new(EventLog::new("w", 16, 16));
        let (_tx, closing) = watch::channel(false);
        let sub = log.subscribe(1).unwrap();
        let mut stream = Box::pin(Arc::clone(&log).into_batches(sub, closing));
        log.publish_load(load(1, 300, 1));
        let start = Instant::now();
        let first = next_within(&mut stream, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(first.load.unwrap().queued_prefill_tokens, 300);
        // Three changes within the interval: only the last is sent, once it ends.
        log.publish_load(load(1, 200, 2));
        log.publish_load(load(1, 100, 3));
        log.publish_load(load(0, 0, 4));
        let b = next_within(&mut stream, Duration::from_secs(1))
            .await
            .unwrap();
        assert!(
            start.elapsed() >= LOAD_PUSH_INTERVAL,
            "{:?}",
            start.elapsed()
        );
        let l = b.load.unwrap();
        assert_eq!((l.running, l.queued_prefill_tokens, l.load_seq), (0, 0, 4));
        assert!(next_within(&mut stream, Duration::from_millis(100))
            .await
            .is_none());
    }
}
