//! The messages between the gRPC handlers and the engine thread: the commands, their
//! replies, and the handlers' end of the bounded command queue.

use kvfleet_core::TokenId;
use kvfleet_engine::{EngineLoad, EngineStats, SamplingParams, TierStats};
use kvfleet_proto::v1 as pb;
use std::sync::mpsc::{self, SyncSender};
use std::time::Instant;
use tokio::sync::{mpsc as tmpsc, oneshot};
use tonic::Status;

/// Where a `Generate` call's (or one fork child's) messages go.
pub(crate) type StreamSender = tmpsc::Sender<Result<pb::GenerateResponse, Status>>;

/// A validated `Generate` call, on its way to the engine.
pub(crate) struct GenerateCommand {
    /// The caller's request id (empty: the engine thread assigns one).
    pub request_id: String,
    /// Prompt token ids.
    pub prompt: Vec<TokenId>,
    /// The router's block hashes, checked against the worker's own.
    pub block_hashes: Vec<u64>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Cache namespace salt.
    pub cache_salt: String,
    /// Where the uncacheable tail starts.
    pub cacheable_len: Option<usize>,
    /// Fork group, for metrics and logs.
    pub fork_group: Option<String>,
    /// When the gRPC handler received the call.
    pub received_at: Instant,
    /// The call's response stream.
    pub stream: StreamSender,
    /// Send an `accepted` message first, once queued (the caller asked for it).
    pub report_acceptance: bool,
    /// Told whether the engine accepted the request.
    pub accepted: oneshot::Sender<Result<(), Status>>,
    /// Prefix blocks pulled from a peer, to import for this request.
    pub pulled: Vec<kvfleet_engine::KvBlockPayload>,
    /// The pin the caller asked for, already checked.
    pub pin: Option<kvfleet_engine::PinSpec>,
}

/// A validated `Fork` call, on its way to the engine.
pub(crate) struct ForkCommand {
    /// The caller's fork id (empty: the engine thread assigns one); children are
    /// named `<request_id>.<index>`.
    pub request_id: String,
    /// The shared prefix.
    pub prefix: Vec<TokenId>,
    /// The router's block hashes of the prefix, checked against the worker's own.
    pub block_hashes: Vec<u64>,
    /// Cache namespace salt.
    pub cache_salt: String,
    /// Each child's suffix, sampling parameters and response stream, in order.
    pub children: Vec<ForkChildCommand>,
    /// Fork group, for metrics and logs.
    pub fork_group: Option<String>,
    /// When the gRPC handler received the call.
    pub received_at: Instant,
    /// Send an `accepted` message first (on child 0), once queued.
    pub report_acceptance: bool,
    /// Told whether the engine accepted the fork.
    pub accepted: oneshot::Sender<Result<(), Status>>,
}

/// One child of a [`ForkCommand`].
pub(crate) struct ForkChildCommand {
    /// Tokens after the shared prefix (not empty).
    pub suffix: Vec<TokenId>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// The child's messages (merged into the call's stream by the handler).
    pub stream: StreamSender,
}

/// The engine's load and totals, taken together.
#[derive(Clone, Default)]
pub(crate) struct LoadSnapshot {
    /// Current load.
    pub load: EngineLoad,
    /// Totals since start.
    pub stats: EngineStats,
    /// The part of `stats.cached_tokens` promoted from a lower tier or a peer, summed
    /// over the requests' usage.
    pub cached_by_tier: CachedByTier,
    /// The host and disk tiers' totals, when the engine has tiers.
    pub tiers: Option<TierStats>,
    /// Loads published so far, this one included (`LoadResponse.load_seq`).
    pub load_seq: u64,
}

/// Prompt tokens reported cached since start that were promoted from each source
/// (the sum of the `Usage.{host,disk,peer}_cached_tokens` the worker sent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CachedByTier {
    /// From the host-memory tier.
    pub host: u64,
    /// From the disk tier.
    pub disk: u64,
    /// From a peer worker.
    pub peer: u64,
}

impl CachedByTier {
    /// Adds one request's promoted tokens.
    pub fn add(&mut self, p: &kvfleet_engine::PromotedTokens) {
        self.host += p.host as u64;
        self.disk += p.disk as u64;
        self.peer += p.peer as u64;
    }
}

/// What the gRPC side asks of the engine thread.
pub(crate) enum Command {
    /// Start a request.
    Generate(Box<GenerateCommand>),
    /// Start a fork: a shared prefix computed once, then its children.
    Fork(Box<ForkCommand>),
    /// Abort a request (or a fork) by its gRPC id. Nobody waits for it: the handler
    /// answers from the engine's published state at once.
    Abort { request_id: String },
    /// Copy out the leading run of these blocks the engine holds, for a peer.
    Export {
        hashes: Vec<u64>,
        reply: oneshot::Sender<Vec<kvfleet_engine::KvBlockPayload>>,
    },
}

/// The gRPC side's end of the command queue.
#[derive(Clone)]
pub(crate) struct EngineHandle {
    tx: SyncSender<Command>,
    capacity: usize,
}

impl EngineHandle {
    /// A handle over the sending end of a queue of `capacity` commands.
    pub(crate) fn new(tx: SyncSender<Command>, capacity: usize) -> Self {
        EngineHandle { tx, capacity }
    }

    /// Queues a command without waiting: a full queue is RESOURCE_EXHAUSTED, a stopped
    /// engine UNAVAILABLE.
    pub(crate) fn send(&self, cmd: Command) -> Result<(), Status> {
        match self.tx.try_send(cmd) {
            Ok(()) => Ok(()),
            Err(mpsc::TrySendError::Full(_)) => Err(Status::resource_exhausted(format!(
                "the worker's engine queue is full ({} commands waiting); retry later or \
                 on another worker",
                self.capacity
            ))),
            Err(mpsc::TrySendError::Disconnected(_)) => {
                Err(Status::unavailable("the worker's engine has stopped"))
            }
        }
    }
}
