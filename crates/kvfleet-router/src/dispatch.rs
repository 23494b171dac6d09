//! Sending one request to a worker: route it, call the worker, and retry on another
//! worker while none has accepted it.
//!
//! A worker acknowledges a request as soon as its engine queues it (an `accepted`
//! message, before the prefill). The first-token deadline bounds only that
//! acknowledgement (or, from a worker too old to send one, the first token); from then
//! on the request is the worker's, and a separate, longer deadline bounds its time in
//! the queue. Past it the request is aborted and the client told, never re-prefilled
//! elsewhere: a deep queue is load, not a failure. Only a transport failure of the
//! worker before its first token (a dead process or connection) sends an accepted
//! request elsewhere: the client has been sent nothing, and the worker's queue is gone.

use crate::circuit_breaker::CircuitState;
use crate::control_hooks::{ControlHooks, PlacementRef, RequestFacts, RequestUsage};
use crate::decision_log::{NewDecision, PlacementStep};
use crate::fleet::Fleet;
use crate::fleet_metrics as m;
use crate::openai::error::ApiError;
use crate::placement_claims::{ClaimTicket, ClaimTurn};
use crate::routing_state::{InFlight, RouteRequest, Routed};
use crate::wall_clock::unix_ms;
use crate::worker_conn::WorkerConn;
use kvfleet_core::openai::Usage;
use kvfleet_core::BlockHash;
use kvfleet_proto::v1 as pb;
use kvfleet_routing::policy::anchor_block;
use kvfleet_routing::policy::PolicyKind;
use kvfleet_routing::{Pin, RouteDecision};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;

/// How often a request queued on a worker checks that the worker is still alive.
const LIVENESS_CHECK: Duration = Duration::from_millis(200);

/// What the router sends a worker for one request.
#[derive(Clone, Debug)]
pub struct GenerationSpec {
    /// Request id (also used for Abort).
    pub request_id: String,
    /// Prompt ids, shared by every attempt and the relay, never copied.
    pub token_ids: Arc<[u32]>,
    /// Chained hashes of the prompt's full blocks, shared with the routing core.
    pub hashes: Arc<[BlockHash]>,
    /// Sampling parameters.
    pub sampling: pb::SamplingParams,
    /// Cache namespace salt.
    pub cache_salt: String,
    /// Where the uncacheable tail starts.
    pub cacheable_len: Option<u32>,
    /// Fork group, if the client named one.
    pub fork_group: Option<String>,
    /// Session, if the client named one.
    pub session: Option<String>,
    /// Routing policy.
    pub policy: PolicyKind,
    /// The HTTP endpoint it came in on (`chat`, `completions`, `forks`), for the
    /// decision log.
    pub endpoint: &'static str,
    /// Pin the prompt's leading blocks on the worker (budget already reserved).
    pub pin: Option<pb::PinRequest>,
}

/// A request the chosen worker accepted: its first message is in hand. `T` is the
/// stream's message: a `GenerateResponse`, or a `ForkResponse` for a fork.
pub struct Dispatched<T = pb::GenerateResponse> {
    /// The serving worker.
    pub worker: String,
    /// The request id the worker knows it by.
    pub request_id: String,
    /// The first message (usage of the prompt; maybe tokens).
    pub first: T,
    /// The rest of the stream.
    pub stream: tonic::Streaming<T>,
    /// Releases the router's in-flight bookkeeping when dropped.
    pub guard: InflightGuard,
    /// When the request reached the router.
    pub started: Instant,
    /// What the control plane's usage records need.
    pub facts: RequestFacts,
    /// What [`dispatch`] started, so that a generation whose worker fails before it
    /// reached the client can start over elsewhere ([`dispatch_excluding`]); `None`
    /// for a fork, whose children are the fork's.
    pub spec: Option<Arc<GenerationSpec>>,
}

/// Keeps a request counted as in flight on its worker until dropped, with what the
/// router predicted for it.
pub struct InflightGuard {
    in_flight: InFlight,
    /// Policy that chose the worker.
    pub policy: &'static str,
    /// The request's entry in the fleet's decision log.
    pub decision_seq: u64,
}

impl InflightGuard {
    /// Takes over the in-flight count of a routed request.
    fn new(in_flight: InFlight, decision: &RouteDecision) -> Self {
        InflightGuard {
            in_flight,
            policy: decision.policy,
            decision_seq: 0,
        }
    }

    /// Cached tokens the router predicted.
    pub fn predicted_cached_tokens(&self) -> usize {
        self.in_flight.predicted_cached_tokens()
    }

    /// The request's first token came: its prefill leaves the worker's backlog now.
    pub fn prefill_done(&self) {
        self.in_flight.prefill_done();
    }

    /// The worker served `actual` prompt tokens from cache: recorded against the
    /// prediction when the request ends.
    pub fn record_outcome(&self, actual: usize) {
        self.in_flight.record_outcome(actual);
    }
}

/// Routes and starts `spec`, retrying elsewhere while no worker has started it.
pub async fn dispatch(
    fleet: &Arc<Fleet>,
    spec: &Arc<GenerationSpec>,
) -> Result<Dispatched, ApiError> {
    dispatch_excluding(fleet, spec, &[]).await
}

/// [`dispatch`] on any worker but those in `exclude` (which already failed it).
pub async fn dispatch_excluding(
    fleet: &Arc<Fleet>,
    spec: &Arc<GenerationSpec>,
    exclude: &[String],
) -> Result<Dispatched, ApiError> {
    let block_size = fleet.config.router.block_size as u32;
    let mut d = dispatch_with(fleet, spec, exclude, |conn, pull| {
        let req = pb::GenerateRequest {
            pull,
            request_id: spec.request_id.clone(),
            model: String::new(),
            // The wire message owns its ids: the one copy, made as it is encoded.
            token_ids: spec.token_ids.to_vec(),
            block_hashes: spec.hashes.iter().map(|h| h.0).collect(),
            block_size,
            cache_salt: spec.cache_salt.clone(),
            cacheable_len: spec.cacheable_len,
            sampling: Some(spec.sampling.clone()),
            fork_group: spec.fork_group.clone(),
            report_acceptance: true,
            pin: spec.pin,
        };
        async move { conn.generate(req).await }
    })
    .await?;
    d.spec = Some(spec.clone());
    Ok(d)
}

/// The pull hint of `decision` (the routing core's [`PullPlan`]), addressed to the
/// holder's endpoint: the chosen worker fetches those blocks (`FetchBlocks`) instead of
/// recomputing them, as Mooncake does.
///
/// [`PullPlan`]: kvfleet_routing::PullPlan
fn peer_pull(fleet: &Fleet, decision: &RouteDecision) -> Option<pb::PeerPull> {
    let plan = decision.pull.as_ref()?;
    let conn = fleet.conn(&plan.from)?;
    m::peer_pull(&decision.worker, &plan.from, decision.peer_blocks);
    Some(pb::PeerPull {
        peer_endpoint: conn.endpoint.clone(),
        first_block: u32::try_from(plan.first_block).ok()?,
        end_block: u32::try_from(plan.end_block).ok()?,
    })
}

/// A message of a worker's response stream, which may be its acknowledgement.
pub trait WorkerMessage {
    /// The acknowledgement this message is, if it is one.
    fn acceptance(&self) -> Option<pb::Accepted>;
}

impl WorkerMessage for pb::GenerateResponse {
    fn acceptance(&self) -> Option<pb::Accepted> {
        self.accepted
    }
}

impl WorkerMessage for pb::ForkResponse {
    fn acceptance(&self) -> Option<pb::Accepted> {
        self.response.as_ref().and_then(|r| r.accepted)
    }
}

/// Routes `spec` (its hashes, length, policy and fork group) and starts it with
/// `start` on the chosen worker (never one in `exclude`), retrying elsewhere while no
/// worker has accepted it. `start` should ask for an acknowledgement
/// (`report_acceptance`).
pub async fn dispatch_with<T, F, Fut>(
    fleet: &Arc<Fleet>,
    spec: &GenerationSpec,
    exclude: &[String],
    start: F,
) -> Result<Dispatched<T>, ApiError>
where
    T: prost::Message + Default + WorkerMessage + 'static,
    F: Fn(WorkerConn, Option<pb::PeerPull>) -> Fut,
    Fut: Future<Output = Result<tonic::Streaming<T>, tonic::Status>>,
{
    let started = Instant::now();
    let mut last_error = String::from("no worker is available");
    let hooks = fleet.control.hooks();
    let anchor = anchor_block(spec.hashes.len());
    // Blocks a placed worker is taken to hold: the prompt up to its anchor.
    let placed_blocks = anchor.map_or(0, |at| at + 1);
    let PlacementPlan {
        mut pin,
        mut pin_holds_blocks,
        mut step,
        mut ticket,
        mut unplaced_key,
    } = plan_placement(fleet, hooks.as_deref(), spec, anchor, placed_blocks).await;
    // Workers this request already failed on: a retry goes elsewhere.
    let mut tried: Vec<String> = exclude.to_vec();
    let route = |pin: Option<&str>, holds_blocks: usize, tried: &[String]| {
        fleet.routing.route(&RouteRequest {
            hashes: &spec.hashes,
            prompt_tokens: spec.token_ids.len(),
            pin: pin.map(|worker| Pin {
                worker,
                holds_blocks,
            }),
            policy: spec.policy,
            exclude: tried,
        })
    };
    for attempt in 0..fleet.config.max_attempts.max(1) {
        if attempt > 0 {
            m::retry();
        }
        fleet.workers.refresh_breakers();
        let Routed {
            mut decision,
            in_flight,
            lock_wait_ns,
        } = match route(pin.as_deref(), pin_holds_blocks, &tried) {
            Ok(r) => r,
            Err(e) => {
                last_error = e.to_string();
                break;
            }
        };
        // route() counted the request in flight: the guard owns that count from here,
        // so a request cancelled at any await below (the claim) gives it back.
        let mut guard = InflightGuard::new(in_flight, &decision);
        // Routed on the index away from every holder of the prompt's anchor, with the
        // key's placement unknown here: a sibling on another router may have placed
        // it a moment ago, its events already here and its placement not yet. Claim
        // the key now: the compare-and-set finds such a placement, and the request
        // follows it instead of computing the prefix a second time.
        let placed_tokens = placed_blocks * fleet.routing.block_size();
        // The worker this request follows instead of its choice: another router's
        // placement, on a worker this router can reach.
        let mut follow: Option<String> = None;
        let chosen = decision.worker.to_string();
        let elsewhere = |o: &String| *o != chosen && fleet.conn(o).is_some();
        if let Some(key) = unplaced_key.take() {
            if decision.predicted_cached_tokens < placed_tokens {
                match fleet.control.claims().begin(&key) {
                    ClaimTurn::Mine(t) => ticket = Some(t),
                    // A sibling on this router is claiming it: follow its outcome.
                    ClaimTurn::Wait(w) => {
                        follow = w.owner(CLAIM_WAIT_LIMIT).await.filter(elsewhere);
                        if follow.is_some() {
                            step = PlacementStep::Followed;
                        }
                    }
                }
            }
        }
        // First to route this key: claim it (one compare-and-set per new key), and
        // follow whoever won.
        let mut claimed = None;
        if let (Some(t), Some(h)) = (ticket.take(), &hooks) {
            let owner = h.claim(t.key().clone(), chosen.clone()).await;
            follow = owner.clone().filter(elsewhere);
            step = match (&owner, &follow) {
                (_, Some(_)) => PlacementStep::Lost,
                (Some(o), None) if *o == chosen => PlacementStep::Claimed,
                _ => PlacementStep::Unplaced,
            };
            claimed = Some((t, owner));
        }
        if follow.is_some() {
            // Before any waiter is released: the first choice's reservation must not
            // pass for the prefix being held there.
            if let Some(r) = decision.reservation.take() {
                fleet.routing.cancel_reservation(r);
            }
        }
        if let Some((t, owner)) = claimed {
            t.resolve(owner);
        }
        if let Some(owner) = follow {
            // Ends the first choice's in-flight count before routing again.
            drop(guard);
            pin = Some(owner);
            pin_holds_blocks = placed_blocks;
            let rerouted = match route(pin.as_deref(), pin_holds_blocks, &tried) {
                Ok(r) => r,
                Err(e) => {
                    last_error = e.to_string();
                    break;
                }
            };
            decision = rerouted.decision;
            guard = InflightGuard::new(rerouted.in_flight, &decision);
        }
        m::decision_phase("lock_wait", lock_wait_ns);
        m::decision_phase("index_lookup", decision.timings.index_lookup_ns);
        m::decision_phase(
            "scoring",
            decision.timings.scoring_ns + decision.timings.reserve_ns,
        );
        let worker = decision.worker.to_string();
        tried.push(worker.clone());
        // The request never reached the worker: its reservation must not steer siblings.
        let cancel_reservation = || {
            if let Some(r) = decision.reservation {
                fleet.routing.cancel_reservation(r);
            }
        };
        fleet.workers.breaker_request_started(&worker);
        let Some(conn) = fleet.conn(&worker) else {
            // Lost since it was routed: its supervisor has charged its breaker.
            cancel_reservation();
            last_error = format!("worker {worker} is not connected");
            continue;
        };
        let pull = peer_pull(fleet, &decision);
        let call = async {
            let mut stream = start(conn.clone(), pull).await?;
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        };
        let abort_in_background = |conn: WorkerConn| {
            // A hung worker would hold the abort for a whole unary deadline: send it in
            // the background.
            let id = spec.request_id.clone();
            tokio::spawn(async move {
                let _ = conn.abort(&id).await;
            });
        };
        match tokio::time::timeout(fleet.config.first_message_timeout, call).await {
            Ok(Ok((mut stream, Some(mut first)))) => {
                fleet.workers.breaker_success(&worker);
                if let Some(ack) = first.acceptance() {
                    // Accepted: the request is this worker's unless the worker itself fails.
                    m::queue_position(&worker, ack.queue_position);
                    first = match first_after_acceptance(fleet, &worker, &mut stream).await {
                        Queued::First(msg) => msg,
                        Queued::WorkerFailed { why, charge } => {
                            // Nothing was sent to the client and a dead worker's queue is
                            // lost work, not load: the request goes elsewhere.
                            cancel_reservation();
                            if charge {
                                fleet.workers.breaker_failure(&worker);
                            } else {
                                abort_in_background(conn);
                            }
                            last_error = why;
                            continue;
                        }
                        Queued::Failed(e) => {
                            cancel_reservation();
                            return Err(e);
                        }
                        Queued::TimedOut => {
                            abort_in_background(conn);
                            m::deadline_exceeded(&worker, "queued");
                            cancel_reservation();
                            return Err(ApiError::unavailable(format!(
                                "the request waited in worker {worker}'s queue for longer than \
                                 {:?}; the fleet is overloaded, retry later",
                                fleet.config.queued_timeout
                            )));
                        }
                    };
                }
                m::routed(&worker, decision.policy);
                if step != PlacementStep::None {
                    m::placement(step.name());
                }
                guard.decision_seq = fleet.decisions.record(
                    NewDecision {
                        unix_ms: unix_ms(),
                        at_ms: fleet.now_ms(),
                        request_id: spec.request_id.clone(),
                        endpoint: spec.endpoint,
                        worker: worker.clone(),
                        policy: decision.policy,
                        prompt_tokens: spec.token_ids.len(),
                        predicted_cached_tokens: decision.predicted_cached_tokens,
                        fork_group: spec.fork_group.clone(),
                        session: spec.session.clone(),
                        decision_us: (decision.timings.index_lookup_ns
                            + decision.timings.scoring_ns
                            + decision.timings.reserve_ns)
                            / 1000,
                        accept_us: started.elapsed().as_micros() as u64,
                        attempts: attempt as u32 + 1,
                        placement: step,
                    },
                    &spec.hashes,
                );
                let facts = RequestFacts {
                    cache_salt: spec.cache_salt.clone(),
                    fork_group: spec.fork_group.clone(),
                    session: spec.session.clone(),
                    block_hashes: if hooks.is_some() {
                        spec.hashes.iter().map(|h| h.0).collect()
                    } else {
                        Vec::new()
                    },
                };
                return Ok(Dispatched {
                    worker,
                    request_id: spec.request_id.clone(),
                    first,
                    stream,
                    guard,
                    started,
                    facts,
                    spec: None,
                });
            }
            Ok(Ok((_, None))) => {
                cancel_reservation();
                fleet.workers.breaker_failure(&worker);
                last_error = format!("worker {worker} closed the stream before answering");
            }
            Ok(Err(status)) => {
                cancel_reservation();
                match classify(&status) {
                    Fault::Busy => {
                        // Busy, not broken: try another worker without dropping this
                        // one (and without counting against its breaker).
                        last_error = format!("worker {worker} is overloaded: {}", status.message());
                    }
                    Fault::Transport => {
                        // Never accepted: safe to send elsewhere. One charge; the
                        // supervisor decides whether the connection (and the index)
                        // is lost.
                        fleet.workers.breaker_failure(&worker);
                        last_error = format!("worker {worker} failed: {}", status.message());
                    }
                    fault @ (Fault::Invalid | Fault::Request) => {
                        return Err(fault.client_error(&worker, &status));
                    }
                }
            }
            Err(_) => {
                // Not even acknowledged: hung, or too old to acknowledge.
                abort_in_background(conn);
                m::deadline_exceeded(&worker, "first_token");
                // Missed the deadline: the breaker decides when it is out, not one miss.
                cancel_reservation();
                fleet.workers.breaker_failure(&worker);
                last_error = format!(
                    "worker {worker} did not answer within {:?}",
                    fleet.config.first_message_timeout
                );
            }
        }
    }
    Err(ApiError::unavailable(last_error))
}

/// How long a request waits for a sibling's claim of its placement on this router
/// before routing on its own (the claim is one etcd call, itself bounded).
const CLAIM_WAIT_LIMIT: Duration = Duration::from_secs(2);

/// How long after a placement a prompt with the same key follows it even where the
/// index already knows a holder: siblings arrive together, and while the first one's
/// prefix is still being computed, the holder's load would otherwise send a sibling
/// elsewhere (to recompute the prefix, or to pull blocks that are not there yet).
/// Later prompts with the key are routed on the index and the cost model again.
const SIBLING_WINDOW: Duration = Duration::from_secs(5);

/// What a request's placement decided before it is routed.
struct PlacementPlan {
    /// The worker it must go to, if any.
    pin: Option<String>,
    /// Blocks of the prompt the pinned worker is taken to hold.
    pin_holds_blocks: usize,
    /// How placement took part, for the decision log.
    step: PlacementStep,
    /// This request claims its key once routed.
    ticket: Option<ClaimTicket<PlacementRef>>,
    /// Routed on the index with the key's placement unknown here: the key, claimed
    /// after all if the request is routed away from every holder of its anchor.
    unplaced_key: Option<PlacementRef>,
}

/// Consults the pinned prefixes and the placement shared with other routers.
///
/// The placement key is the fork group, else the prompt's anchor block (covering at
/// least half of it) while no worker is known to hold the prompt up to it. Siblings
/// share their anchor, so the routers they reach agree on one worker; sessions behind
/// one system prompt have different anchors, so a shared prompt never places them all
/// on one worker. A sibling's claim of the key in flight on this router is waited for
/// first: until it resolves, the claimer's reservation would pass for the prefix being
/// held by a worker that may lose the claim. A placement younger than
/// [`SIBLING_WINDOW`] is followed even where the prefix is indexed.
async fn plan_placement(
    fleet: &Fleet,
    hooks: Option<&dyn ControlHooks>,
    spec: &GenerationSpec,
    anchor: Option<usize>,
    placed_blocks: usize,
) -> PlacementPlan {
    let mut plan = PlacementPlan {
        pin: None,
        pin_holds_blocks: 0,
        step: PlacementStep::None,
        ticket: None,
        unplaced_key: None,
    };
    // A live pinned prefix names the worker holding it (and nothing evicts it there).
    if let Some(w) = fleet.pins.worker_for(&spec.hashes, fleet.now_ms()) {
        if fleet.conn(&w).is_some() {
            plan.pin = Some(w.to_string());
            plan.step = PlacementStep::Pinned;
            return plan;
        }
    }
    let Some(h) = hooks else { return plan };
    let key = match (&spec.fork_group, anchor) {
        (Some(g), _) => PlacementRef::ForkGroup(g.clone()),
        (None, Some(at)) => PlacementRef::PrefixRoot(spec.hashes[at].0),
        (None, None) => return plan,
    };
    let claims = fleet.control.claims();
    let connected = |w: Option<String>| w.filter(|w| fleet.conn(w).is_some());
    let waited = claims.in_flight(&key);
    let mut owner = match &waited {
        Some(wait) => connected(wait.clone().owner(CLAIM_WAIT_LIMIT).await),
        None => None,
    };
    if owner.is_none() {
        let placed = h.placement(&key);
        let fresh = placed
            .as_ref()
            .is_some_and(|p| p.age.is_some_and(|a| a < SIBLING_WINDOW));
        let known = !fresh
            && matches!(key, PlacementRef::PrefixRoot(_))
            && anchor.is_some_and(|at| fleet.routing.holds_prefix(&spec.hashes[..=at]));
        if known {
            plan.step = PlacementStep::Indexed;
            if placed.is_none() {
                plan.unplaced_key = Some(key);
            }
            return plan;
        }
        owner = placed.map(|p| p.worker);
        if owner.is_none() {
            match claims.begin(&key) {
                ClaimTurn::Mine(t) => plan.ticket = Some(t),
                // Waited once already: route on this router's own view.
                ClaimTurn::Wait(_) if waited.is_some() => {}
                ClaimTurn::Wait(wait) => owner = connected(wait.owner(CLAIM_WAIT_LIMIT).await),
            }
        }
    }
    if owner.is_some() {
        // The placed worker was sent a sibling of this prompt (by this router or
        // another): it holds, or is computing, the prompt up to its anchor, even where
        // this router's index has not heard of it yet. Counting those blocks as cached
        // there keeps this request's prefill, and so the worker's backlog as this
        // router sees it, from counting the shared prefix a second time.
        plan.pin_holds_blocks = placed_blocks;
        plan.step = PlacementStep::Followed;
        plan.pin = owner;
    }
    plan
}

/// How the wait for an accepted request's first message (after the acknowledgement)
/// ended.
enum Queued<T> {
    /// The message.
    First(T),
    /// The worker failed first. `charge` when this wait is the first sign of it (a
    /// closed stream, a transport error); a liveness check finds a worker that was
    /// already dropped or had its breaker opened, so there is nothing to charge.
    WorkerFailed { why: String, charge: bool },
    /// The request itself failed on a working worker.
    Failed(ApiError),
    /// Still queued at the queue deadline.
    TimedOut,
}

/// Waits for `stream`'s next message up to the queue deadline, checking every
/// [`LIVENESS_CHECK`] that `worker` is still connected and its breaker not open, so a
/// hung worker's queue is not waited on to the end.
async fn first_after_acceptance<T: prost::Message + Default>(
    fleet: &Fleet,
    worker: &str,
    stream: &mut tonic::Streaming<T>,
) -> Queued<T> {
    let until = Instant::now() + fleet.config.queued_timeout;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Queued::TimedOut;
        }
        // `Streaming::message` is cancel safe: a timed-out wait loses nothing.
        match tokio::time::timeout(left.min(LIVENESS_CHECK), stream.message()).await {
            Ok(Ok(Some(m))) => return Queued::First(m),
            Ok(Ok(None)) => {
                return Queued::WorkerFailed {
                    why: format!("worker {worker} closed the stream after accepting the request"),
                    charge: true,
                }
            }
            Ok(Err(status)) if classify(&status) == Fault::Transport => {
                return Queued::WorkerFailed {
                    why: format!("worker {worker} failed: {}", status.message()),
                    charge: true,
                }
            }
            Ok(Err(status)) => {
                return Queued::Failed(ApiError::worker_failed(format!(
                    "worker {worker} failed the request: {}",
                    status.message()
                )))
            }
            Err(_) => {
                if fleet.conn(worker).is_none()
                    || fleet.workers.circuit_state(worker) == CircuitState::Open
                {
                    return Queued::WorkerFailed {
                        why: format!("worker {worker} failed with the request queued"),
                        charge: false,
                    };
                }
            }
        }
    }
}

/// Whose fault a failed worker call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The request is invalid: a 400 for the client.
    Invalid,
    /// The worker is busy: try another, charge nothing.
    Busy,
    /// The connection or the worker process failed: charge its breaker; a request it
    /// never accepted may go elsewhere.
    Transport,
    /// This one request failed on a working worker (an engine step, a duplicate id…):
    /// the client gets a 502; it is not resent, the breaker and the index are untouched.
    Request,
}

/// Classifies a status from a worker call.
pub fn classify(status: &tonic::Status) -> Fault {
    // tonic attaches the I/O, HTTP/2 or hyper error it made a status from as its
    // source; a status the worker sent (in trailers) has none.
    if std::error::Error::source(status).is_some() {
        return Fault::Transport;
    }
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => Fault::Invalid,
        Code::ResourceExhausted => Fault::Busy,
        Code::Unavailable | Code::DeadlineExceeded => Fault::Transport,
        _ => Fault::Request,
    }
}

impl Fault {
    /// What the client is told when the request ends with `status` on `worker`.
    fn client_error(self, worker: &str, status: &tonic::Status) -> ApiError {
        match self {
            Fault::Invalid => ApiError::invalid(status.message().to_string()),
            _ => ApiError::worker_failed(format!(
                "worker {worker} failed the request ({:?}): {}",
                status.code(),
                status.message()
            )),
        }
    }
}

/// OpenAI's name for a finish reason.
pub fn finish_reason_name(f: i32) -> Option<&'static str> {
    match pb::FinishReason::try_from(f).ok()? {
        pb::FinishReason::Stop => Some("stop"),
        pb::FinishReason::Length => Some("length"),
        pb::FinishReason::Aborted => Some("abort"),
        pb::FinishReason::Unspecified => None,
    }
}

/// Reports a finished request to the control plane, if one is installed.
pub fn report_usage<T>(fleet: &Fleet, d: &Dispatched<T>, usage: &Usage, ttft: Option<Duration>) {
    let Some(hooks) = fleet.control.hooks() else {
        return;
    };
    // Arrival on the wall clock: now, less the time since the request arrived.
    let arrived_ms = unix_ms().saturating_sub(d.started.elapsed().as_millis() as u64);
    hooks.request_done(RequestUsage {
        tenant: d.facts.cache_salt.clone(),
        model: fleet.model().map(|m| m.0).unwrap_or_default(),
        prompt_tokens: usage.prompt_tokens as u64,
        cached_tokens: usage.prompt_tokens_details.cached_tokens as u64,
        promoted: usage.prompt_tokens_details.promoted,
        output_tokens: usage.completion_tokens as u64,
        worker: d.worker.clone(),
        ttft,
        fork_group: d.facts.fork_group.clone(),
        session_id: d.facts.session.clone(),
        block_hashes: d.facts.block_hashes.clone(),
        block_size: fleet.routing.block_size() as u32,
        timestamp_ms: arrived_ms,
    });
}
