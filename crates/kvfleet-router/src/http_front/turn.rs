//! One chat turn, from messages to a started generation: the path both chat front
//! ends (`/v1/chat/completions` and Anthropic's `/v1/messages`) share. It renders the
//! agent status bar, renders and tokenizes the conversation with the model's chat
//! template, fingerprints the turn for the session's cache-break diagnostics, and
//! routes and starts the generation. Each front end only parses its body before and
//! formats the answer after.

use super::{
    insert_header, off_runtime, prepare, prompt_error, unix_now_ms, Prepared, RequestMeta,
    PREFIX_BREAK_HEADER, SESSION_TURN_HEADER,
};
use crate::agent_status::{StatusMode, StatusRequestExt};
use crate::dispatch::Dispatched;
use crate::fleet::Fleet;
use crate::fleet_metrics as m;
use crate::openai::error::ApiError;
use crate::prefix_breaks::TurnFingerprint;
use crate::prompt_model::PromptModel;
use axum::http::HeaderMap;
use kvfleet_core::chat::status_bar::{status_message, StatusRequest};
use kvfleet_core::chat::{ChatMessage, ToolDefinition};
use kvfleet_core::openai::{RenderedStatus, SamplingFields};
use std::sync::Arc;

/// Finds where the prompt's cacheable prefix ends (an Anthropic breakpoint), given the
/// model's prompt side and the prompt's ids; run on the blocking pool.
pub(super) type CacheEnd =
    Box<dyn FnOnce(&PromptModel, &[u32]) -> Result<usize, ApiError> + Send + 'static>;

/// A turn as a front end hands it over.
pub(super) struct TurnInput {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tools shown to the model.
    pub tools: Vec<ToolDefinition>,
    /// The agent status bar fields.
    pub status: StatusRequest,
    /// Where the cacheable prefix ends, when the request says (else all of it, less
    /// a replaced status).
    pub cache_end: Option<CacheEnd>,
    /// The grammar the output must follow (structured outputs), already checked.
    pub grammar: Option<kvfleet_core::structured_output::OutputGrammar>,
    /// Pin the cacheable prefix (up to [`TurnInput::cache_end`]) for this many seconds.
    pub pin_ttl_s: Option<u32>,
}

/// A started turn.
pub(super) struct StartedTurn {
    /// The generation (the first choice), its first message already in.
    pub dispatched: Dispatched,
    /// Choices 1..n (`n > 1`), started once the first had computed the prompt.
    pub more: Vec<Dispatched>,
    /// The request asked for log-probabilities.
    pub want_logprobs: bool,
    /// Response headers so far (worker, session turn, prefix break).
    pub worker_header: HeaderMap,
    /// The status the model saw, when one was asked for.
    pub rendered_status: Option<RenderedStatus>,
    /// Where the request's own cacheable prefix ends (from [`TurnInput::cache_end`]).
    pub cache_end: Option<usize>,
}

/// Renders, tokenizes, routes and starts one turn for `meta` (whose `session` is the
/// turn's session).
pub(super) async fn start_turn(
    fleet: &Arc<Fleet>,
    meta: &RequestMeta,
    body_bytes: usize,
    input: TurnInput,
    sampling: &SamplingFields,
) -> Result<StartedTurn, ApiError> {
    let TurnInput {
        messages,
        tools,
        status: status_req,
        cache_end,
        grammar,
        pin_ttl_s,
    } = input;
    let session = meta.session.clone();
    status_req.validate(session.as_deref())?;
    let now_ms = fleet.now_ms();
    let status = match status_req.wanted() {
        false => None,
        true => {
            let before = session
                .as_deref()
                .and_then(|s| fleet.sessions.get(meta.tenant_name(), s));
            let fields = status_req.fields(&messages, before.as_ref(), unix_now_ms(), now_ms);
            Some(
                status_message(&fields)
                    .map_err(|e| ApiError::invalid_param("agent_status", e.to_string()))?,
            )
        }
    };
    let mode = status_req.mode();
    // Replace mode renders the status after the history but keeps it out of the
    // cacheable prefix; append mode makes it history.
    let mut history = messages;
    let mut tail = Vec::new();
    let rendered_status = status.map(|message| {
        let mode_name = match mode {
            StatusMode::Replace => {
                tail.push(message.clone());
                "replace"
            }
            StatusMode::Append => {
                history.push(message.clone());
                "append"
            }
        };
        RenderedStatus {
            mode: mode_name,
            message,
        }
    });
    let has_tail = !tail.is_empty();
    let scope = meta.scope();
    let want_fingerprint = session.is_some();
    let work = fleet.clone();
    let (prompt, fingerprint, cache_end) = off_runtime(body_bytes, move || {
        let prompt = work
            .tokens
            .tokenize_with_tail(&work.prompt, &scope, &history, &tail, &tools)
            .map_err(prompt_error)?;
        let cache_end = match cache_end {
            Some(find) => Some(find(&work.prompt, &prompt.ids)?),
            None => None,
        };
        // Hashes every message: part of the same work.
        let fingerprint = want_fingerprint.then(|| {
            let cacheable = prompt.ids[..prompt.history_len].to_vec();
            TurnFingerprint::new(scope, &history, &tools, cacheable)
        });
        Ok((prompt, fingerprint, cache_end))
    })
    .await?;
    let cacheable_len = match (has_tail.then_some(prompt.history_len), cache_end) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if has_tail {
        m::agent_status("replace", prompt.ids.len() - prompt.history_len);
    } else if rendered_status.is_some() {
        m::agent_status("append", 0);
    }
    let turn = session.as_deref().zip(fingerprint).map(|(s, fingerprint)| {
        fleet
            .sessions
            .begin_turn(meta.tenant_name(), s, now_ms, fingerprint)
    });
    let prompt_len = prompt.ids.len();
    let Prepared {
        dispatched,
        more,
        mut worker_header,
        want_logprobs,
    } = prepare(
        fleet,
        meta,
        prompt.ids,
        cacheable_len,
        sampling,
        grammar,
        pin_ttl_s,
    )
    .await?;
    if let (Some(s), Some(turn)) = (session.as_deref(), turn.as_ref()) {
        let cached = dispatched
            .first
            .usage
            .as_ref()
            .map_or(0, |u| u.cached_tokens as usize);
        fleet
            .sessions
            .record_cached(meta.tenant_name(), s, cached, prompt_len);
        insert_header(
            &mut worker_header,
            SESSION_TURN_HEADER,
            &(turn.before.turns + 1).to_string(),
        );
        if let Some(b) = &turn.prefix_break {
            m::prefix_break(b.reason.as_str());
            insert_header(&mut worker_header, PREFIX_BREAK_HEADER, &b.header_value());
        }
    }
    Ok(StartedTurn {
        dispatched,
        more,
        want_logprobs,
        worker_header,
        rendered_status,
        cache_end,
    })
}
