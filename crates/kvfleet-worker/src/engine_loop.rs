//! The engine thread: one OS thread owns the (synchronous) engine and everything that
//! touches it, and the gRPC handlers talk to it only through a bounded command queue.
//!
//! Each turn of the loop takes the commands that are waiting (blocking on the queue
//! while the engine has nothing to do, so an idle worker uses no CPU), drops requests
//! whose client went away, runs one engine step, and routes every step output to its
//! request's stream. Streams are bounded tokio channels fed with `try_send`: a slow
//! client's tokens are coalesced into one pending message instead of blocking the
//! engine, and a closed stream aborts its request so no work is wasted.
//!
//! A fork is one engine fork request (its shared prefix, computed once) and one
//! `Active` per child, registered at once under the names `<fork>.<i>`: a child's
//! outputs flow exactly as a `Generate` request's do. Until the prefix is computed
//! the children exist only inside the engine's fork, which cannot drop one of them,
//! so a child retired early (its client gone, or aborted) is aborted in the engine
//! when the prefix is done and the children spawn; once every child is retired,
//! the prefix computation is aborted too.

use crate::commands::{
    CachedByTier, Command, EngineHandle, ForkCommand, GenerateCommand, LoadSnapshot, StreamSender,
};
use crate::config::{EngineFaults, WorkerConfig, WorkerModel};
use crate::convert::{self, u32_of};
use crate::engine_health::{EngineHealth, HealthReporter};
use crate::engine_metrics::EngineMetrics;
use crate::engine_state::EngineState;
use crate::error::WorkerError;
use crate::event_log::EventLog;
use crate::outbox::{Delivery, Outbox};
use crate::tier_metrics::TierMetrics;
use kvfleet_core::{hash_blocks, TokenId, Tokenizer};
use kvfleet_engine::{
    load_model, new_backend, BlockExporter, Engine, EngineError, FinishReason, ForkChild,
    ForkRequest, LoadedModel, ModelBackend, ProgressGuard, Request, RequestId, SimBackend,
    StepOutput, MAX_IDLE_STEPS,
};
use kvfleet_proto::v1 as pb;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};
use tonic::Status;

/// How long the loop waits for commands when it cannot make progress but still has
/// something to retry (a stalled schedule, or output a slow client has not taken).
const POLL: Duration = Duration::from_millis(2);

/// Most commands taken between two engine steps, so a flood of requests cannot
/// starve the requests already running.
const MAX_COMMANDS_PER_TURN: usize = 256;

/// A started engine thread.
pub(crate) struct EngineThread {
    /// Where to send commands.
    pub handle: EngineHandle,
    /// The worker's static facts once the model is loaded (and an exporter of its
    /// blocks for peers, when the backend has one), or why it could not be.
    pub ready: oneshot::Receiver<Result<(pb::InfoResponse, Option<BlockExporter>), WorkerError>>,
    /// Its sender is dropped when the thread ends.
    pub stopped: watch::Receiver<()>,
    /// What the engine publishes for the handlers (load, unfinished names).
    pub state: Arc<EngineState>,
    /// Whether the thread still serves, or how it ended.
    pub health: EngineHealth,
}

/// Starts the engine thread: it loads the model, builds the engine (publishing KV
/// events into `events`), reports ready, then serves commands until every
/// [`EngineHandle`] is dropped.
pub(crate) fn spawn(
    config: &WorkerConfig,
    events: Arc<EventLog>,
) -> Result<EngineThread, WorkerError> {
    let (tx, rx) = mpsc::sync_channel(config.command_queue_capacity);
    let (ready_tx, ready_rx) = oneshot::channel();
    let (stopped_tx, stopped_rx) = watch::channel(());
    let capacity = config.command_queue_capacity;
    let config = config.clone();
    let state = Arc::new(EngineState::default());
    let published = Arc::clone(&state);
    let (reporter, health) = HealthReporter::new();
    std::thread::Builder::new()
        .name(format!("kvfleet-engine-{}", config.worker_id))
        .spawn(move || {
            // Dropped when this thread ends, however it ends; the reporter first, so
            // whoever sees `stopped` already sees how it ended.
            let _stopped = stopped_tx;
            let reporter = reporter;
            let (mut engine, info) = match build_engine(&config, Arc::clone(&events)) {
                Ok(built) => built,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let exporter = engine.block_exporter();
            let mut engine_loop = EngineLoop::new(
                engine,
                rx,
                &config.worker_id,
                config.faults.clone(),
                published,
                events,
            );
            // Before ready: `Load` answers the empty pool from the start, not zeros
            // until a first request makes the engine step.
            engine_loop.publish_load();
            if ready_tx.send(Ok((info, exporter))).is_err() {
                return;
            }
            engine_loop.run(&reporter);
        })?;
    Ok(EngineThread {
        handle: EngineHandle::new(tx, capacity),
        ready: ready_rx,
        stopped: stopped_rx,
        state,
        health,
    })
}

fn build_engine(
    config: &WorkerConfig,
    events: Arc<EventLog>,
) -> Result<(Engine, pb::InfoResponse), WorkerError> {
    let Served {
        model_id,
        tokenizer,
        backend,
    } = match &config.model {
        // The simulator has no device memory to size a pool from: it takes the block
        // count, whatever the device.
        WorkerModel::Simulated(sim) => Served {
            model_id: sim.prompt.id.clone(),
            tokenizer: Arc::clone(&sim.prompt.tokenizer),
            backend: Box::new(SimBackend::new(
                sim.config.clone(),
                config.num_blocks,
                sim.cost.clone(),
            )),
        },
        WorkerModel::Spec(spec) => model_backend(config, load_model(spec)?)?,
        WorkerModel::Loaded(m) => model_backend(config, m.clone())?,
    };
    let device = backend.device_name();
    if let Some(sizing) = backend.kv_sizing() {
        tracing::info!(
            worker = %config.worker_id,
            device = %device,
            blocks = sizing.num_blocks,
            block_bytes = sizing.block_bytes,
            "KV pool sized from device memory: {sizing}"
        );
    }
    let mut engine = Engine::new(config.engine_config(&model_id), backend, Some(tokenizer))?;
    engine.set_event_sink(events);
    engine.set_kv_tiers(&config.kv_tiers)?;
    engine.set_pin_pool_fraction(config.pin_pool_fraction);
    let (block_format, block_bytes) = engine.block_format();
    let mc = engine.model_config();
    let info = pb::InfoResponse {
        worker_id: config.worker_id.clone(),
        model_id,
        block_size: u32_of(config.block_size),
        num_blocks: u32_of(engine.load().total_blocks),
        max_context: u32_of(mc.max_position_embeddings),
        vocab_size: u32_of(mc.vocab_size),
        device,
        max_num_seqs: u32_of(config.max_num_seqs),
        kv_block_format: block_format.to_string(),
        kv_block_bytes: block_bytes as u64,
    };
    Ok((engine, info))
}

/// What the engine is built from: the served model's id and tokenizer, and the
/// backend that runs its steps.
struct Served {
    model_id: String,
    tokenizer: Arc<dyn Tokenizer>,
    backend: Box<dyn ModelBackend>,
}

/// A real model on the worker's device.
fn model_backend(config: &WorkerConfig, model: LoadedModel) -> Result<Served, WorkerError> {
    let backend = new_backend(
        config.device,
        Arc::clone(&model.model),
        config.kv_pool(),
        config.block_size,
    )?;
    Ok(Served {
        model_id: model.id,
        tokenizer: model.tokenizer,
        backend,
    })
}

/// An unfinished request.
struct Active {
    name: String,
    /// The fork this request is a child of.
    fork: Option<String>,
    stream: StreamSender,
    outbox: Outbox,
    received_at: Instant,
    admitted_at: Instant,
    first_output_at: Option<Instant>,
    prompt_tokens: usize,
    cached_tokens: usize,
    /// The part of `cached_tokens` promoted from a lower tier or a peer.
    promoted: kvfleet_engine::PromotedTokens,
    completion_tokens: usize,
    /// What became of the request's pin, once its prompt is computed.
    pin: Option<kvfleet_engine::PinOutcome>,
}

impl Active {
    fn usage(&self) -> pb::Usage {
        pb::Usage {
            pin: self.pin.map(convert::pin_result),
            prompt_tokens: u32_of(self.prompt_tokens),
            cached_tokens: u32_of(self.cached_tokens),
            completion_tokens: u32_of(self.completion_tokens),
            host_cached_tokens: u32_of(self.promoted.host),
            disk_cached_tokens: u32_of(self.promoted.disk),
            peer_cached_tokens: u32_of(self.promoted.peer),
        }
    }

    fn timings(&self, now: Instant) -> pb::Timings {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        pb::Timings {
            queue_ms: ms(self.admitted_at - self.received_at),
            ttft_ms: self
                .first_output_at
                .map_or(0.0, |t| ms(t - self.received_at)),
            total_ms: ms(now - self.received_at),
        }
    }
}

/// A fork whose children are not all retired yet.
struct Fork {
    /// The engine id of the shared prefix's computation, until it is done.
    prefix: Option<RequestId>,
    /// Children not retired yet.
    children: Vec<RequestId>,
    /// Children retired while the prefix was still being computed: the engine spawns
    /// them with the others, and they are aborted right then.
    retired_early: Vec<RequestId>,
}

/// A finished request whose last messages its client has not taken yet.
struct Draining {
    stream: StreamSender,
    outbox: Outbox,
}

enum Wait {
    /// Nothing to do until a command arrives.
    Block,
    /// Retry soon even without a command.
    Poll,
    /// Never wait: the engine has work, so only take commands already queued.
    Never,
}

struct EngineLoop {
    engine: Engine,
    commands: Receiver<Command>,
    worker_id: String,
    active: HashMap<RequestId, Active>,
    by_name: HashMap<String, RequestId>,
    /// Unfinished forks, by name.
    forks: HashMap<String, Fork>,
    /// The fork of each prefix computation still running.
    prefixes: HashMap<RequestId, String>,
    /// The engine panicked: its state is suspect and it is not to be touched.
    poisoned: bool,
    draining: Vec<Draining>,
    next_id: RequestId,
    /// Whether the last step scheduled nothing although requests were unfinished
    /// (the guard `Engine::run_to_completion` uses too).
    progress: ProgressGuard,
    metrics: EngineMetrics,
    tier_metrics: TierMetrics,
    /// Cached prompt tokens promoted from each lower tier or a peer, over every
    /// request's usage (for `Load`).
    cached_by_tier: CachedByTier,
    faults: EngineFaults,
    /// Engine steps run so far (for `EngineFaults::panic_after_steps`).
    steps: u64,
    /// Published for the gRPC handlers.
    state: Arc<EngineState>,
    /// The KV event log, which also pushes the load to the routers.
    events: Arc<EventLog>,
    /// Loads published so far.
    load_seq: u64,
}

fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::InvalidRequest(m) => Status::invalid_argument(m),
        EngineError::OutOfBlocks(m) => Status::resource_exhausted(m),
        other => Status::internal(other.to_string()),
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".to_string())
}

impl EngineLoop {
    fn new(
        engine: Engine,
        commands: Receiver<Command>,
        worker_id: &str,
        faults: EngineFaults,
        state: Arc<EngineState>,
        events: Arc<EventLog>,
    ) -> Self {
        EngineLoop {
            engine,
            commands,
            worker_id: worker_id.to_string(),
            active: HashMap::new(),
            by_name: HashMap::new(),
            forks: HashMap::new(),
            prefixes: HashMap::new(),
            poisoned: false,
            draining: Vec::new(),
            next_id: 1,
            progress: ProgressGuard::new(),
            metrics: EngineMetrics::new(worker_id),
            tier_metrics: TierMetrics::new(worker_id),
            cached_by_tier: CachedByTier::default(),
            faults,
            steps: 0,
            state,
            events,
            load_seq: 0,
        }
    }

    /// Serves commands until the queue's senders are all gone (or the engine panics),
    /// then ends every request still open, and reports how it ended on `health`.
    fn run(mut self, health: &HealthReporter) {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.serve()));
        match outcome {
            Ok(()) => {
                health.stopped();
                self.fail_active(Status::unavailable("the worker is shutting down"), true);
            }
            Err(p) => {
                let msg = panic_message(p.as_ref());
                tracing::error!(worker = %self.worker_id, panic = %msg, "engine thread panicked");
                // First, so `/health` turns 503 and the worker leaves membership while
                // the streams below are still being ended.
                health.failed(format!("the engine panicked: {msg}"));
                // The engine's state is suspect: end the streams without touching it.
                // UNAVAILABLE, a transport-class error: the worker is gone, so a router
                // resends a request that had not started to another worker.
                let status = Status::unavailable(format!("the worker's engine failed: {msg}"));
                self.fail_active(status, false);
            }
        }
        for d in &mut self.draining {
            d.outbox.flush(&d.stream);
        }
        tracing::debug!(worker = %self.worker_id, "engine thread stopped");
        // Commands still queued are dropped with the queue: their handlers answer
        // UNAVAILABLE ("stopped before accepting").
    }

    fn wait_mode(&self) -> Wait {
        let busy = self.engine.has_unfinished();
        if busy && !self.progress.stalled() {
            Wait::Never
        } else if busy || !self.draining.is_empty() {
            Wait::Poll
        } else {
            Wait::Block
        }
    }

    fn serve(&mut self) {
        loop {
            let first = match self.wait_mode() {
                Wait::Block => match self.commands.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                },
                Wait::Poll => match self.commands.recv_timeout(POLL) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                },
                Wait::Never => match self.commands.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => return,
                },
            };
            if let Some(c) = first {
                self.handle(c);
                for _ in 1..MAX_COMMANDS_PER_TURN {
                    match self.commands.try_recv() {
                        Ok(c) => self.handle(c),
                        Err(_) => break,
                    }
                }
            }
            self.reap_disconnected();
            self.flush_outboxes();
            if self.engine.has_unfinished() {
                // The requests just taken show in `Load` while the step runs.
                self.publish_load();
                self.step();
                if self.progress.idle_steps() > MAX_IDLE_STEPS {
                    self.give_up_stalled();
                }
            } else {
                self.progress.reset();
            }
            self.publish_load();
        }
    }

    /// Publishes the engine's load and totals, for `Load` and the metrics.
    fn publish_load(&mut self) {
        let load = self.engine.load();
        self.load_seq += 1;
        // Pushed to the routers with the KV events: they learn at once that work ended.
        self.events
            .publish_load(convert::pushed_load(&load, self.load_seq));
        self.metrics.update(&load, self.engine.stats());
        let tiers = self.engine.tier_stats();
        if let Some(t) = &tiers {
            self.tier_metrics.update(t);
        }
        self.state.publish_load(LoadSnapshot {
            load,
            stats: self.engine.stats().clone(),
            cached_by_tier: self.cached_by_tier,
            tiers,
            load_seq: self.load_seq,
        });
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(g) => self.start(*g),
            Command::Export { hashes, reply } => {
                let hashes: Vec<_> = hashes.into_iter().map(kvfleet_core::BlockHash).collect();
                // A backend that cannot copy out exports nothing: the peer recomputes.
                let _ = reply.send(self.engine.export_blocks(&hashes).unwrap_or_default());
            }
            Command::Fork(f) => self.start_fork(*f),
            Command::Abort { request_id } => {
                self.abort_by_name(&request_id);
            }
        }
    }

    /// Checks the router's block hashes against the worker's own hashing of the prompt.
    fn verify_hashes(&self, prompt: &[TokenId], hashes: &[u64], salt: &str) -> Result<(), Status> {
        if hashes.is_empty() {
            return Ok(());
        }
        let bs = self.engine.config().block_size;
        let full = prompt.len() / bs;
        if hashes.len() > full {
            return Err(Status::invalid_argument(format!(
                "router/worker mismatch: {} block hashes were sent, but the prompt's {} tokens \
                 make only {full} full blocks of {bs}",
                hashes.len(),
                prompt.len()
            )));
        }
        let ours = hash_blocks(
            self.engine.namespace_seed(salt),
            &prompt[..hashes.len() * bs],
            bs,
        );
        if let Some(i) = (0..hashes.len()).find(|&i| ours[i].0 != hashes[i]) {
            return Err(Status::invalid_argument(format!(
                "router/worker mismatch: block {i}'s hash is {:016x} from the router but \
                 {} on this worker (model `{}`, block size {bs}); router and worker disagree \
                 on the model id, cache salt, block size or tokens",
                hashes[i],
                ours[i],
                self.engine.config().model_id
            )));
        }
        Ok(())
    }

    fn start(&mut self, cmd: GenerateCommand) {
        let GenerateCommand {
            request_id,
            prompt,
            block_hashes,
            params,
            cache_salt,
            cacheable_len,
            fork_group,
            received_at,
            stream,
            report_acceptance,
            accepted,
            pulled,
            pin,
        } = cmd;
        if stream.is_closed() {
            let _ = accepted.send(Err(Status::cancelled("the client went away")));
            return;
        }
        let name = if request_id.is_empty() {
            format!("{}-{}", self.worker_id, self.next_id)
        } else {
            request_id
        };
        if self.name_taken(&name) {
            let _ = accepted.send(Err(Status::already_exists(format!(
                "request id `{name}` is already running on this worker"
            ))));
            return;
        }
        if let Err(s) = self.verify_hashes(&prompt, &block_hashes, &cache_salt) {
            let _ = accepted.send(Err(s));
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        let prompt_tokens = prompt.len();
        let queue_position = self.engine.load().waiting;
        let req = Request {
            id,
            prompt,
            params,
            cache_salt,
            cacheable_len,
            pin,
        };
        if let Err(e) = self.engine.add_request(req) {
            let _ = accepted.send(Err(engine_status(e)));
            return;
        }
        if !pulled.is_empty() {
            self.engine.stage_peer_blocks(id, &pulled);
        }
        // Live before the caller hears of it, so an `Abort` right after finds it.
        self.state.started(&name);
        if accepted.send(Ok(())).is_err() {
            // The call was cancelled while it waited in the queue.
            self.state.ended(&name);
            self.engine.abort(id);
            return;
        }
        let admitted_at = Instant::now();
        self.metrics.accepted(
            (admitted_at - received_at).as_secs_f64(),
            fork_group.is_some(),
        );
        tracing::debug!(
            worker = %self.worker_id,
            request_id = %name,
            engine_id = id,
            prompt_tokens,
            fork_group = fork_group.as_deref().unwrap_or(""),
            "request accepted"
        );
        self.by_name.insert(name.clone(), id);
        self.active.insert(
            id,
            Active {
                name,
                fork: None,
                stream,
                outbox: Outbox::default(),
                received_at,
                admitted_at,
                first_output_at: None,
                prompt_tokens,
                cached_tokens: 0,
                promoted: Default::default(),
                completion_tokens: 0,
                pin: None,
            },
        );
        if report_acceptance {
            self.send_acceptance(id, queue_position);
        }
    }

    /// Tells request `id`'s caller it is queued, before its prefill: a router then
    /// knows it must not send the request elsewhere, however long the queue is.
    fn send_acceptance(&mut self, id: RequestId, queue_position: usize) {
        // Published first: a caller that has its acknowledgement sees the request
        // in `Load`.
        self.publish_load();
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        a.outbox.push(pb::GenerateResponse {
            accepted: Some(pb::Accepted {
                queue_position: u32_of(queue_position),
            }),
            ..Default::default()
        });
        if a.outbox.flush(&a.stream) == Delivery::Closed {
            self.drop_request(id);
        }
    }

    /// Whether `name` is a running request's or an unfinished fork's.
    fn name_taken(&self, name: &str) -> bool {
        self.by_name.contains_key(name) || self.forks.contains_key(name)
    }

    fn start_fork(&mut self, cmd: ForkCommand) {
        let ForkCommand {
            request_id,
            prefix,
            block_hashes,
            cache_salt,
            children,
            fork_group,
            received_at,
            report_acceptance,
            accepted,
        } = cmd;
        if children.iter().any(|c| c.stream.is_closed()) {
            let _ = accepted.send(Err(Status::cancelled("the client went away")));
            return;
        }
        let name = if request_id.is_empty() {
            format!("{}-{}", self.worker_id, self.next_id)
        } else {
            request_id
        };
        let child_names: Vec<String> = (0..children.len()).map(|i| format!("{name}.{i}")).collect();
        if let Some(taken) = std::iter::once(&name)
            .chain(&child_names)
            .find(|n| self.name_taken(n))
        {
            let _ = accepted.send(Err(Status::already_exists(format!(
                "request id `{taken}` is already running on this worker (fork `{name}` \
                 names its children `{name}.<index>`)"
            ))));
            return;
        }
        if let Err(s) = self.verify_hashes(&prefix, &block_hashes, &cache_salt) {
            let _ = accepted.send(Err(s));
            return;
        }
        let prefix_id = self.next_id;
        self.next_id += 1 + children.len() as RequestId;
        let queue_position = self.engine.load().waiting;
        let prefix_len = prefix.len();
        let mut engine_children = Vec::with_capacity(children.len());
        let mut streams = Vec::with_capacity(children.len());
        for (i, c) in children.into_iter().enumerate() {
            streams.push((prefix_len + c.suffix.len(), c.stream));
            engine_children.push(ForkChild {
                id: prefix_id + 1 + i as RequestId,
                suffix: c.suffix,
                params: c.params,
            });
        }
        let fork = ForkRequest {
            id: prefix_id,
            prefix,
            cache_salt,
            children: engine_children,
        };
        if let Err(e) = self.engine.add_fork(fork) {
            let _ = accepted.send(Err(engine_status(e)));
            return;
        }
        for n in std::iter::once(&name).chain(&child_names) {
            self.state.started(n);
        }
        if accepted.send(Ok(())).is_err() {
            // The call was cancelled while it waited in the queue.
            for n in std::iter::once(&name).chain(&child_names) {
                self.state.ended(n);
            }
            self.engine.abort(prefix_id);
            return;
        }
        let admitted_at = Instant::now();
        self.metrics.fork_accepted(
            (admitted_at - received_at).as_secs_f64(),
            streams.len(),
            fork_group.is_some(),
        );
        tracing::debug!(
            worker = %self.worker_id,
            request_id = %name,
            engine_id = prefix_id,
            prefix_tokens = prefix_len,
            children = streams.len(),
            fork_group = fork_group.as_deref().unwrap_or(""),
            "fork accepted"
        );
        let child_ids: Vec<RequestId> = (1..=streams.len() as RequestId)
            .map(|i| prefix_id + i)
            .collect();
        for ((child_name, (prompt_tokens, stream)), &id) in
            child_names.into_iter().zip(streams).zip(&child_ids)
        {
            self.by_name.insert(child_name.clone(), id);
            self.active.insert(
                id,
                Active {
                    name: child_name,
                    fork: Some(name.clone()),
                    stream,
                    outbox: Outbox::default(),
                    received_at,
                    admitted_at,
                    first_output_at: None,
                    prompt_tokens,
                    cached_tokens: 0,
                    promoted: Default::default(),
                    completion_tokens: 0,
                    pin: None,
                },
            );
        }
        self.prefixes.insert(prefix_id, name.clone());
        self.forks.insert(
            name,
            Fork {
                prefix: Some(prefix_id),
                children: child_ids,
                retired_early: Vec::new(),
            },
        );
        if report_acceptance {
            self.send_acceptance(prefix_id + 1, queue_position);
        }
    }

    /// A fork's prefix is computed and its children spawned: those retired meanwhile
    /// are aborted now.
    fn prefix_computed(&mut self, prefix: RequestId) {
        let Some(name) = self.prefixes.remove(&prefix) else {
            return;
        };
        let early = match self.forks.get_mut(&name) {
            Some(f) => {
                f.prefix = None;
                std::mem::take(&mut f.retired_early)
            }
            None => Vec::new(),
        };
        for id in early {
            self.engine.abort(id);
        }
    }

    /// Takes a retired child out of its fork; the last one out aborts the prefix
    /// computation if it still runs, and forgets the fork.
    fn leave_fork(&mut self, name: &str, child: RequestId) {
        let Some(f) = self.forks.get_mut(name) else {
            return;
        };
        f.children.retain(|&c| c != child);
        if f.prefix.is_some() {
            f.retired_early.push(child);
        }
        if !f.children.is_empty() {
            return;
        }
        let prefix = f.prefix;
        self.forks.remove(name);
        self.state.ended(name);
        if let Some(p) = prefix {
            self.prefixes.remove(&p);
            if !self.poisoned {
                self.engine.abort(p);
            }
        }
    }

    /// Forgets a request that is no longer in the engine; a last message its client
    /// has not taken yet is kept until it does.
    fn retire(&mut self, id: RequestId, delivery: Delivery) {
        if let Some(a) = self.active.remove(&id) {
            self.by_name.remove(&a.name);
            self.state.ended(&a.name);
            if let Some(fork) = &a.fork {
                self.leave_fork(fork, id);
            }
            if delivery == Delivery::Buffered {
                self.draining.push(Draining {
                    stream: a.stream,
                    outbox: a.outbox,
                });
            }
        }
    }

    /// Aborts in the engine and forgets a request whose client went away.
    fn drop_request(&mut self, id: RequestId) {
        self.engine.abort(id);
        if let Some(a) = self.active.get(&id) {
            tracing::debug!(worker = %self.worker_id, request_id = %a.name, "client went away; request aborted");
        }
        self.metrics.finished("cancelled");
        self.retire(id, Delivery::Closed);
    }

    /// Aborts a request, or every unfinished child of a fork (and its prefix
    /// computation), by name; returns whether there was one.
    fn abort_by_name(&mut self, name: &str) -> bool {
        if let Some(&id) = self.by_name.get(name) {
            self.abort_request(id);
            return true;
        }
        let Some(f) = self.forks.get(name) else {
            return false;
        };
        for id in f.children.clone() {
            self.abort_request(id);
        }
        true
    }

    /// Aborts an unfinished request, ending its stream with `ABORTED`.
    fn abort_request(&mut self, id: RequestId) {
        self.engine.abort(id);
        let now = Instant::now();
        let delivery = match self.active.get_mut(&id) {
            Some(a) => {
                a.outbox.push(pb::GenerateResponse {
                    finish_reason: pb::FinishReason::Aborted as i32,
                    usage: Some(a.usage()),
                    timings: Some(a.timings(now)),
                    ..Default::default()
                });
                a.outbox.flush(&a.stream)
            }
            None => Delivery::Done,
        };
        self.metrics
            .finished(convert::finish_label(pb::FinishReason::Aborted));
        self.retire(id, delivery);
    }

    fn reap_disconnected(&mut self) {
        let gone: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.stream.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.drop_request(id);
        }
        self.draining.retain(|d| !d.stream.is_closed());
    }

    fn flush_outboxes(&mut self) {
        let mut gone = Vec::new();
        for (id, a) in &mut self.active {
            if !a.outbox.is_empty() && a.outbox.flush(&a.stream) == Delivery::Closed {
                gone.push(*id);
            }
        }
        for id in gone {
            self.drop_request(id);
        }
        self.draining
            .retain_mut(|d| d.outbox.flush(&d.stream) == Delivery::Buffered);
    }

    fn step(&mut self) {
        if let Some(d) = self.faults.step_delay {
            std::thread::sleep(d);
        }
        if self
            .faults
            .panic_after_steps
            .is_some_and(|n| self.steps >= n)
        {
            panic!("fault injected: --fault-panic-after-steps {}", self.steps);
        }
        self.steps += 1;
        match self.progress.step(&mut self.engine) {
            Ok(outputs) => {
                // Before any stream hears of a finish, so a `Load` right after it
                // already counts the request done.
                self.publish_load();
                let now = Instant::now();
                for o in outputs {
                    self.route(o, now);
                }
            }
            Err(e) => {
                tracing::error!(worker = %self.worker_id, error = %e, "engine step failed; failing its requests");
                self.fail_active(Status::internal(format!("engine step failed: {e}")), true);
            }
        }
    }

    fn route(&mut self, o: StepOutput, now: Instant) {
        if o.finish == Some(FinishReason::Prefilled) {
            // A fork's prefix: nobody's stream, its children carry on. Its cached
            // tokens are in the engine's total, so its promoted ones count here.
            self.cached_by_tier.add(&o.promoted);
            self.prefix_computed(o.id);
            return;
        }
        let Some(a) = self.active.get_mut(&o.id) else {
            return;
        };
        a.prompt_tokens = o.prompt_tokens;
        a.cached_tokens = o.cached_tokens;
        a.promoted = o.promoted;
        a.pin = a.pin.or(o.pin);
        let mut msg = pb::GenerateResponse {
            token_ids: o.token.into_iter().collect(),
            text: o.text,
            logprobs: o.logprobs.map(convert::token_logprob).into_iter().collect(),
            ..Default::default()
        };
        if o.token.is_some() {
            a.completion_tokens += 1;
        }
        if a.first_output_at.is_none() {
            // The prompt is computed: tell the router its cached share right away.
            a.first_output_at = Some(now);
            self.cached_by_tier.add(&a.promoted);
            self.metrics
                .first_token((now - a.received_at).as_secs_f64());
            msg.usage = Some(a.usage());
        }
        let finish = o.finish.map(convert::finish_reason);
        if let Some(f) = finish {
            msg.finish_reason = f as i32;
            msg.stop_sequence = o.stop_sequence;
            msg.usage = Some(a.usage());
            msg.timings = Some(a.timings(now));
        }
        a.outbox.push(msg);
        let delivery = a.outbox.flush(&a.stream);
        match (finish, delivery) {
            (Some(f), _) => {
                // The engine already dropped the finished sequence.
                self.metrics.finished(convert::finish_label(f));
                self.retire(o.id, delivery);
            }
            (None, Delivery::Closed) => self.drop_request(o.id),
            (None, _) => {}
        }
    }

    /// The engine scheduled nothing for `MAX_IDLE_STEPS` turns in a row (about two
    /// seconds of polling) with requests unfinished: they can never run, so end them
    /// rather than hold the worker forever.
    fn give_up_stalled(&mut self) {
        tracing::error!(
            worker = %self.worker_id,
            load = ?self.engine.load(),
            "engine made no progress; failing its requests"
        );
        self.fail_active(
            Status::resource_exhausted(
                "no progress: the worker could not schedule its requests (KV pool too \
                 small for them?)",
            ),
            true,
        );
        // Fork prefixes and anything else no stream waits for.
        for id in self.engine.unfinished_ids() {
            self.engine.abort(id);
        }
        self.progress.reset();
    }

    /// Ends every unfinished request with `status`, aborting it in the engine too when
    /// `abort` is set.
    fn fail_active(&mut self, status: Status, abort: bool) {
        self.poisoned |= !abort;
        let ids: Vec<RequestId> = self.active.keys().copied().collect();
        for id in ids {
            if abort {
                self.engine.abort(id);
            }
            let delivery = match self.active.get_mut(&id) {
                Some(a) => {
                    a.outbox.error = Some(status.clone());
                    a.outbox.flush(&a.stream)
                }
                None => Delivery::Done,
            };
            self.metrics.finished("error");
            self.retire(id, delivery);
        }
    }
}
