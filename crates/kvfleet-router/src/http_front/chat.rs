//! `POST /v1/chat/completions`.

use super::relay::{collect_choices, stream_choices, ChunkWriter, Collected};
use super::turn::{start_turn, StartedTurn, TurnInput};
use super::{off_runtime, parse_body, reject_unknown, session_id, unix_now, RequestMeta};
use crate::fleet::Fleet;
use crate::openai::error::ApiError;
use crate::openai::tool_call_parser::{has_open, parse_tool_calls, partial_open_len};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvfleet_core::openai::{
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
    ChatLogprobs, ChunkChoice, ChunkDelta, TokenLogprob, ToolCallDelta, Usage,
};
use kvfleet_proto::v1 as pb;
use std::sync::Arc;

/// Handles a chat completion, streamed or not.
pub async fn chat_completions(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    admitted: Option<axum::Extension<super::gate::Admitted>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body_bytes = body.len();
    let req: ChatCompletionRequest = off_runtime(body_bytes, move || parse_body(&body)).await?;
    reject_unknown(&req.unknown)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must not be empty",
        ));
    }
    let meta = RequestMeta::from_headers(
        "chat",
        &fleet,
        &headers,
        super::admitted(admitted),
        &req.model,
        req.sampling.cache_salt.as_deref(),
    )?;
    let tools = match req.tool_choice.as_ref().and_then(|c| c.as_str()) {
        Some("none") => Vec::new(),
        _ => req.tools.clone().unwrap_or_default(),
    };
    let grammar = super::checked_grammar(
        req.sampling.response_format.as_ref(),
        req.tool_choice.as_ref(),
        &tools,
    )
    .await?;
    let session = session_id(&headers, req.sampling.user.as_deref())?;
    let meta = RequestMeta { session, ..meta };
    let want_tools = !tools.is_empty();
    let input = TurnInput {
        messages: req.messages,
        tools,
        status: req.status,
        cache_end: None,
        grammar,
        pin_ttl_s: None,
    };
    let StartedTurn {
        dispatched,
        more,
        worker_header,
        rendered_status,
        want_logprobs,
        ..
    } = start_turn(&fleet, &meta, body_bytes, input, &req.sampling).await?;
    // The router's request id, so a response can be found in the decision log.
    let id = format!("chatcmpl-{}", dispatched.request_id);
    let created = unix_now();
    let model = meta.model_id.clone();
    if req.sampling.stream {
        let include_usage = req
            .sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        let writer = |index| ChatChunks {
            index,
            id: id.clone(),
            created,
            model: model.clone(),
            want_tools,
            held: String::new(),
            in_tool_call: false,
            tokenizer: want_logprobs.then(|| fleet.prompt.tokenizer.clone()),
            pending_logprobs: Vec::new(),
        };
        return Ok(stream_choices(
            fleet.clone(),
            worker_header,
            dispatched,
            more,
            writer,
            include_usage,
        ));
    }
    let (outs, usage, worker) = collect_choices(&fleet, dispatched, more).await?;
    let worker_header = super::served_by(worker_header, &worker);
    let choices = outs
        .into_iter()
        .enumerate()
        .map(|(index, out)| chat_choice(&fleet, index, out, &id, want_tools, want_logprobs))
        .collect();
    let body = ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        usage,
        agent_status: rendered_status,
    };
    Ok((worker_header, Json(body)).into_response())
}

/// One choice of a chat answer from what its worker produced.
fn chat_choice(
    fleet: &Fleet,
    index: usize,
    out: Collected,
    id: &str,
    want_tools: bool,
    want_logprobs: bool,
) -> ChatChoice {
    let logprobs = want_logprobs
        .then(|| crate::openai::logprobs::chat(&*fleet.prompt.tokenizer, &out.logprobs));
    let (content, tool_calls) = if want_tools {
        parse_tool_calls(&out.text, id)
    } else {
        (out.text, Vec::new())
    };
    let finish = if tool_calls.is_empty() {
        out.finish
    } else {
        Some("tool_calls")
    };
    ChatChoice {
        index,
        message: AssistantMessage {
            role: "assistant",
            content: if content.is_empty() && !tool_calls.is_empty() {
                None
            } else {
                Some(content)
            },
            tool_calls,
        },
        finish_reason: finish,
        logprobs,
    }
}

/// SSE chunks of a chat completion. With tools, text from a `<tool_call>` tag on is
/// held back and sent as `tool_calls` once complete.
struct ChatChunks {
    /// The choice these chunks belong to.
    index: usize,
    id: String,
    created: u64,
    model: String,
    want_tools: bool,
    held: String,
    in_tool_call: bool,
    /// Set when the request asked for logprobs.
    tokenizer: Option<Arc<dyn kvfleet_core::Tokenizer>>,
    /// Log-probabilities of tokens whose text is held back: sent with the next chunk.
    pending_logprobs: Vec<TokenLogprob>,
}

impl ChatChunks {
    fn chunk(
        &mut self,
        delta: ChunkDelta,
        finish: Option<&'static str>,
        usage: Option<Usage>,
        choice: bool,
    ) -> String {
        // Held-back tokens' log-probabilities ride on the next chunk with a choice.
        let logprobs = (choice && self.tokenizer.is_some()).then(|| ChatLogprobs {
            content: std::mem::take(&mut self.pending_logprobs),
            refusal: None,
        });
        let c = ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: if choice {
                vec![ChunkChoice {
                    index: self.index,
                    delta,
                    finish_reason: finish,
                    logprobs,
                }]
            } else {
                Vec::new()
            },
            usage,
        };
        serde_json::to_string(&c).unwrap_or_default()
    }

    fn content(&mut self, text: String) -> String {
        self.chunk(
            ChunkDelta {
                content: Some(text),
                ..ChunkDelta::default()
            },
            None,
            None,
            true,
        )
    }
}

impl ChunkWriter for ChatChunks {
    fn start(&mut self) -> Vec<String> {
        vec![self.chunk(
            ChunkDelta {
                role: Some("assistant"),
                content: Some(String::new()),
                ..ChunkDelta::default()
            },
            None,
            None,
            true,
        )]
    }

    fn text(&mut self, delta: &str, logprobs: &[pb::TokenLogprob]) -> Vec<String> {
        if let Some(t) = &self.tokenizer {
            let entries = crate::openai::logprobs::chat_entries(&**t, logprobs);
            self.pending_logprobs.extend(entries);
        }
        if !self.want_tools {
            return vec![self.content(delta.to_string())];
        }
        self.held.push_str(delta);
        if self.in_tool_call || has_open(&self.held) {
            self.in_tool_call = true;
            return Vec::new();
        }
        let keep = partial_open_len(&self.held);
        let send: String = self.held.drain(..self.held.len() - keep).collect();
        if send.is_empty() {
            Vec::new()
        } else {
            vec![self.content(send)]
        }
    }

    fn finish(&mut self, reason: &'static str, usage: Option<&Usage>) -> Vec<String> {
        let mut out = Vec::new();
        let mut reason = reason;
        let held = std::mem::take(&mut self.held);
        if self.want_tools && !held.is_empty() {
            let (content, calls) = parse_tool_calls(&held, &self.id);
            if !content.is_empty() {
                out.push(self.content(content));
            }
            if !calls.is_empty() {
                reason = "tool_calls";
                let deltas = calls
                    .into_iter()
                    .enumerate()
                    .map(|(index, c)| ToolCallDelta {
                        index,
                        id: c.id,
                        kind: c.kind,
                        function: c.function,
                    })
                    .collect();
                out.push(self.chunk(
                    ChunkDelta {
                        tool_calls: Some(deltas),
                        ..ChunkDelta::default()
                    },
                    None,
                    None,
                    true,
                ));
            }
        }
        out.push(self.chunk(ChunkDelta::default(), Some(reason), None, true));
        if let Some(u) = usage {
            out.push(self.usage_chunk(u));
        }
        out
    }

    fn usage_chunk(&mut self, usage: &Usage) -> String {
        self.chunk(ChunkDelta::default(), None, Some(usage.clone()), false)
    }
}
