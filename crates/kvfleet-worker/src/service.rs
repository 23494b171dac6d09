//! The tonic service: the `kvfleet.v1.Worker` RPCs, answered by the engine thread
//! (`Generate`, `Fork`), the state it publishes (`Load`, `Abort`, which queues the
//! abort and returns), the event log (`KvEvents`, `CacheDump`), the device pool's
//! shared block index and KV memory (`FetchBlocks`, copied on a blocking thread) or the
//! worker's static facts (`Info`). Handlers never block and never wait behind an engine
//! step, except `Generate` and `Fork` for their acceptance (they queue a command with
//! `try_send`) and `FetchBlocks` for blocks below the pool or on a backend without a
//! shared reader.

use crate::commands::{Command, EngineHandle, ForkChildCommand, ForkCommand, GenerateCommand};
use crate::config::WorkerConfig;
use crate::convert;
use crate::engine_health::EngineHealth;
use crate::engine_loop;
use crate::engine_state::EngineState;
use crate::error::WorkerError;
use crate::event_log::EventLog;
use crate::peer_pull::{PeerPuller, MAX_PULL_BLOCKS};
use futures::Stream;
use kvfleet_core::BlockHash;
use kvfleet_engine::{BlockExporter, KvBlockPayload};
use kvfleet_proto::kv_events::medium_to_wire;
use kvfleet_proto::v1 as pb;
use kvfleet_proto::v1::worker_server::{Worker, WorkerServer};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{StreamExt, StreamMap};
use tonic::{Request, Response, Status};

/// The `KvEvents` response stream.
pub type KvEventStream = Pin<Box<dyn Stream<Item = Result<pb::KvEventBatch, Status>> + Send>>;

/// The `Generate` response stream.
pub type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

/// The `Fork` response stream: every child's messages, tagged with its index. It ends
/// once every child's stream has ended (or with the first error, which ends the call);
/// dropping it aborts every unfinished child.
pub type ForkStream = Pin<Box<dyn Stream<Item = Result<pb::ForkResponse, Status>> + Send>>;

/// Most children one `Fork` call may ask for.
pub const MAX_FORK_CHILDREN: usize = 256;

/// One worker's gRPC service: an engine thread, its event log, and its static facts.
/// Clones share the same engine. The engine thread stops once every clone (and every
/// server holding one) is dropped.
#[derive(Clone)]
pub struct WorkerService {
    engine: EngineHandle,
    events: Arc<EventLog>,
    info: Arc<pb::InfoResponse>,
    stream_buffer: usize,
    closing: Arc<watch::Sender<bool>>,
    stopped: watch::Receiver<()>,
    state: Arc<EngineState>,
    health: EngineHealth,
    peers: Arc<PeerPuller>,
    exit_mid_fetch_after: Option<usize>,
    /// Copies pool blocks out for peers without waiting for the engine's step.
    exporter: Option<BlockExporter>,
    /// Whether blocks may also sit in tiers below the pool (only the engine reads those).
    tiers: bool,
}

/// Blocks copied out of the pool per blocking task while a `FetchBlocks` stream drains.
const EXPORT_CHUNK: usize = 32;

/// The `FetchBlocks` response stream.
pub type FetchBlocksStream = ReceiverStream<Result<pb::KvBlockData, Status>>;

/// Ends the live `KvEvents` streams of a worker (with UNAVAILABLE), which would
/// otherwise keep a graceful shutdown waiting forever. `Generate` streams are left to
/// finish.
#[derive(Clone)]
pub struct EventStreamCloser(Arc<watch::Sender<bool>>);

impl EventStreamCloser {
    /// Ends every live `KvEvents` stream, now and for any subscriber still to come.
    pub fn close(&self) {
        self.0.send_replace(true);
    }
}

impl WorkerService {
    /// Starts the engine thread (which loads the model and builds the engine) and
    /// returns once it is ready to serve.
    pub async fn start(config: WorkerConfig) -> Result<Self, WorkerError> {
        config.validate()?;
        let events = Arc::new(EventLog::new(
            config.worker_id.clone(),
            config.event_ring_capacity,
            config.event_subscriber_buffer,
        ));
        let thread = engine_loop::spawn(&config, Arc::clone(&events))?;
        let (info, exporter) = thread
            .ready
            .await
            .map_err(|_| WorkerError::Task("the engine thread exited while starting".into()))??;
        tracing::info!(
            worker = %info.worker_id,
            model = %info.model_id,
            blocks = info.num_blocks,
            block_size = info.block_size,
            device = %info.device,
            "worker engine ready"
        );
        let (closing, _) = watch::channel(false);
        Ok(WorkerService {
            engine: thread.handle,
            events,
            info: Arc::new(info),
            stream_buffer: config.stream_buffer,
            closing: Arc::new(closing),
            stopped: thread.stopped,
            state: thread.state,
            health: thread.health,
            peers: PeerPuller::new(&config.worker_id, config.peer_tls.clone()),
            exit_mid_fetch_after: config.faults.exit_mid_fetch_after,
            exporter,
            tiers: config.kv_tiers.enabled(),
        })
    }

    /// The worker's static facts (what `Info` answers).
    pub fn info(&self) -> &pb::InfoResponse {
        &self.info
    }

    /// The worker's KV event log.
    pub fn event_log(&self) -> &Arc<EventLog> {
        &self.events
    }

    /// A handle that ends this worker's live `KvEvents` streams; call it when a
    /// graceful shutdown starts.
    pub fn event_stream_closer(&self) -> EventStreamCloser {
        EventStreamCloser(Arc::clone(&self.closing))
    }

    /// Resolves once the engine thread has ended (after every clone of this service
    /// has been dropped).
    pub fn engine_stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stopped = self.stopped.clone();
        async move { while stopped.changed().await.is_ok() {} }
    }

    /// Whether the engine thread still serves, or how it ended; holding it does not
    /// keep the engine running.
    pub fn health(&self) -> EngineHealth {
        self.health.clone()
    }

    /// The service wrapped for `tonic::transport::Server::add_service`.
    pub fn into_server(self) -> WorkerServer<Self> {
        WorkerServer::new(self)
    }

    /// Published state is only served, and requests only taken, while the engine
    /// thread runs (its health leaves `Running` before the thread ends, however it ends).
    fn check_engine_running(&self) -> Result<(), Status> {
        if !self.health.is_running() {
            return Err(Status::unavailable("the worker's engine has stopped"));
        }
        Ok(())
    }

    /// A draining worker (graceful shutdown started) takes no new request: UNAVAILABLE
    /// tells the router to send it elsewhere.
    fn check_not_draining(&self) -> Result<(), Status> {
        if *self.closing.borrow() {
            return Err(Status::unavailable("worker is draining"));
        }
        Ok(())
    }

    /// Checks what can be checked without the engine: model id and block size.
    fn check_request(
        &self,
        model: &str,
        block_size: u32,
        block_hashes: &[u64],
    ) -> Result<(), Status> {
        let info = &self.info;
        if !model.is_empty() && model != info.model_id {
            return Err(Status::invalid_argument(format!(
                "this worker serves model `{}`, not `{model}`",
                info.model_id
            )));
        }
        let unset_ok = block_size == 0 && block_hashes.is_empty();
        if block_size != info.block_size && !unset_ok {
            return Err(Status::invalid_argument(format!(
                "router/worker mismatch: the request's block size is {block_size} but this \
                 worker's is {} (block hashes are only comparable at equal block sizes)",
                info.block_size
            )));
        }
        Ok(())
    }

    /// Checks a fork's children (count, suffixes, sampling) and converts their
    /// sampling parameters, before anything starts.
    fn check_fork_children(
        children: &[pb::ForkChild],
    ) -> Result<Vec<kvfleet_engine::SamplingParams>, Status> {
        if children.is_empty() {
            return Err(Status::invalid_argument("a fork needs at least one child"));
        }
        if children.len() > MAX_FORK_CHILDREN {
            return Err(Status::invalid_argument(format!(
                "a fork may have at most {MAX_FORK_CHILDREN} children, got {}",
                children.len()
            )));
        }
        children
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if c.suffix_token_ids.is_empty() {
                    return Err(Status::invalid_argument(format!(
                        "fork child {i} has an empty suffix"
                    )));
                }
                let params = convert::sampling_params(c.sampling.as_ref()).map_err(|s| {
                    Status::invalid_argument(format!("fork child {i}: {}", s.message()))
                })?;
                params
                    .validate()
                    .map_err(|e| Status::invalid_argument(format!("fork child {i}: {e}")))?;
                Ok(params)
            })
            .collect()
    }
}

impl WorkerService {
    /// Pulls the blocks a router's hint names from the peer holding them; whatever
    /// arrives whole is imported, the rest is recomputed.
    async fn pull(&self, p: &pb::PeerPull, hashes: &[u64]) -> Vec<kvfleet_engine::KvBlockPayload> {
        let (first, end) = (p.first_block as usize, p.end_block as usize);
        if first >= end
            || end > hashes.len()
            || end - first > MAX_PULL_BLOCKS
            || self.info.kv_block_bytes == 0
        {
            return Vec::new();
        }
        self.peers
            .pull(
                &p.peer_endpoint,
                &hashes[first..end],
                &self.info.kv_block_format,
                self.info.kv_block_bytes,
            )
            .await
            .blocks
    }
}

#[tonic::async_trait]
impl Worker for WorkerService {
    type GenerateStream = GenerateStream;
    type ForkStream = ForkStream;
    type KvEventsStream = KvEventStream;
    type FetchBlocksStream = FetchBlocksStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let received_at = Instant::now();
        self.check_not_draining()?;
        self.check_engine_running()?;
        let req = request.into_inner();
        self.check_request(&req.model, req.block_size, &req.block_hashes)?;
        let params = convert::sampling_params(req.sampling.as_ref())?;
        let pin = convert::pin_spec(req.pin.as_ref())?;
        let pulled = match &req.pull {
            Some(p) => self.pull(p, &req.block_hashes).await,
            None => Vec::new(),
        };
        let (tx, rx) = mpsc::channel(self.stream_buffer);
        let (accepted_tx, accepted_rx) = oneshot::channel();
        self.engine
            .send(Command::Generate(Box::new(GenerateCommand {
                pulled,
                pin,
                request_id: req.request_id,
                prompt: req.token_ids,
                block_hashes: req.block_hashes,
                params,
                cache_salt: req.cache_salt,
                cacheable_len: req.cacheable_len.map(|n| n as usize),
                fork_group: req.fork_group,
                received_at,
                stream: tx,
                report_acceptance: req.report_acceptance,
                accepted: accepted_tx,
            })))?;
        match accepted_rx.await {
            Ok(Ok(())) => Ok(Response::new(ReceiverStream::new(rx))),
            Ok(Err(status)) => Err(status),
            Err(_) => Err(Status::unavailable(
                "the worker's engine stopped before accepting the request",
            )),
        }
    }

    async fn fetch_blocks(
        &self,
        request: Request<pb::FetchBlocksRequest>,
    ) -> Result<Response<Self::FetchBlocksStream>, Status> {
        self.check_engine_running()?;
        let req = request.into_inner();
        if req.block_format != self.info.kv_block_format
            || req.block_bytes != self.info.kv_block_bytes
            || self.info.kv_block_bytes == 0
        {
            return Err(Status::failed_precondition(format!(
                "this worker's KV blocks are {} bytes of {:?}; asked for {} bytes of {:?}",
                self.info.kv_block_bytes,
                self.info.kv_block_format,
                req.block_bytes,
                req.block_format
            )));
        }
        if req.block_hashes.len() > MAX_PULL_BLOCKS {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_PULL_BLOCKS} blocks per FetchBlocks call"
            )));
        }
        let hashes = req.block_hashes;
        // A few blocks in flight at a time: they are copied as the stream is drained,
        // so a long pull holds a few chunks in memory, not the whole prefix.
        let (tx, rx) = mpsc::channel(4);
        let sender = BlockSender {
            tx,
            sent: 0,
            exit_after: self.exit_mid_fetch_after,
        };
        match self.exporter.clone() {
            // Copied off the engine thread: a busy holder serves without waiting for
            // its step. Blocks below the pool are the engine's to export.
            Some(exporter) => {
                let engine = self.engine.clone();
                let below_pool = self.tiers;
                tokio::spawn(async move {
                    let mut sender = sender;
                    if !sender.send_from_pool(&exporter, &hashes).await {
                        return;
                    }
                    if below_pool && sender.sent < hashes.len() {
                        let rest = hashes[sender.sent..].to_vec();
                        if let Ok(blocks) = export_on_engine(&engine, rest).await {
                            sender.send_all(blocks).await;
                        }
                    }
                });
            }
            None => {
                let blocks = export_on_engine(&self.engine, hashes).await?;
                tokio::spawn(sender.send_all(blocks));
            }
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn fork(
        &self,
        request: Request<pb::ForkRequest>,
    ) -> Result<Response<Self::ForkStream>, Status> {
        let received_at = Instant::now();
        self.check_not_draining()?;
        self.check_engine_running()?;
        let req = request.into_inner();
        self.check_request(&req.model, req.block_size, &req.block_hashes)?;
        if req.prefix_token_ids.is_empty() {
            return Err(Status::invalid_argument("a fork needs a non-empty prefix"));
        }
        let params = Self::check_fork_children(&req.children)?;
        let mut streams = StreamMap::with_capacity(req.children.len());
        let mut children = Vec::with_capacity(req.children.len());
        for (i, (child, params)) in req.children.into_iter().zip(params).enumerate() {
            let (tx, rx) = mpsc::channel(self.stream_buffer);
            streams.insert(i as u32, ReceiverStream::new(rx));
            children.push(ForkChildCommand {
                suffix: child.suffix_token_ids,
                params,
                stream: tx,
            });
        }
        let (accepted_tx, accepted_rx) = oneshot::channel();
        self.engine.send(Command::Fork(Box::new(ForkCommand {
            request_id: req.request_id,
            prefix: req.prefix_token_ids,
            block_hashes: req.block_hashes,
            cache_salt: req.cache_salt,
            children,
            fork_group: req.fork_group,
            received_at,
            report_acceptance: req.report_acceptance,
            accepted: accepted_tx,
        })))?;
        match accepted_rx.await {
            // Dropping the merged stream drops every child's receiver, which the engine
            // thread notices and aborts the child.
            Ok(Ok(())) => Ok(Response::new(Box::pin(streams.map(
                |(child_index, item)| {
                    item.map(|response| pb::ForkResponse {
                        child_index,
                        response: Some(response),
                    })
                },
            )))),
            Ok(Err(status)) => Err(status),
            Err(_) => Err(Status::unavailable(
                "the worker's engine stopped before accepting the fork",
            )),
        }
    }

    async fn kv_events(
        &self,
        request: Request<pb::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        let from_seq = request.into_inner().from_seq;
        let sub = self.events.subscribe(from_seq)?;
        let stream = Arc::clone(&self.events).into_batches(sub, self.closing.subscribe());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn cache_dump(
        &self,
        _request: Request<pb::CacheDumpRequest>,
    ) -> Result<Response<pb::CacheDumpResponse>, Status> {
        self.check_engine_running()?;
        let (seq, blocks) = self.events.cache_dump();
        Ok(Response::new(pb::CacheDumpResponse {
            worker_id: self.info.worker_id.clone(),
            seq,
            blocks: blocks
                .into_iter()
                .map(|b| pb::CachedBlock {
                    hash: b.hash.0,
                    parent_hash: b.parent.map(|p| p.0),
                    medium: medium_to_wire(b.medium),
                })
                .collect(),
        }))
    }

    async fn load(
        &self,
        _request: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        self.check_engine_running()?;
        let snap = self.state.load();
        Ok(Response::new(convert::load_response(
            &self.info.worker_id,
            &snap,
            self.event_log().last_seq(),
            self.peers.pulled(),
        )))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(pb::InfoResponse::clone(&self.info)))
    }

    async fn abort(
        &self,
        request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        let request_id = request.into_inner().request_id;
        // Queued, not awaited: the engine carries it out after its current step.
        let found = self.state.is_live(&request_id);
        if found {
            self.engine.send(Command::Abort { request_id })?;
        }
        Ok(Response::new(pb::AbortResponse { found }))
    }
}

/// Asks the engine thread for the leading run of `hashes` it holds (pool, then the
/// tiers below it); answered between two steps.
async fn export_on_engine(
    engine: &EngineHandle,
    hashes: Vec<u64>,
) -> Result<Vec<KvBlockPayload>, Status> {
    let (reply, blocks) = oneshot::channel();
    engine.send(Command::Export { hashes, reply })?;
    blocks
        .await
        .map_err(|_| Status::unavailable("the worker's engine stopped"))
}

/// The sending end of one `FetchBlocks` stream.
struct BlockSender {
    tx: mpsc::Sender<Result<pb::KvBlockData, Status>>,
    sent: usize,
    /// Fault hook: die after this many blocks, as a killed process would.
    exit_after: Option<usize>,
}

impl BlockSender {
    /// Sends one block; false once the peer has gone.
    async fn send(&mut self, b: KvBlockPayload) -> bool {
        if self.exit_after == Some(self.sent) {
            std::process::exit(137);
        }
        let msg = pb::KvBlockData {
            hash: b.hash.0,
            parent_hash: b.parent.map(|p| p.0),
            checksum: xxhash_rust::xxh3::xxh3_64(&b.bytes),
            data: b.bytes.to_vec(),
        };
        if self.tx.send(Ok(msg)).await.is_err() {
            return false;
        }
        self.sent += 1;
        true
    }

    async fn send_all(mut self, blocks: Vec<KvBlockPayload>) {
        for b in blocks {
            if !self.send(b).await {
                return;
            }
        }
    }

    /// Sends the leading run of `hashes` held in the device pool, copied a chunk at
    /// a time on a blocking thread; false once the peer has gone.
    async fn send_from_pool(&mut self, exporter: &BlockExporter, hashes: &[u64]) -> bool {
        for chunk in hashes.chunks(EXPORT_CHUNK) {
            let asked: Vec<BlockHash> = chunk.iter().copied().map(BlockHash).collect();
            let x = exporter.clone();
            let copied = tokio::task::spawn_blocking(move || x.export(&asked)).await;
            // A copy that failed is a short run: the peer recomputes the rest.
            let blocks = copied.ok().and_then(Result::ok).unwrap_or_default();
            let whole = blocks.len() == chunk.len();
            for b in blocks {
                if !self.send(b).await {
                    return false;
                }
            }
            if !whole {
                break;
            }
        }
        true
    }
}
