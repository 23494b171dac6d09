//! The engine: scheduler + backend + sampling, one step at a time.
//!
//! `Engine::step` schedules a batch, runs one forward pass over every scheduled chunk
//! together, samples the sequences whose prompt or previous token was just computed,
//! publishes the KV events the step caused, and returns what each request produced.
//! A worker drives it in a loop on its own thread.

use crate::backend::{ModelBackend, StepShape};
use crate::block_pool::BlockId;
use crate::constrained::SeqConstraint;
use crate::error::{EngineError, Result};
use crate::kv_events::{DumpedBlock, KvEvent, KvEventSink};
use crate::kv_tiers::write_out::WriteOut;
use crate::kv_tiers::KvTiers;
use crate::model::{ForwardItem, LogitsRequest};
use crate::pins::{PinOutcome, PinSet, PinSpec};
use crate::sampling::{Sampler, SamplingParams};
use crate::scheduler::{ScheduledChunk, Scheduler, SchedulerConfig};
use crate::sequence::{FinishReason, PromotedTokens, RequestId, SeqStatus, Sequence};
use crate::stop_matcher::StopMatcher;
use kvfleet_core::structured_output::GrammarCompiler;
use kvfleet_core::tokenizer::{StreamDecoder, Tokenizer};
use kvfleet_core::{namespace_seed, BlockHash, TokenId};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

mod tiering;

/// The share of the pool pins may hold by default: the rest always stays for the
/// sequences running.
pub const DEFAULT_PIN_POOL_FRACTION: f64 = 0.5;

/// The engine's clock for pin expiry (injectable, so tests need not sleep).
pub type PinClock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// How an engine is sized.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Model id: enters every block hash's namespace seed.
    pub model_id: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences admitted at once.
    pub max_num_seqs: usize,
    /// Most tokens per step (chunked-prefill budget).
    pub max_batched_tokens: usize,
    /// Most prompt tokens one sequence runs per step (several prefills share a step).
    pub max_prefill_chunk: usize,
    /// The room kept for what running sequences will still generate.
    pub decode_reserve: crate::decode_reserve::DecodeReserveConfig,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            model_id: "tiny".to_string(),
            block_size: kvfleet_core::DEFAULT_BLOCK_SIZE,
            max_num_seqs: 64,
            max_batched_tokens: kvfleet_core::DEFAULT_MAX_BATCHED_TOKENS,
            max_prefill_chunk: kvfleet_core::DEFAULT_MAX_PREFILL_CHUNK,
            decode_reserve: Default::default(),
        }
    }
}

/// A generation request, in token ids.
#[derive(Clone, Debug)]
pub struct Request {
    /// Caller-chosen id, unique among unfinished requests.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<TokenId>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Cache namespace salt (the tenant's, usually): requests share cached blocks
    /// only when their salts are equal.
    pub cache_salt: String,
    /// Prompt tokens from this index on never enter the shared prefix cache (a
    /// per-request status tail). `None`: the whole prompt is cacheable.
    pub cacheable_len: Option<usize>,
    /// Pin the prompt's leading full blocks once computed (Anthropic's
    /// `cache_control.ttl`); the outcome is reported with the first output.
    pub pin: Option<PinSpec>,
}

impl Request {
    /// A request with default salt and a fully cacheable prompt.
    pub fn new(id: RequestId, prompt: Vec<TokenId>, params: SamplingParams) -> Self {
        Request {
            id,
            prompt,
            params,
            cache_salt: String::new(),
            cacheable_len: None,
            pin: None,
        }
    }
}

/// One child of a fork: its own tail after the shared prefix.
#[derive(Clone, Debug)]
pub struct ForkChild {
    /// The child's request id.
    pub id: RequestId,
    /// Tokens appended to the shared prefix (tool results, directive...).
    pub suffix: Vec<TokenId>,
    /// The child's sampling parameters.
    pub params: SamplingParams,
}

/// A shared prefix computed once, then forked into children that share its blocks.
#[derive(Clone, Debug)]
pub struct ForkRequest {
    /// Id of the prefix computation itself (reported with `FinishReason::Prefilled`).
    pub id: RequestId,
    /// The shared prefix.
    pub prefix: Vec<TokenId>,
    /// Cache namespace salt.
    pub cache_salt: String,
    /// The children.
    pub children: Vec<ForkChild>,
}

/// What one request produced in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The request.
    pub id: RequestId,
    /// The token sampled this step, if any (stop tokens are not reported).
    pub token: Option<TokenId>,
    /// Text that may be sent now (stop strings held back and cut).
    pub text: String,
    /// Set when the request is done.
    pub finish: Option<FinishReason>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (set from the step the prompt
    /// was first fully computed on).
    pub cached_tokens: usize,
    /// The part of `cached_tokens` promoted from a lower tier or a peer, by source.
    pub promoted: PromotedTokens,
    /// The logits the token was sampled from, when logits capture is on.
    pub logits: Option<Vec<f32>>,
    /// The reported token's log-probabilities, when its request asked for them.
    pub logprobs: Option<crate::sampling::TokenLogprobs>,
    /// What became of the request's pin: set on the output of the step its prompt was
    /// first fully computed on, when the request asked for one.
    pub pin: Option<PinOutcome>,
    /// The stop string that ended the request (with `finish` `Stop`), if one did.
    pub stop_sequence: Option<String>,
}

/// Everything a request produced, gathered by [`Engine::run_to_completion`].
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The request.
    pub id: RequestId,
    /// Generated token ids.
    pub tokens: Vec<TokenId>,
    /// Generated text (empty without a tokenizer).
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens served from cache.
    pub cached_tokens: usize,
}

/// A snapshot of the engine's load, as a router scores it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineLoad {
    /// Admitted sequences.
    pub running: usize,
    /// Queued sequences.
    pub waiting: usize,
    /// Blocks available for allocation.
    pub free_blocks: usize,
    /// Ready cached prefix blocks.
    pub cached_blocks: usize,
    /// All blocks.
    pub total_blocks: usize,
    /// Prompt tokens not yet computed.
    pub queued_prefill_tokens: usize,
    /// Blocks a new sequence may take now: the free blocks less the running
    /// sequences' expected growth ([`Scheduler::admit_headroom`]).
    pub admit_blocks: usize,
}

/// Running totals since the engine started.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Prompt tokens received.
    pub prompt_tokens: u64,
    /// Prompt tokens actually run through the model (recomputation included).
    pub prompt_tokens_computed: u64,
    /// Prompt tokens reported as cached.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Preemptions (recompute) so far.
    pub preemptions: u64,
    /// Disk reads of promoted prefix blocks that landed (progress without a step).
    pub tier_loads: u64,
    /// Nanoseconds the engine thread spent on write-behind between steps: landing
    /// the write-out thread's copies in the host tier, and copying what they missed
    /// (`TierStats::demoted_off_thread` says how many blocks were copied where).
    pub demotion_ns: u64,
    /// Nanoseconds spent in the model's forward passes.
    pub forward_ns: u64,
}

/// A continuous-batching engine over one backend.
pub struct Engine {
    config: EngineConfig,
    backend: Box<dyn ModelBackend>,
    tokenizer: Option<Arc<dyn Tokenizer>>,
    scheduler: Scheduler,
    eos: HashSet<TokenId>,
    sink: Option<Arc<dyn KvEventSink>>,
    event_seq: u64,
    arrivals: u64,
    forks: HashMap<RequestId, (String, Vec<ForkChild>)>,
    stats: EngineStats,
    capture_logits: bool,
    /// The model's token trie for structured outputs, built on the first constrained
    /// request (once per model load; engines that never see one never build it).
    grammars: OnceLock<std::result::Result<Arc<GrammarCompiler>, String>>,
    /// Compiled grammars of fork children not spawned yet.
    fork_constraints: HashMap<RequestId, Box<SeqConstraint>>,
    /// Host and disk tiers below the pool, when configured (see `tiering`).
    tiers: Option<KvTiers>,
    /// The thread copying blocks down while the engine steps, when tiers are on and
    /// the backend's KV memory can be read from another thread.
    write_out: Option<WriteOut>,
    /// Requests waiting on each block being read from disk.
    awaiting: HashMap<BlockHash, Vec<RequestId>>,
    /// Pinned prefix blocks (see `pins`).
    pins: PinSet,
    /// The clock pins expire by.
    clock: PinClock,
}

impl Engine {
    /// An engine over `backend`; its block count is the backend's.
    pub fn new(
        config: EngineConfig,
        backend: Box<dyn ModelBackend>,
        tokenizer: Option<Arc<dyn Tokenizer>>,
    ) -> Result<Self> {
        if config.block_size == 0
            || config.max_num_seqs == 0
            || config.max_batched_tokens == 0
            || config.max_prefill_chunk == 0
        {
            return Err(EngineError::Config(
                "block_size, max_num_seqs, max_batched_tokens and max_prefill_chunk must be positive"
                    .into(),
            ));
        }
        let mut eos: HashSet<TokenId> = tokenizer
            .as_ref()
            .map(|t| t.eos_token_ids().into_iter().collect())
            .unwrap_or_default();
        eos.extend(backend.config().eos_token_ids());
        let mut pins = PinSet::new();
        pins.set_capacity(pin_capacity(
            backend.num_blocks(),
            DEFAULT_PIN_POOL_FRACTION,
        ));
        let scheduler = Scheduler::new(
            SchedulerConfig {
                block_size: config.block_size,
                max_num_seqs: config.max_num_seqs,
                max_batched_tokens: config.max_batched_tokens,
                max_prefill_chunk: config.max_prefill_chunk,
                decode_reserve: config.decode_reserve,
            },
            backend.num_blocks(),
        );
        Ok(Engine {
            config,
            backend,
            tokenizer,
            scheduler,
            eos,
            sink: None,
            event_seq: 0,
            arrivals: 0,
            forks: HashMap::new(),
            stats: EngineStats::default(),
            capture_logits: false,
            grammars: OnceLock::new(),
            fork_constraints: HashMap::new(),
            tiers: None,
            write_out: None,
            awaiting: HashMap::new(),
            pins,
            clock: Arc::new(Instant::now),
        })
    }

    /// Lets pins hold at most `fraction` (0 to 1) of the pool; a pin past it is refused
    /// and its request served unpinned. Pins already held stay until they expire.
    pub fn set_pin_pool_fraction(&mut self, fraction: f64) {
        let cap = pin_capacity(self.scheduler.pool.num_blocks(), fraction);
        self.pins.set_capacity(cap);
    }

    /// Most blocks pins may hold at once.
    pub fn pin_capacity(&self) -> usize {
        self.pins.capacity()
    }

    /// Blocks pinned now.
    pub fn pinned_blocks(&self) -> usize {
        self.pins.len()
    }

    /// Replaces the clock pins expire by (tests drive it by hand).
    pub fn set_pin_clock(&mut self, clock: PinClock) {
        self.clock = clock;
    }

    /// Sends every future KV event to `sink`.
    pub fn set_event_sink(&mut self, sink: Arc<dyn KvEventSink>) {
        self.sink = Some(sink);
    }

    /// Returns the logits behind every sampled token in [`StepOutput::logits`]
    /// (for numerical checks and debugging; it copies a vocabulary-sized row per token).
    pub fn set_logits_capture(&mut self, on: bool) {
        self.capture_logits = on;
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The backend's model configuration.
    pub fn model_config(&self) -> &crate::model_config::ModelConfig {
        self.backend.config()
    }

    /// The seed of a cache namespace for `cache_salt` under this engine's model id.
    pub fn namespace_seed(&self, cache_salt: &str) -> u64 {
        namespace_seed(&self.config.model_id, cache_salt)
    }

    /// Sequence number of the last KV event published (0 before any).
    pub fn last_event_seq(&self) -> u64 {
        self.event_seq
    }

    /// Queues a request after checking it can ever be served.
    pub fn add_request(&mut self, req: Request) -> Result<()> {
        self.validate(req.id, &req.prompt, &req.params)?;
        let constraint = self.constraint(&req.params)?;
        if let Some(pin) = &req.pin {
            if pin.ttl.is_zero() || pin.ttl > crate::pins::MAX_PIN_TTL {
                return Err(EngineError::InvalidRequest(format!(
                    "a pin's ttl must be between 1 ms and {} s, got {:?}",
                    crate::pins::MAX_PIN_TTL.as_secs(),
                    pin.ttl
                )));
            }
        }
        let cacheable = req.cacheable_len.unwrap_or(usize::MAX);
        let mut seq = self.new_sequence(
            req.id,
            req.prompt,
            req.params,
            &req.cache_salt,
            cacheable,
            false,
        );
        seq.constraint = constraint;
        seq.pin = req.pin;
        self.stats.prompt_tokens += seq.prompt_len as u64;
        self.scheduler.enqueue(seq);
        Ok(())
    }

    /// The compiled grammar of a request that has one; a grammar llguidance rejects
    /// is an [`EngineError::InvalidRequest`] with its message.
    fn constraint(&self, params: &SamplingParams) -> Result<Option<Box<SeqConstraint>>> {
        let Some(grammar) = &params.grammar else {
            return Ok(None);
        };
        let compiler = self
            .grammars
            .get_or_init(|| {
                let tokenizer = self
                    .tokenizer
                    .as_ref()
                    .ok_or("structured outputs need the model's tokenizer")?;
                GrammarCompiler::new(tokenizer.as_ref(), self.backend.config().vocab_size)
                    .map(Arc::new)
            })
            .as_ref()
            .map_err(|e| EngineError::InvalidRequest(format!("structured outputs: {e}")))?;
        SeqConstraint::new(compiler, grammar)
            .map(|c| Some(Box::new(c)))
            .map_err(EngineError::InvalidRequest)
    }

    /// Queues a fork: the prefix is computed once, then each child continues from a
    /// copy-on-write fork of it (sharing every full block, copying the partial one).
    pub fn add_fork(&mut self, fork: ForkRequest) -> Result<()> {
        if fork.children.is_empty() {
            return Err(EngineError::InvalidRequest(
                "a fork needs at least one child".into(),
            ));
        }
        let mut ids = HashSet::new();
        ids.insert(fork.id);
        for c in &fork.children {
            if !ids.insert(c.id) {
                return Err(EngineError::InvalidRequest(format!(
                    "duplicate request id {}",
                    c.id
                )));
            }
            let mut full = fork.prefix.clone();
            full.extend_from_slice(&c.suffix);
            if c.suffix.is_empty() {
                return Err(EngineError::InvalidRequest(
                    "a fork child needs a non-empty suffix".into(),
                ));
            }
            self.validate(c.id, &full, &c.params)?;
        }
        let mut constraints = HashMap::new();
        for c in &fork.children {
            if let Some(k) = self.constraint(&c.params)? {
                constraints.insert(c.id, k);
            }
        }
        self.fork_constraints.extend(constraints);
        let params = SamplingParams {
            max_tokens: 1,
            ..SamplingParams::default()
        };
        self.validate(fork.id, &fork.prefix, &params)?;
        let seq = self.new_sequence(
            fork.id,
            fork.prefix,
            params,
            &fork.cache_salt,
            usize::MAX,
            true,
        );
        self.stats.prompt_tokens += seq.prompt_len as u64;
        self.forks.insert(fork.id, (fork.cache_salt, fork.children));
        self.scheduler.enqueue(seq);
        Ok(())
    }

    /// Stops a request; returns whether it was known. Its blocks are released.
    pub fn abort(&mut self, id: RequestId) -> bool {
        // Aborting a fork parent aborts the children it has not spawned yet.
        let had_fork = match self.forks.remove(&id) {
            Some((_, children)) => {
                for c in children {
                    self.fork_constraints.remove(&c.id);
                }
                true
            }
            None => false,
        };
        self.scheduler.remove(id).is_some() || had_fork
    }

    /// Every unfinished request's id (fork prefixes included).
    pub fn unfinished_ids(&self) -> Vec<RequestId> {
        self.scheduler.seqs.keys().copied().collect()
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        !self.scheduler.seqs.is_empty()
    }

    /// Current load.
    pub fn load(&self) -> EngineLoad {
        EngineLoad {
            running: self.scheduler.running.len(),
            waiting: self.scheduler.waiting.len(),
            free_blocks: self.scheduler.pool.num_free(),
            cached_blocks: self.scheduler.pool.num_cached(),
            total_blocks: self.scheduler.pool.num_blocks(),
            queued_prefill_tokens: self.scheduler.queued_prefill_tokens(),
            admit_blocks: self.scheduler.admit_headroom(),
        }
    }

    /// Totals since start.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Every cached block with its parent and tier, for a router's resync.
    pub fn cache_dump(&self) -> Vec<DumpedBlock> {
        let mut out: Vec<DumpedBlock> = self
            .scheduler
            .pool
            .cached_blocks()
            .into_iter()
            .map(|(hash, parent)| DumpedBlock::device(hash, parent))
            .collect();
        out.extend(
            self.tier_blocks()
                .into_iter()
                .map(|(hash, parent, medium)| DumpedBlock {
                    hash,
                    parent,
                    medium,
                }),
        );
        out
    }

    /// Drops the whole prefix cache, tiers included (a `Cleared` event follows).
    pub fn clear_cache(&mut self) {
        self.pins.clear(&mut self.scheduler.pool);
        self.scheduler.pool.clear();
        self.clear_tiers();
        self.publish_events();
    }

    /// Checks the block pool's invariants; for tests.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.scheduler.pool.check_invariants()
    }

    /// Runs one step and returns what each request produced.
    pub fn step(&mut self) -> Result<Vec<StepOutput>> {
        if !self.pins.is_empty() {
            self.pins.expire(&mut self.scheduler.pool, (self.clock)());
        }
        // Before anything below allocates (promotions, then the schedule).
        self.write_behind(0);
        self.stats.tier_loads += self.promote(Duration::ZERO) as u64;
        let mut chunks = self.scheduler.schedule();
        if chunks.is_empty() && self.disk_reads_pending() {
            // Nothing runnable but a prefix on its way from disk: wait for it here
            // rather than spin, then try again.
            self.stats.tier_loads += self.promote(tiering::DISK_WAIT) as u64;
            chunks = self.scheduler.schedule();
        }
        self.stats.preemptions += self.scheduler.preempted_last_step.len() as u64;
        let mut outputs = Vec::new();
        for id in std::mem::take(&mut self.scheduler.exhausted) {
            self.end_exhausted(id, &mut outputs);
        }
        if chunks.is_empty() {
            self.publish_events();
            return Ok(outputs);
        }
        self.stats.steps += 1;
        let logits = {
            let seqs = &self.scheduler.seqs;
            let mut items = Vec::with_capacity(chunks.len());
            let mut shape = StepShape::default();
            for c in &chunks {
                let s = seqs.get(&c.seq).ok_or_else(|| {
                    EngineError::InvalidRequest(format!("lost sequence {}", c.seq))
                })?;
                let ends = c.start + c.len == s.tokens.len();
                let last = ends && !s.prefill_only;
                if c.len == 1 && c.start >= s.prompt_len {
                    shape.decode_rows += 1;
                } else {
                    shape.prefill_tokens += c.len;
                    shape.prompts_finished += usize::from(ends);
                }
                items.push(ForwardItem {
                    tokens: &s.tokens[c.start..c.start + c.len],
                    start_pos: c.start,
                    block_table: &s.block_table,
                    logits: if last {
                        LogitsRequest::Last
                    } else {
                        LogitsRequest::None
                    },
                });
            }
            let started = Instant::now();
            let logits = self.backend.forward_step(&items, shape)?;
            let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.stats.forward_ns = self.stats.forward_ns.saturating_add(ns);
            logits
        };
        let mut prefilled = Vec::new();
        for (chunk, row) in chunks.iter().zip(logits) {
            if let Some(s) = self.scheduler.seqs.get(&chunk.seq) {
                let end = (chunk.start + chunk.len).min(s.prompt_len);
                self.stats.prompt_tokens_computed += end.saturating_sub(chunk.start) as u64;
            }
            self.commit_chunk(chunk, &row, &mut outputs, &mut prefilled);
        }
        for id in prefilled {
            self.spawn_fork_children(id);
        }
        for o in &outputs {
            if o.finish.is_some() {
                self.scheduler.remove(o.id);
            }
        }
        self.publish_events();
        Ok(outputs)
    }

    /// Drives the engine until every request has finished; returns the completions.
    pub fn run_to_completion(&mut self) -> Result<Vec<Completion>> {
        let mut acc: HashMap<RequestId, Completion> = HashMap::new();
        let mut done = Vec::new();
        let mut progress = ProgressGuard::new();
        while self.has_unfinished() {
            let outs = progress.step(self)?;
            if progress.idle_steps() > MAX_IDLE_STEPS {
                return Err(EngineError::OutOfBlocks(
                    "no progress: requests cannot be scheduled".into(),
                ));
            }
            for o in outs {
                let c = acc.entry(o.id).or_insert_with(|| Completion {
                    id: o.id,
                    tokens: Vec::new(),
                    text: String::new(),
                    finish: FinishReason::Length,
                    prompt_tokens: o.prompt_tokens,
                    cached_tokens: 0,
                });
                c.tokens.extend(o.token);
                c.text.push_str(&o.text);
                c.cached_tokens = o.cached_tokens;
                if let Some(f) = o.finish {
                    c.finish = f;
                    if let Some(c) = acc.remove(&o.id) {
                        done.push(c);
                    }
                }
            }
        }
        done.sort_by_key(|c| c.id);
        Ok(done)
    }

    fn validate(&self, id: RequestId, prompt: &[TokenId], params: &SamplingParams) -> Result<()> {
        params.validate()?;
        if self.scheduler.seqs.contains_key(&id)
            || self
                .forks
                .values()
                .any(|(_, cs)| cs.iter().any(|c| c.id == id))
        {
            return Err(EngineError::InvalidRequest(format!(
                "request id {id} is already in use"
            )));
        }
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        let cfg = self.backend.config();
        let ctx = cfg.max_position_embeddings;
        if prompt.len() >= ctx {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens; this model's context length is {ctx}",
                prompt.len()
            )));
        }
        if let Some(bad) = prompt.iter().find(|t| **t as usize >= cfg.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (size {})",
                cfg.vocab_size
            )));
        }
        if let Some((bad, _)) = params
            .logit_bias
            .iter()
            .find(|(t, _)| *t as usize >= cfg.vocab_size)
        {
            return Err(EngineError::InvalidRequest(format!(
                "logit_bias token id {bad} is outside the vocabulary (size {})",
                cfg.vocab_size
            )));
        }
        let need = kvfleet_core::blocks_to_start(prompt.len(), self.config.block_size);
        if need > self.scheduler.pool.num_blocks() {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt needs {need} KV blocks; this worker has {}",
                self.scheduler.pool.num_blocks()
            )));
        }
        Ok(())
    }

    fn new_sequence(
        &mut self,
        id: RequestId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        salt: &str,
        cacheable_len: usize,
        prefill_only: bool,
    ) -> Sequence {
        self.arrivals += 1;
        let sampler = Sampler::new(&params, id ^ 0x9e37_79b9_7f4a_7c15);
        let mut seq = Sequence {
            id,
            arrival: self.arrivals,
            prompt_len: prompt.len(),
            tokens: prompt,
            block_table: Vec::new(),
            num_computed: 0,
            hashes: Vec::new(),
            namespace: self.namespace_seed(salt),
            cacheable_len,
            status: SeqStatus::Waiting,
            stop: StopMatcher::new(&params.stop),
            params,
            sampler,
            prompt_tokens_computed: 0,
            cached_tokens: None,
            prefill_only,
            preemptions: 0,
            decoder: StreamDecoder::new(),
            block_size: self.config.block_size,
            constraint: None,
            staged: Vec::new(),
            staged_free: 0,
            awaiting_loads: 0,
            tier_staged: false,
            promoted: Default::default(),
            pin: None,
        };
        seq.extend_hashes();
        seq
    }

    fn commit_chunk(
        &mut self,
        chunk: &ScheduledChunk,
        logits: &[f32],
        outputs: &mut Vec<StepOutput>,
        prefilled: &mut Vec<RequestId>,
    ) {
        self.scheduler.commit(chunk);
        let max_pos = self.backend.config().max_position_embeddings;
        // The pool is this worker's context limit too: a sequence as long as the whole
        // pool could not compute its next token even running alone.
        let pool_tokens = self.scheduler.pool.num_blocks() * self.config.block_size;
        let Some(seq) = self.scheduler.seqs.get_mut(&chunk.seq) else {
            return;
        };
        if seq.num_computed < seq.tokens.len() {
            return;
        }
        let mut pin = None;
        if seq.cached_tokens.is_none() {
            let cached = seq.prompt_len.saturating_sub(seq.prompt_tokens_computed);
            seq.cached_tokens = Some(cached);
            self.stats.cached_tokens += cached as u64;
            // Every full block of the prompt is ready now: pin the leading ones asked for.
            if let Some(spec) = seq.pin.take() {
                let n = spec.blocks.min(seq.hashes.len());
                let now = (self.clock)();
                pin =
                    Some(
                        self.pins
                            .pin(&mut self.scheduler.pool, &seq.hashes[..n], spec.ttl, now),
                    );
            }
        }
        let cached_tokens = seq.cached_tokens.unwrap_or(0);
        if seq.prefill_only {
            seq.status = SeqStatus::Finished(FinishReason::Prefilled);
            prefilled.push(seq.id);
            outputs.push(StepOutput {
                id: seq.id,
                token: None,
                text: String::new(),
                finish: Some(FinishReason::Prefilled),
                prompt_tokens: seq.prompt_len,
                cached_tokens,
                promoted: seq.promoted,
                logits: None,
                logprobs: None,
                pin,
                stop_sequence: None,
            });
            return;
        }
        // Only a constrained sequence takes the masked path (see constrained.rs).
        let (token, grammar_done) = match seq.constraint.as_mut() {
            None => (seq.sampler.sample(logits), false),
            Some(c) => {
                let eos = c.eos();
                // A matcher failure ends the sequence with what it has so far.
                let token = c.sample(&mut seq.sampler, logits).unwrap_or(eos);
                (token, c.commit(token).unwrap_or(true))
            }
        };
        let mut out = StepOutput {
            id: seq.id,
            token: None,
            text: String::new(),
            finish: None,
            prompt_tokens: seq.prompt_len,
            cached_tokens,
            promoted: seq.promoted,
            logits: self.capture_logits.then(|| logits.to_vec()),
            logprobs: None,
            pin,
            stop_sequence: None,
        };
        let grammar_eos = seq.constraint.as_ref().map(|c| c.eos());
        let is_stop_token = seq.params.stop_token_ids.contains(&token)
            || grammar_eos == Some(token)
            || (!seq.params.ignore_eos && self.eos.contains(&token));
        if is_stop_token {
            out.finish = Some(FinishReason::Stop);
            if let Some(t) = &self.tokenizer {
                out.text = seq.decoder.finish(t.as_ref()).unwrap_or_default();
                out.text = seq.stop.push(&out.text).emit + &seq.stop.flush();
            }
        } else {
            seq.tokens.push(token);
            seq.extend_hashes();
            self.stats.generated_tokens += 1;
            out.token = Some(token);
            // Only requests that ask pay for the log-softmax.
            out.logprobs = seq
                .params
                .logprobs
                .map(|k| crate::sampling::token_logprobs(logits, token, k));
            if let Some(t) = &self.tokenizer {
                let delta = seq.decoder.push(t.as_ref(), token).unwrap_or_default();
                let check = seq.stop.push(&delta);
                out.text = check.emit;
                if check.stopped {
                    out.finish = Some(FinishReason::Stop);
                }
            }
            if out.finish.is_none() && grammar_done {
                // The grammar allows nothing more: the output is complete.
                out.finish = Some(FinishReason::Stop);
                if let Some(t) = &self.tokenizer {
                    out.text.push_str(&seq.finish_text(t.as_ref()).0);
                }
            }
            if out.finish.is_none()
                && (seq.num_generated() >= seq.params.max_tokens
                    || seq.tokens.len() >= max_pos
                    || seq.tokens.len() >= pool_tokens)
            {
                out.finish = Some(FinishReason::Length);
                if let Some(t) = &self.tokenizer {
                    let (rest, stopped) = seq.finish_text(t.as_ref());
                    out.text.push_str(&rest);
                    if stopped {
                        out.finish = Some(FinishReason::Stop);
                    }
                }
            }
        }
        if let Some(f) = out.finish {
            seq.status = SeqStatus::Finished(f);
            out.stop_sequence = seq.stop.matched().map(str::to_string);
        }
        outputs.push(out);
    }

    /// Ends a sequence the scheduler found unable to grow in the whole pool, with
    /// `Length` and whatever text it still held back; a fork parent's children end
    /// with it (they were never spawned).
    fn end_exhausted(&mut self, id: RequestId, outputs: &mut Vec<StepOutput>) {
        let Some(seq) = self.scheduler.seqs.get_mut(&id) else {
            return;
        };
        if seq.prefill_only {
            let prefix_len = seq.prompt_len;
            if let Some((_, children)) = self.forks.remove(&id) {
                for c in &children {
                    self.fork_constraints.remove(&c.id);
                }
                outputs.extend(children.into_iter().map(|c| StepOutput {
                    id: c.id,
                    token: None,
                    text: String::new(),
                    finish: Some(FinishReason::Length),
                    prompt_tokens: prefix_len + c.suffix.len(),
                    cached_tokens: 0,
                    promoted: PromotedTokens::default(),
                    logits: None,
                    logprobs: None,
                    pin: None,
                    stop_sequence: None,
                }));
            }
        } else {
            let (text, stopped) = match &self.tokenizer {
                Some(t) => seq.finish_text(t.as_ref()),
                None => (String::new(), false),
            };
            let finish = match stopped {
                true => FinishReason::Stop,
                false => FinishReason::Length,
            };
            outputs.push(StepOutput {
                id,
                token: None,
                text,
                finish: Some(finish),
                prompt_tokens: seq.prompt_len,
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                promoted: seq.promoted,
                logits: None,
                logprobs: None,
                pin: None,
                stop_sequence: seq.stop.matched().map(str::to_string),
            });
        }
        self.scheduler.remove(id);
    }

    /// Turns a finished fork parent into its children: each shares the parent's full
    /// blocks by reference and gets its own copy of the partial last block.
    fn spawn_fork_children(&mut self, parent_id: RequestId) {
        let Some((salt, children)) = self.forks.remove(&parent_id) else {
            return;
        };
        let bs = self.config.block_size;
        let Some(parent) = self.scheduler.seqs.get(&parent_id) else {
            return;
        };
        let prefix = parent.tokens.clone();
        let full = prefix.len() / bs;
        let shared: Vec<BlockId> =
            parent.block_table[..full.min(parent.block_table.len())].to_vec();
        let partial = parent
            .block_table
            .get(full)
            .copied()
            .filter(|_| prefix.len() % bs != 0);
        let parent_arrival = parent.arrival;
        for child in children {
            let mut tokens = prefix.clone();
            tokens.extend_from_slice(&child.suffix);
            let mut seq =
                self.new_sequence(child.id, tokens, child.params, &salt, usize::MAX, false);
            seq.arrival = parent_arrival;
            seq.constraint = self.fork_constraints.remove(&child.id);
            self.stats.prompt_tokens += seq.prompt_len as u64;
            for &b in &shared {
                self.scheduler.pool.share(b);
                seq.block_table.push(b);
            }
            seq.num_computed = shared.len() * bs;
            if let Some(src) = partial {
                if let Some(dst) = self.scheduler.pool.allocate() {
                    self.backend.copy_block(src, dst);
                    seq.block_table.push(dst);
                    seq.num_computed = prefix.len();
                }
            }
            if self.scheduler.running.len() < self.config.max_num_seqs {
                seq.status = SeqStatus::Running;
                let id = seq.id;
                self.scheduler.seqs.insert(id, seq);
                self.scheduler.running.push(id);
            } else {
                // No room to run it now: queue it; its prefix is still cached.
                for b in seq.block_table.drain(..).rev() {
                    self.scheduler.pool.release(b, seq.id);
                }
                seq.num_computed = 0;
                self.scheduler.enqueue(seq);
            }
        }
    }

    fn publish_events(&mut self) {
        let mut kinds = self.scheduler.pool.drain_events();
        let below = self.tier_events(&kinds);
        kinds.extend(below);
        for kind in kinds {
            self.event_seq += 1;
            if let Some(sink) = &self.sink {
                sink.publish(&KvEvent {
                    seq: self.event_seq,
                    kind,
                });
            }
        }
    }
}

/// Blocks pins may hold in a pool of `num_blocks` at `fraction` (clamped to 0..=1).
fn pin_capacity(num_blocks: usize, fraction: f64) -> usize {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    (num_blocks as f64 * f).floor() as usize
}

/// Consecutive steps that scheduled nothing after which
/// [`Engine::run_to_completion`] gives up: the waiting requests can never be scheduled.
pub const MAX_IDLE_STEPS: usize = 1000;

/// The one no-progress guard of every engine driver ([`Engine::run_to_completion`] and
/// the worker's engine loop): a step made progress when it scheduled work (a forward
/// pass ran), whether or not it produced output yet (a long prompt's prefill chunks
/// produce none).
#[derive(Debug, Default)]
pub struct ProgressGuard {
    idle_steps: usize,
}

impl ProgressGuard {
    /// No step seen yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs one engine step and records whether it made progress.
    pub fn step(&mut self, engine: &mut Engine) -> Result<Vec<StepOutput>> {
        let before = (engine.stats.steps, engine.stats.tier_loads);
        let out = engine.step();
        if (engine.stats.steps, engine.stats.tier_loads) == before {
            self.idle_steps += 1;
        } else {
            self.idle_steps = 0;
        }
        out
    }

    /// Whether the last step scheduled nothing (retrying at once would spin).
    pub fn stalled(&self) -> bool {
        self.idle_steps > 0
    }

    /// Consecutive steps that scheduled nothing.
    pub fn idle_steps(&self) -> usize {
        self.idle_steps
    }

    /// Forgets past idle steps (the engine has nothing left to do).
    pub fn reset(&mut self) {
        self.idle_steps = 0;
    }
}
