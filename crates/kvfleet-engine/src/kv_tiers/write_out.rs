//! Write-out: copies of the device blocks the pool will evict soon, made on a thread
//! of their own while the engine steps.
//!
//! The engine's write-behind must hold a copy of every cached block the next step
//! could evict before that step allocates. Copying them on the engine thread puts the
//! copy on the step's critical path. So the engine asks this thread, a step ahead, for
//! the blocks just behind that horizon; by the time they reach it their copies have
//! usually landed, and the engine only lands them into the host tier (a move, not a
//! copy). A block whose copy has not landed when it reaches the horizon is copied on
//! the engine thread as before, so a slow or stuck write-out never loses a block.
//!
//! The thread copies through a [`BlockExporter`], which drops any block evicted while
//! it was being copied, so a copy is never torn. At most [`JOBS_IN_FLIGHT`] requests
//! wait or run, each of at most one horizon of blocks: the copies in memory are
//! bounded in bytes by that many horizons of blocks.

use super::KvBlockPayload;
use crate::block_export::BlockExporter;
use kvfleet_core::{BlockHash, BlockHashMap};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Requests queued or being copied; a request beyond them is dropped (the engine
/// thread copies those blocks itself if they reach the horizon).
pub const JOBS_IN_FLIGHT: usize = 2;

struct Job {
    epoch: u64,
    hashes: Vec<BlockHash>,
}

struct Landed {
    epoch: u64,
    asked: Vec<BlockHash>,
    blocks: Vec<KvBlockPayload>,
}

/// The write-out thread and the engine's view of what it was asked for.
pub struct WriteOut {
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Landed>,
    /// Hashes asked for and not landed yet, so a block is asked for once.
    pending: BlockHashMap<()>,
    /// Bumped when the cache is cleared: copies asked for before are dropped.
    epoch: u64,
    thread: Option<JoinHandle<()>>,
}

impl WriteOut {
    /// Starts the thread, copying through `exporter`.
    pub fn spawn(exporter: BlockExporter) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::sync_channel::<Job>(JOBS_IN_FLIGHT - 1);
        let (tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kv-write-out".into())
            .spawn(move || {
                for job in rx {
                    // A failed copy lands as nothing: those blocks are copied on the
                    // engine thread if they reach the horizon.
                    let blocks = exporter.copy_each(&job.hashes).unwrap_or_default();
                    let landed = Landed {
                        epoch: job.epoch,
                        asked: job.hashes,
                        blocks,
                    };
                    if tx.send(landed).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Self {
            jobs: Some(jobs),
            done,
            pending: BlockHashMap::default(),
            epoch: 0,
            thread: Some(thread),
        })
    }

    /// Asks for copies of those of `hashes` not asked for already. When the thread is
    /// still busy with earlier requests the request is dropped: blocks that reach the
    /// horizon uncopied are copied on the engine thread.
    pub fn request(&mut self, hashes: impl IntoIterator<Item = BlockHash>) {
        let hashes: Vec<BlockHash> = hashes
            .into_iter()
            .filter(|h| !self.pending.contains_key(h))
            .collect();
        let Some(jobs) = self.jobs.as_ref().filter(|_| !hashes.is_empty()) else {
            return;
        };
        self.pending.extend(hashes.iter().map(|&h| (h, ())));
        let job = Job {
            epoch: self.epoch,
            hashes,
        };
        if let Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) = jobs.try_send(job) {
            for h in job.hashes {
                self.pending.remove(&h);
            }
        }
    }

    /// The copies finished since the last call (without waiting for any).
    pub fn land(&mut self) -> Vec<KvBlockPayload> {
        let mut out = Vec::new();
        while let Ok(l) = self.done.try_recv() {
            out.extend(self.accept(l));
        }
        out
    }

    /// Waits up to `timeout` for every copy asked for to finish, and returns them (the
    /// landed ones, should time run out). For tests, benchmarks and shutdown.
    pub fn wait_idle(&mut self, timeout: Duration) -> (Vec<KvBlockPayload>, bool) {
        let deadline = Instant::now() + timeout;
        let mut out = self.land();
        while !self.pending.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(l) => out.extend(self.accept(l)),
                Err(_) => return (out, false),
            }
        }
        (out, true)
    }

    fn accept(&mut self, l: Landed) -> Vec<KvBlockPayload> {
        if l.epoch != self.epoch {
            return Vec::new();
        }
        for h in &l.asked {
            self.pending.remove(h);
        }
        l.blocks
    }

    /// Forgets every request: copies asked for before the cache was cleared are
    /// dropped when they land.
    pub fn reset(&mut self) {
        self.epoch += 1;
        self.pending.clear();
    }
}

impl Drop for WriteOut {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the copy in progress.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
