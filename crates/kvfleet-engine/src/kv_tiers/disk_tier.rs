//! The disk tier: blocks pushed out of the host tier, one checksummed file per block
//! (`<hash>.kvb`, see [`super::block_file`]) in a directory bounded in bytes.
//!
//! All file I/O runs on two threads of the tier's own, a writer and a reader, so the
//! engine's step never waits on the disk:
//! - a write goes to a staging file and is renamed into place, so a reader never sees
//!   a torn block; until the writer confirms it, the payload stays in memory and is
//!   served from there (a block being written out is never lost);
//! - a read is a request; its result arrives later through [`DiskTier::poll`].
//!
//! Writes and deletes of one block go through the one writer queue, in order, so a
//! delete can never overtake the write it undoes. A write that fails for lack of space
//! (ENOSPC, EDQUOT) pauses demotion to disk for a while and is counted; a file that is
//! missing, truncated or fails its checksum reads as a miss and is counted.

use super::block_file::{self, Expected};
use super::KvBlockPayload;
use kvfleet_core::byte_lru::ByteLru;
use kvfleet_core::BlockHash;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Writes waiting for the writer thread at most (each holds one block in memory). The
/// queue itself is unbounded so a delete is never dropped; this bound on the writes in
/// it bounds the deletes too (each follows an eviction, which follows a write).
const WRITE_QUEUE: usize = 64;
/// Reads waiting for the reader thread at most.
const READ_QUEUE: usize = 256;
/// How long demotion to disk pauses after the disk reported itself full.
const FULL_BACKOFF: Duration = Duration::from_secs(1);
/// The staging file every write goes through before its rename.
pub const STAGING_FILE: &str = ".incoming.kvb";

/// How the disk tier is set up.
#[derive(Clone, Debug)]
pub struct DiskTierConfig {
    /// Directory for block files; created if missing, its old `*.kvb` files removed.
    pub dir: PathBuf,
    /// Most bytes of block files kept.
    pub max_bytes: u64,
}

/// Why a disk read produced no block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadFailure {
    /// No such file (deleted, or never written).
    Missing,
    /// The file failed its checks (truncated, checksum, wrong block).
    Corrupt(String),
    /// Another I/O error.
    Io(String),
}

/// One change to what the disk tier holds, for its `Stored`/`Removed` events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskChange {
    /// The writer confirmed this block's file.
    Stored(BlockHash, Option<BlockHash>),
    /// A confirmed block was dropped.
    Removed(BlockHash),
}

/// A finished disk read.
pub type ReadResult = (BlockHash, Result<KvBlockPayload, ReadFailure>);

/// Counters of the disk tier's own trouble, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiskCounters {
    /// Writes refused because the disk was full (or a demotion skipped during the pause).
    pub full: u64,
    /// Writes that failed otherwise.
    pub write_errors: u64,
    /// Demotions dropped because the writer's queue was full.
    pub backlog_drops: u64,
    /// Reads of a missing file.
    pub missing: u64,
    /// Reads of a corrupt file.
    pub corrupt: u64,
    /// Blocks written.
    pub written_blocks: u64,
    /// Bytes written (files, headers included).
    pub written_bytes: u64,
}

enum WriteJob {
    Write { gen: u64, block: KvBlockPayload },
    Delete(BlockHash),
}

enum Done {
    Written {
        hash: BlockHash,
        gen: u64,
        result: Result<u64, std::io::Error>,
    },
    Read(ReadResult),
}

struct Entry {
    parent: Option<BlockHash>,
    gen: u64,
    /// The payload while the writer has not confirmed the file.
    pending: Option<KvBlockPayload>,
}

/// Block files on disk (see the module docs).
pub struct DiskTier {
    index: ByteLru<BlockHash, Entry>,
    writes: Sender<WriteJob>,
    reads: SyncSender<BlockHash>,
    done: Receiver<Done>,
    next_gen: u64,
    full_until: Option<Instant>,
    reads_in_flight: usize,
    writes_in_flight: usize,
    /// Reads that landed while [`DiskTier::flush`] waited, for the next poll.
    landed: Vec<ReadResult>,
    block_bytes: usize,
    /// What changed on disk since the caller last asked, in order (a block evicted
    /// and written again must be reported in that order).
    changes: Vec<DiskChange>,
    counters: DiskCounters,
}

fn is_full(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    ) || matches!(e.raw_os_error(), Some(28) | Some(122))
}

fn file_of(dir: &Path, hash: BlockHash) -> PathBuf {
    dir.join(format!("{:016x}.kvb", hash.0))
}

impl DiskTier {
    /// Opens (and empties of old blocks) `cfg.dir` and starts the I/O threads.
    pub fn open(
        cfg: &DiskTierConfig,
        format: &'static str,
        block_bytes: usize,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(&cfg.dir)?;
        for e in std::fs::read_dir(&cfg.dir)?.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "kvb")
                && p.file_name() != Some(STAGING_FILE.as_ref())
            {
                let _ = std::fs::remove_file(&p);
            }
        }
        let (done_tx, done) = mpsc::channel();
        let (writes, write_rx) = mpsc::channel::<WriteJob>();
        let (reads, read_rx) = mpsc::sync_channel::<BlockHash>(READ_QUEUE);
        let dir = cfg.dir.clone();
        let tx = done_tx.clone();
        std::thread::Builder::new()
            .name("kv-disk-writer".into())
            .spawn(move || {
                for job in write_rx {
                    match job {
                        WriteJob::Write { gen, block } => {
                            let result = write_block(&dir, format, &block);
                            let msg = Done::Written {
                                hash: block.hash,
                                gen,
                                result,
                            };
                            if tx.send(msg).is_err() {
                                break;
                            }
                        }
                        WriteJob::Delete(h) => {
                            let _ = std::fs::remove_file(file_of(&dir, h));
                        }
                    }
                }
            })?;
        let dir = cfg.dir.clone();
        std::thread::Builder::new()
            .name("kv-disk-reader".into())
            .spawn(move || {
                for hash in read_rx {
                    let r = read_block(&dir, format, block_bytes, hash);
                    if done_tx.send(Done::Read((hash, r))).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self {
            index: ByteLru::new(usize::try_from(cfg.max_bytes).unwrap_or(usize::MAX)),
            writes,
            reads,
            done,
            next_gen: 0,
            full_until: None,
            reads_in_flight: 0,
            writes_in_flight: 0,
            landed: Vec::new(),
            block_bytes,
            changes: Vec::new(),
            counters: DiskCounters::default(),
        })
    }

    /// Whether `hash` is on disk or being written there.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.index.contains(&hash)
    }

    /// The payload of a block still being written, if `hash` is one (no disk read).
    pub fn pending(&mut self, hash: BlockHash) -> Option<KvBlockPayload> {
        self.index.get(&hash).and_then(|e| e.pending.clone())
    }

    /// Queues a block for writing; returns whether it was taken. Never blocks: a full
    /// queue or a disk that just reported itself full drops the demotion (counted).
    pub fn demote(&mut self, block: KvBlockPayload) -> bool {
        if self.index.contains(&block.hash) {
            self.index.get(&block.hash);
            return true;
        }
        if self.full_until.is_some_and(|t| Instant::now() < t) {
            self.counters.full += 1;
            return false;
        }
        let size = self.file_size();
        if size > self.index.max_bytes() {
            return false;
        }
        let gen = self.next_gen;
        self.next_gen += 1;
        let job = WriteJob::Write {
            gen,
            block: block.clone(),
        };
        if self.writes_in_flight >= WRITE_QUEUE || self.writes.send(job).is_err() {
            self.counters.backlog_drops += 1;
            return false;
        }
        self.writes_in_flight += 1;
        while self.index.bytes() + size > self.index.max_bytes() {
            let Some((h, e)) = self.index.pop_lru() else {
                break;
            };
            self.forget(h, e);
        }
        let entry = Entry {
            parent: block.parent,
            gen,
            pending: Some(block.clone()),
        };
        self.index.insert(block.hash, entry, size);
        true
    }

    /// Asks the reader thread for a block; the result comes through [`DiskTier::poll`].
    /// Returns false when the block is not on disk or the read queue is full.
    pub fn request(&mut self, hash: BlockHash) -> bool {
        let Some(e) = self.index.get(&hash) else {
            return false;
        };
        if e.pending.is_some() {
            // Still in memory: the caller takes it through `pending`.
            return false;
        }
        if self.reads.try_send(hash).is_err() {
            return false;
        }
        self.reads_in_flight += 1;
        true
    }

    /// Reads requested and not yet returned by [`DiskTier::poll`].
    pub fn reads_in_flight(&self) -> usize {
        self.reads_in_flight
    }

    /// Collects finished writes and reads; waits up to `wait` for the first one when
    /// nothing is ready and a read is in flight (so an engine with nothing else to do
    /// sleeps on its disk instead of spinning).
    pub fn poll(&mut self, wait: Duration) -> Vec<ReadResult> {
        let mut first = if wait.is_zero() || self.reads_in_flight == 0 || !self.landed.is_empty() {
            self.done.try_recv().ok()
        } else {
            self.done.recv_timeout(wait).ok()
        };
        while let Some(msg) = first.take().or_else(|| self.done.try_recv().ok()) {
            self.handle(msg);
        }
        std::mem::take(&mut self.landed)
    }

    /// Waits (up to `timeout`) until every queued write has landed or failed; for
    /// tests, benchmarks and an orderly shutdown. Returns whether none is left.
    pub fn flush(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.writes_in_flight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.done.recv_timeout(left) {
                Ok(msg) => self.handle(msg),
                Err(_) => return false,
            }
        }
        true
    }

    fn handle(&mut self, msg: Done) {
        match msg {
            Done::Written { hash, gen, result } => {
                self.writes_in_flight = self.writes_in_flight.saturating_sub(1);
                self.written(hash, gen, result);
            }
            Done::Read((hash, r)) => {
                self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
                match &r {
                    Err(ReadFailure::Missing) => self.counters.missing += 1,
                    Err(ReadFailure::Corrupt(_)) => self.counters.corrupt += 1,
                    _ => {}
                }
                if r.is_err() {
                    // Not usable: forget it so nobody asks for it again.
                    if let Some(e) = self.index.remove(&hash) {
                        self.forget(hash, e);
                    }
                }
                self.landed.push((hash, r));
            }
        }
    }

    fn written(&mut self, hash: BlockHash, gen: u64, result: Result<u64, std::io::Error>) {
        let current = self.index.peek(&hash).is_some_and(|e| e.gen == gen);
        match result {
            Ok(bytes) => {
                self.counters.written_blocks += 1;
                self.counters.written_bytes += bytes;
                if current {
                    if let Some(e) = self.index.get_mut(&hash) {
                        e.pending = None;
                        self.changes.push(DiskChange::Stored(hash, e.parent));
                    }
                }
            }
            Err(e) => {
                if is_full(&e) {
                    self.counters.full += 1;
                    self.full_until = Some(Instant::now() + FULL_BACKOFF);
                } else {
                    self.counters.write_errors += 1;
                }
                if current {
                    self.index.remove(&hash);
                }
            }
        }
    }

    /// Drops an entry the LRU or a failed read pushed out: delete its file (queued
    /// behind its write), and report it removed if it had been reported stored.
    fn forget(&mut self, hash: BlockHash, e: Entry) {
        let _ = self.writes.send(WriteJob::Delete(hash));
        if e.pending.is_none() {
            self.changes.push(DiskChange::Removed(hash));
        }
    }

    fn file_size(&self) -> usize {
        self.block_bytes + 64
    }

    /// Forgets every block and deletes its file (no `Removed` events: the caller
    /// reports a `Cleared`).
    pub fn clear(&mut self) {
        while let Some((h, _)) = self.index.pop_lru() {
            let _ = self.writes.send(WriteJob::Delete(h));
        }
        self.changes.clear();
    }

    /// What changed since the last call, in order (for the tier's events).
    pub fn take_changes(&mut self) -> Vec<DiskChange> {
        std::mem::take(&mut self.changes)
    }

    /// Blocks confirmed on disk, for a cache dump.
    pub fn blocks(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        self.index
            .iter()
            .filter(|(_, e)| e.pending.is_none())
            .map(|(h, e)| (*h, e.parent))
            .collect()
    }

    /// Blocks held (written or being written).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes of block files held.
    pub fn bytes(&self) -> usize {
        self.index.bytes()
    }

    /// Trouble counters.
    pub fn counters(&self) -> &DiskCounters {
        &self.counters
    }
}

fn write_block(dir: &Path, format: &str, block: &KvBlockPayload) -> Result<u64, std::io::Error> {
    use std::io::Write;
    let bytes = block_file::encode(block.hash, block.parent, format, &block.bytes);
    let staging = dir.join(STAGING_FILE);
    let mut f = std::fs::File::create(&staging)?;
    f.write_all(&bytes)?;
    f.flush()?;
    drop(f);
    std::fs::rename(&staging, file_of(dir, block.hash))?;
    Ok(bytes.len() as u64)
}

fn read_block(
    dir: &Path,
    format: &'static str,
    len: usize,
    hash: BlockHash,
) -> Result<KvBlockPayload, ReadFailure> {
    let bytes = match std::fs::read(file_of(dir, hash)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ReadFailure::Missing),
        Err(e) => return Err(ReadFailure::Io(e.to_string())),
    };
    let want = Expected { hash, format, len };
    let (parent, payload) =
        block_file::decode(&bytes, want).map_err(|e| ReadFailure::Corrupt(e.to_string()))?;
    Ok(KvBlockPayload {
        hash,
        parent,
        bytes: Arc::from(payload),
    })
}
