//! Control-plane wrappers whose first watch the test breaks on demand: the stream
//! stays silent (as a cut connection may) until [`FirstWatch::fail`] ends it with an
//! error, so a test can change the store while the router is not watching. Later
//! watches go to the wrapped implementation.

#![allow(dead_code)]

use async_trait::async_trait;
use kvfleet_control::{
    ControlError, MemberEvent, MemberSnapshot, Membership, Placement, PlacementEvent, PlacementKey,
    Registration, Result, WatchStream, WorkerRecord,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// The first watch of a wrapper, held silent until failed.
pub struct FirstWatch<T> {
    tx: Mutex<Option<mpsc::Sender<Result<T>>>>,
    taken: Mutex<bool>,
    watches: AtomicUsize,
}

impl<T> Default for FirstWatch<T> {
    fn default() -> Self {
        FirstWatch {
            tx: Mutex::new(None),
            taken: Mutex::new(false),
            watches: AtomicUsize::new(0),
        }
    }
}

impl<T: Send + 'static> FirstWatch<T> {
    /// The silent stream for the first call, `None` for later ones.
    fn take(&self) -> Option<WatchStream<T>> {
        self.watches.fetch_add(1, Ordering::SeqCst);
        let mut taken = self.taken.lock().unwrap();
        if *taken {
            return None;
        }
        *taken = true;
        let (tx, rx) = mpsc::channel(1);
        *self.tx.lock().unwrap() = Some(tx);
        Some(WatchStream::new(rx, None))
    }

    /// Ends the first watch with an error (and closes it).
    pub async fn fail(&self) {
        let tx = self
            .tx
            .lock()
            .unwrap()
            .take()
            .expect("the first watch was made");
        let _ = tx.send(Err(ControlError::Closed)).await;
    }

    /// Watches made so far.
    pub fn watches(&self) -> usize {
        self.watches.load(Ordering::SeqCst)
    }
}

/// A [`Membership`] whose first watch fails on demand.
pub struct FlakyMembership<M> {
    /// The real membership.
    pub inner: M,
    /// Its first watch.
    pub first: FirstWatch<MemberEvent>,
}

impl<M> FlakyMembership<M> {
    /// Wraps `inner`.
    pub fn new(inner: M) -> Arc<Self> {
        Arc::new(FlakyMembership {
            inner,
            first: FirstWatch::default(),
        })
    }
}

#[async_trait]
impl<M: Membership> Membership for FlakyMembership<M> {
    async fn register(&self, worker: &WorkerRecord, ttl: Duration) -> Result<Registration> {
        self.inner.register(worker, ttl).await
    }
    async fn list(&self) -> Result<MemberSnapshot> {
        self.inner.list().await
    }
    async fn watch(&self, from_revision: i64) -> Result<WatchStream<MemberEvent>> {
        match self.first.take() {
            Some(w) => Ok(w),
            None => self.inner.watch(from_revision).await,
        }
    }
}

/// A [`Placement`] whose first watch fails on demand.
pub struct FlakyPlacement<P> {
    /// The real placement.
    pub inner: P,
    /// Its first watch.
    pub first: FirstWatch<PlacementEvent>,
}

impl<P> FlakyPlacement<P> {
    /// Wraps `inner`.
    pub fn new(inner: P) -> Arc<Self> {
        Arc::new(FlakyPlacement {
            inner,
            first: FirstWatch::default(),
        })
    }
}

#[async_trait]
impl<P: Placement> Placement for FlakyPlacement<P> {
    async fn place(&self, key: &PlacementKey, worker: &str, ttl: Duration) -> Result<String> {
        self.inner.place(key, worker, ttl).await
    }
    async fn owner(&self, key: &PlacementKey) -> Result<Option<String>> {
        self.inner.owner(key).await
    }
    async fn list(&self) -> Result<(i64, Vec<(PlacementKey, String)>)> {
        self.inner.list().await
    }
    async fn watch(&self, from_revision: i64) -> Result<WatchStream<PlacementEvent>> {
        match self.first.take() {
            Some(w) => Ok(w),
            None => self.inner.watch(from_revision).await,
        }
    }
    async fn release_worker(&self, worker: &str) -> Result<usize> {
        self.inner.release_worker(worker).await
    }
}
