//! The OpenAI-compatible HTTP front (axum): `/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`, `/v1/forks`, Anthropic's `/v1/messages`, plus `/health`, `/metrics` (Prometheus), `/fleet` (JSON
//! state), `/dashboard` (the live cache map, with its JSON at `/dashboard/state`) and
//! `/openapi.json` (the OpenAPI document of all of them). Every request passes
//! [`gate::gate`] first: API key, body size, admission limits.
//!
//! Every handler ends in either a response or an [`ApiError`] with an OpenAI error
//! body; nothing on a request path panics.

mod admin;
mod anthropic_error;
mod chat;
mod completions;
mod dashboard;
mod forks;
pub mod gate;
mod messages;
pub mod openapi;
mod relay;
mod request_id;
mod turn;

pub use relay::{collect, Collected};

use crate::admission::{Admission, Limits};
use crate::dispatch::{dispatch, Dispatched, GenerationSpec};
use crate::fleet::Fleet;
use crate::fleet_metrics as m;
use crate::openai::error::ApiError;
use crate::openai::params::{choices, sampling_params, Api};
use crate::pin_table::PinOutcome;
use crate::wall_clock::{unix_ms as unix_now_ms, unix_secs as unix_now};
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use gate::Admitted;
use kvfleet_core::incremental_tokenizer::PromptError;
use kvfleet_core::openai::SamplingFields;
use kvfleet_core::structured_output::OutputGrammar;
use kvfleet_routing::policy::PolicyKind;
use request_id::request_id;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Header naming the worker that served a response.
pub const WORKER_HEADER: &str = "x-kvfleet-worker";
/// Header choosing a routing policy for one request.
pub const POLICY_HEADER: &str = "x-kvfleet-policy";
/// Header naming the fork group a request belongs to.
pub const FORK_GROUP_HEADER: &str = "x-kvfleet-fork-group";
/// Header naming the session (agent conversation) a request belongs to.
pub const SESSION_HEADER: &str = "x-kvfleet-session";
/// Response header: where and why this turn lost the previous turn's prefix cache.
pub const PREFIX_BREAK_HEADER: &str = "x-kvfleet-prefix-break";
/// Response header: this request's turn number in its session.
pub const SESSION_TURN_HEADER: &str = "x-kvfleet-session-turn";
/// Response header: what became of the request's pin (`pinned; blocks=N; tokens=T;
/// expires=UNIX` or `refused; reason=R`), when it asked for one.
pub const PIN_HEADER: &str = "x-kvfleet-pin";

/// Largest request body accepted by default (long agent prompts run to hundreds of KB).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// Every route the router serves, as (method, path): `/openapi.json` documents each.
pub const ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/chat/completions"),
    ("post", "/v1/completions"),
    ("post", "/v1/messages"),
    ("post", "/v1/forks"),
    ("get", "/v1/models"),
    ("get", "/health"),
    ("get", "/metrics"),
    ("get", "/fleet"),
    ("get", "/dashboard"),
    ("get", "/dashboard/state"),
    ("get", "/openapi.json"),
];

/// The router's HTTP application, open (no API keys) with the default limits.
pub fn app(fleet: Arc<Fleet>) -> Router {
    app_with(fleet, Arc::new(Admission::new(Limits::default(), None)))
}

/// The router's HTTP application behind `admission` (keys and limits).
pub fn app_with(fleet: Arc<Fleet>, admission: Arc<Admission>) -> Router {
    let body_limit = admission.limits.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/forks", post(forks::forks))
        .route("/v1/models", get(admin::models))
        .route("/health", get(admin::health))
        .route("/metrics", get(admin::metrics))
        .route("/fleet", get(admin::fleet_state))
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/state", get(dashboard::state))
        .route("/openapi.json", get(openapi::serve))
        .fallback(admin::not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(admission, gate::gate))
        .with_state(fleet)
}

/// `GET /metrics`: this process's Prometheus exposition (every `kvfleet_*` series it
/// registered). Routers serve it from [`app_with`]; a worker process mounts it in its
/// own health app.
pub use admin::metrics;

/// The request's admission facts; a handler reached without the gate (not through
/// [`app_with`]) runs as the open default tenant.
fn admitted(ext: Option<axum::Extension<Admitted>>) -> Admitted {
    match ext {
        Some(axum::Extension(a)) => a,
        None => {
            static OPEN: std::sync::OnceLock<Arc<Admission>> = std::sync::OnceLock::new();
            let adm = OPEN.get_or_init(|| Arc::new(Admission::new(Limits::default(), None)));
            Admitted {
                tenant: adm.default_tenant(),
                max_prompt_tokens: None,
                max_completion_tokens: None,
            }
        }
    }
}

/// Parses a JSON body into `T`, as a 400 with serde's message on failure.
fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

/// A 400 naming the body's first unknown top-level field, worded as OpenAI words it.
fn reject_unknown(unknown: &kvfleet_core::openai::UnknownFields) -> Result<(), ApiError> {
    match unknown.first() {
        None => Ok(()),
        Some(field) => Err(ApiError::invalid_param(
            field,
            format!("Unrecognized request argument supplied: {field}"),
        )),
    }
}

/// Request facts every endpoint needs.
struct RequestMeta {
    endpoint: &'static str,
    model_id: String,
    context: usize,
    policy: PolicyKind,
    fork_group: Option<String>,
    /// The tenant's cache salt: tenant namespace and the request's own salt.
    cache_salt: String,
    session: Option<String>,
    admitted: Admitted,
    /// The tenant name usage records carry.
    usage_tenant: String,
}

impl RequestMeta {
    fn from_headers(
        endpoint: &'static str,
        fleet: &Fleet,
        headers: &HeaderMap,
        admitted: Admitted,
        model: &str,
        salt: Option<&str>,
    ) -> Result<Self, ApiError> {
        let Some((model_id, context)) = fleet.model() else {
            return Err(ApiError::unavailable("no worker has joined the fleet yet"));
        };
        if model != model_id {
            return Err(ApiError::model_not_found(model));
        }
        let policy = match headers.get(POLICY_HEADER) {
            None => fleet.config.default_policy,
            Some(v) => v
                .to_str()
                .map_err(|_| ApiError::invalid(format!("{POLICY_HEADER} is not text")))?
                .parse::<PolicyKind>()
                .map_err(|e| ApiError::invalid(e.to_string()))?,
        };
        let fork_group = headers
            .get(FORK_GROUP_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        Ok(RequestMeta {
            endpoint,
            model_id,
            context,
            policy,
            fork_group,
            cache_salt: admitted.cache_salt(salt),
            session: session_id(headers, None)?,
            usage_tenant: admitted.usage_tenant(salt.unwrap_or_default()),
            admitted,
        })
    }
}

impl RequestMeta {
    /// The memo and session scope: model and cache namespace.
    fn scope(&self) -> String {
        format!("{}\u{0}{}", self.model_id, self.cache_salt)
    }

    /// The tenant sessions are kept under: a session id names a session only within
    /// its tenant.
    fn tenant_name(&self) -> &str {
        &self.admitted.tenant.tenant.name
    }
}

/// Bodies from this size on are large: their preparation takes one of a bounded
/// number of permits.
const LARGE_BODY_BYTES: usize = 1 << 20;

/// Permits for preparing large bodies: half the cores, so a burst of huge prompts
/// leaves the other half to small requests, streams and an in-process engine.
fn large_work_permits() -> Arc<tokio::sync::Semaphore> {
    static PERMITS: std::sync::OnceLock<Arc<tokio::sync::Semaphore>> = std::sync::OnceLock::new();
    PERMITS
        .get_or_init(|| {
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            Arc::new(tokio::sync::Semaphore::new((cores / 2).max(1)))
        })
        .clone()
}

/// The request's structured-output grammar (`response_format`, or a forced
/// `tool_choice` over `tools`), compiled once here off the runtime so a grammar
/// llguidance rejects is a 400 with its message before any work is done.
async fn checked_grammar(
    response_format: Option<&kvfleet_core::openai::ResponseFormat>,
    tool_choice: Option<&serde_json::Value>,
    tools: &[kvfleet_core::chat::ToolDefinition],
) -> Result<Option<OutputGrammar>, ApiError> {
    use crate::openai::structured;
    let Some(grammar) = structured::request_grammar(response_format, tool_choice, tools)? else {
        return Ok(None);
    };
    let size = match &grammar {
        OutputGrammar::JsonObject => 0,
        OutputGrammar::JsonSchema(s) | OutputGrammar::Lark(s) => s.len(),
    };
    off_runtime(size, move || {
        structured::check(&grammar, structured::param_of(&grammar))?;
        Ok(Some(grammar))
    })
    .await
}

/// Runs a request's CPU work that grows with its body (`body_bytes`: JSON parsing,
/// chat rendering, tokenization, message hashing) on tokio's blocking pool: on the
/// async runtime it would stall every stream and probe that shares the runtime's few
/// threads. Work for a large body first waits (asynchronously) for a permit.
async fn off_runtime<T, F>(body_bytes: usize, work: F) -> Result<T, ApiError>
where
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
    T: Send + 'static,
{
    let permit = match body_bytes >= LARGE_BODY_BYTES {
        false => None,
        true => Some(
            large_work_permits()
                .acquire_owned()
                .await
                .map_err(|_| ApiError::internal("the preparation pool is closed"))?,
        ),
    };
    let work = move || {
        let _permit = permit;
        work()
    };
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "preparing the request failed: {e}"
        )))
    })
}

/// A conversation that cannot be rendered or tokenized: a 400 naming `messages`.
fn prompt_error(e: PromptError) -> ApiError {
    ApiError::invalid_param("messages", e.to_string())
}

struct Prepared {
    /// The first choice: it computed the prompt.
    dispatched: Dispatched,
    /// Choices 1..n (`n > 1`), started once the first had computed the prompt.
    more: Vec<Dispatched>,
    worker_header: HeaderMap,
    /// The request asked for log-probabilities.
    want_logprobs: bool,
}

/// Validates sampling, hashes the prompt's cacheable part (all of it unless
/// `cacheable_len` says where an uncacheable tail starts), routes and starts it. With
/// `pin_ttl_s`, the cacheable part's full blocks are pinned on the worker, within the
/// tenant's pin budget; the outcome goes in the [`PIN_HEADER`] header.
async fn prepare(
    fleet: &Arc<Fleet>,
    meta: &RequestMeta,
    ids: Vec<u32>,
    cacheable_len: Option<usize>,
    sampling: &SamplingFields,
    grammar: Option<OutputGrammar>,
    pin_ttl_s: Option<u32>,
) -> Result<Prepared, ApiError> {
    let api = match meta.endpoint {
        "completions" => Api::Completions,
        _ => Api::Chat,
    };
    let n = choices(sampling)?;
    let mut params = sampling_params(sampling, api, ids.len(), meta.context)?;
    let want_logprobs = params.logprobs.is_some();
    params.grammar = grammar.map(crate::openai::structured::to_proto);
    meta.admitted.cap_completion(sampling, &mut params)?;
    meta.admitted
        .charge(ids.len(), ids.len() + n * params.max_tokens.max(0) as usize)?;
    let t = Instant::now();
    let seed = kvfleet_core::namespace_seed(&meta.model_id, &meta.cache_salt);
    let cacheable = cacheable_len.unwrap_or(ids.len()).min(ids.len());
    let hashes = kvfleet_core::hash_blocks(seed, &ids[..cacheable], fleet.routing.block_size());
    m::decision_phase("hashing", t.elapsed().as_nanos() as u64);
    let mut pin_refused = None;
    let ticket = match pin_ttl_s.filter(|_| !hashes.is_empty()) {
        None => None,
        Some(ttl_s) => match fleet.pins.reserve(
            meta.tenant_name(),
            &hashes,
            fleet.routing.kv_block_bytes(),
            ttl_s,
            fleet.now_ms(),
        ) {
            Ok(t) => Some(t),
            Err(r) => {
                pin_refused = Some(PinOutcome::Refused(r));
                None
            }
        },
    };
    let spec = Arc::new(GenerationSpec {
        pin: ticket.as_ref().map(|t| t.request()),
        request_id: request_id(),
        token_ids: ids.into(),
        hashes: hashes.into(),
        sampling: params,
        cache_salt: meta.cache_salt.clone(),
        cacheable_len: cacheable_len.map(|n| n as u32),
        fork_group: meta.fork_group.clone(),
        session: meta.session.clone(),
        policy: meta.policy,
        endpoint: meta.endpoint,
    });
    let dispatched = match dispatch(fleet, &spec).await {
        Ok(mut d) => {
            d.facts.cache_salt = meta.usage_tenant.clone();
            d
        }
        Err(e) => {
            m::request_done(
                meta.policy.as_str(),
                if e.status.is_client_error() {
                    "client_error"
                } else {
                    "unavailable"
                },
            );
            return Err(e);
        }
    };
    // A Generate stream's first message carries the prompt's usage: the dashboard
    // learns the actual cached tokens as soon as the worker has admitted the request.
    let cached = dispatched.first.usage.map(|u| u.cached_tokens as usize);
    fleet
        .decisions
        .outcome(dispatched.guard.decision_seq, cached, None);
    let mut worker_header = HeaderMap::new();
    insert_header(&mut worker_header, WORKER_HEADER, &dispatched.worker);
    let pin = match ticket {
        Some(t) => {
            let result = dispatched.first.usage.as_ref().and_then(|u| u.pin.as_ref());
            Some(t.settle(&dispatched.worker, result, fleet.now_ms()))
        }
        None => pin_refused,
    };
    if let Some(p) = pin {
        m::pin(match p {
            PinOutcome::Pinned { .. } => "pinned",
            PinOutcome::Refused(r) => r.as_str(),
        });
        let value = p.header_value(fleet.routing.block_size(), unix_now());
        insert_header(&mut worker_header, PIN_HEADER, &value);
    }
    // Further choices start once the first has computed the prompt, so that they find
    // its blocks cached (or reserved) on its worker and compute only what is left.
    let mut more = Vec::with_capacity(n - 1);
    for i in 1..n {
        let mut spec = GenerationSpec::clone(&spec);
        spec.request_id = request_id();
        // The first choice pinned what there was to pin.
        spec.pin = None;
        // A choice's seed is the request's plus its index: the same request reproduces
        // every choice.
        spec.sampling.seed = spec.sampling.seed.map(|s| s.wrapping_add(i as u64));
        let mut d = dispatch(fleet, &Arc::new(spec)).await?;
        d.facts.cache_salt = meta.usage_tenant.clone();
        more.push(d);
    }
    Ok(Prepared {
        dispatched,
        more,
        worker_header,
        want_logprobs,
    })
}

/// The session a request belongs to: the `x-kvfleet-session` header, else the
/// OpenAI `user` field.
fn session_id(headers: &HeaderMap, user: Option<&str>) -> Result<Option<String>, ApiError> {
    let id = match headers.get(SESSION_HEADER) {
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::invalid(format!("{SESSION_HEADER} is not text")))?
                .to_string(),
        ),
        None => user.map(str::to_string),
    };
    Ok(id.filter(|s| !s.is_empty()))
}

/// `headers` naming `worker` as the one that served the request (the one it was
/// dispatched to, or another when a non-streamed answer was redone there).
fn served_by(mut headers: HeaderMap, worker: &str) -> HeaderMap {
    insert_header(&mut headers, WORKER_HEADER, worker);
    headers
}

/// Adds a response header, skipping values that are not valid header text.
fn insert_header(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        headers.insert(HeaderName::from_static(name), v);
    }
}

/// An SSE response fed by `produce` through a bounded channel; a client that goes
/// away closes the channel, which `produce` sees on its next send.
fn sse_response<F, Fut>(headers: HeaderMap, produce: F) -> Response
where
    F: FnOnce(mpsc::Sender<Result<Event, Infallible>>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(produce(tx));
    (
        headers,
        Sse::new(ReceiverStream::new(rx)).keep_alive(KeepAlive::default()),
    )
        .into_response()
}
