//! `POST /v1/messages`: Anthropic's Messages API, a second front end on the chat
//! path ([`super::turn`]): the same template, status bar, sessions and cache-break
//! diagnostics as `/v1/chat/completions`, with Anthropic's bodies, SSE events and
//! error shape.
//!
//! Usage follows Anthropic's definitions (docs/agents.md): `cache_read_input_tokens`
//! are prompt tokens served from the prefix cache (whole blocks; reported with or
//! without breakpoints, since kvfleet caches either way), `cache_creation_input_tokens`
//! the whole blocks between that hit and the last `cache_control` breakpoint, which
//! this request computed and wrote, and `input_tokens` the rest. With breakpoints, the
//! prompt past the last one is kept out of the cache, as Anthropic does.
//!
//! Breakpoints also *pin* (docs/agents.md): the prompt's full blocks up to the last
//! breakpoint stay on the worker that computed them, never evicted, for the longest
//! `ttl` any breakpoint asks (`5m` unless `1h`), within the tenant's pin budget; a
//! later request within the TTL is routed there. The `x-kvfleet-pin` header says
//! whether the pin was granted (a refused pin is still served).

use super::anthropic_error::error_response;
use super::relay::{collect, relay_sse, usage_of, ChunkWriter};
use super::turn::{start_turn, CacheEnd, StartedTurn, TurnInput};
use super::{off_runtime, parse_body, session_id, sse_response, RequestMeta};
use crate::fleet::Fleet;
use crate::openai::error::ApiError;
use crate::openai::tool_call_parser::{has_open, parse_tool_calls, partial_open_len};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvfleet_core::anthropic::{
    breakpoint_tokens, BlockDelta, Conversation, ErrorDetail, MessageDelta, MessagesError,
    MessagesRequest, MessagesResponse, MessagesUsage, ResponseBlock, StreamEvent, ToolChoice,
};
use kvfleet_core::chat::ToolCall;
use kvfleet_core::openai::Usage;
use kvfleet_proto::v1 as pb;
use std::sync::Arc;

/// Handles a Messages request, streamed or not; every error has Anthropic's shape.
pub async fn messages(
    State(fleet): State<Arc<Fleet>>,
    headers: HeaderMap,
    admitted: Option<axum::Extension<super::gate::Admitted>>,
    body: Bytes,
) -> Response {
    match serve(fleet, headers, admitted, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

/// A bad request as a 400 naming its field.
fn bad(e: MessagesError) -> ApiError {
    ApiError::invalid_param(e.param, e.message)
}

async fn serve(
    fleet: Arc<Fleet>,
    headers: HeaderMap,
    admitted: Option<axum::Extension<super::gate::Admitted>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body_bytes = body.len();
    let (req, conv, sampling) = off_runtime(body_bytes, move || {
        let req: MessagesRequest = parse_body(&body)?;
        let conv = Conversation::from_request(&req).map_err(bad)?;
        let sampling = req.sampling().map_err(bad)?;
        Ok((Arc::new(req), conv, sampling))
    })
    .await?;
    let meta = RequestMeta::from_headers(
        "messages",
        &fleet,
        &headers,
        super::admitted(admitted),
        &req.model,
        req.cache_salt.as_deref(),
    )?;
    // `any` and a named `tool` force a tool call by constrained decoding, as OpenAI's
    // `required` and a named function do (`conv.tools` holds only the named one).
    let forced = match &req.tool_choice {
        Some(ToolChoice::Any { .. }) => Some(serde_json::json!("required")),
        Some(ToolChoice::Tool { name, .. }) => {
            Some(serde_json::json!({"type": "function", "function": {"name": name}}))
        }
        _ => None,
    };
    let grammar = super::checked_grammar(None, forced.as_ref(), &conv.tools).await?;
    let session = session_id(&headers, sampling.user.as_deref())?;
    let meta = RequestMeta { session, ..meta };
    let want_tools = !conv.tools.is_empty();
    let pin_ttl_s = conv
        .breakpoints
        .iter()
        .map(|p| u32::try_from(p.ttl_s).unwrap_or(u32::MAX))
        .max();
    let cache_end: Option<CacheEnd> = conv.last_breakpoint().map(|point| {
        let req = req.clone();
        let find: CacheEnd = Box::new(move |prompt, ids| {
            breakpoint_tokens(
                &req,
                point.at,
                &prompt.chat_template,
                prompt.tokenizer.as_ref(),
                ids,
            )
            .map_err(bad)
        });
        find
    });
    let input = TurnInput {
        messages: conv.messages,
        tools: conv.tools,
        status: req.status(),
        cache_end,
        grammar,
        pin_ttl_s,
    };
    let StartedTurn {
        dispatched,
        worker_header,
        cache_end,
        ..
    } = start_turn(&fleet, &meta, body_bytes, input, &sampling).await?;
    let id = format!("msg_{}", dispatched.request_id);
    let block_size = fleet.routing.block_size();
    let model = meta.model_id.clone();
    if sampling.stream {
        let first = usage_of(dispatched.first.usage.as_ref(), 0);
        let writer = MessageEvents {
            start_usage: split(&first, cache_end, block_size),
            message: MessagesResponse {
                id,
                kind: "message",
                role: "assistant",
                model,
                content: Vec::new(),
                stop_reason: None,
                stop_sequence: None,
                usage: MessagesUsage::default(),
            },
            cache_end,
            block_size,
            want_tools,
            held: String::new(),
            in_tool_call: false,
            open_text: None,
            blocks: 0,
            stop: None,
        };
        return Ok(sse_response(worker_header, move |tx| {
            relay_sse(fleet, dispatched, writer, true, tx)
        }));
    }
    let (out, worker) = collect(&fleet, dispatched).await?;
    let worker_header = super::served_by(worker_header, &worker);
    let (text, calls) = match want_tools {
        true => parse_tool_calls(&out.text, &id),
        false => (out.text, Vec::new()),
    };
    let (content, stop_reason) = answer_blocks(text, &calls, out.finish, &id);
    let (stop_reason, stop_sequence) = with_stop_sequence(stop_reason, out.stop_sequence);
    let body = MessagesResponse {
        id,
        kind: "message",
        role: "assistant",
        model,
        content,
        stop_reason: Some(stop_reason),
        stop_sequence,
        usage: split(&out.usage, cache_end, block_size),
    };
    Ok((worker_header, Json(body)).into_response())
}

fn split(u: &Usage, cache_end: Option<usize>, block_size: usize) -> MessagesUsage {
    MessagesUsage::split(
        u.prompt_tokens,
        u.prompt_tokens_details.cached_tokens,
        cache_end,
        block_size,
        u.completion_tokens,
    )
}

/// Anthropic's stop reason for a finish reason (OpenAI's names) and tool calls.
fn stop_reason(finish: Option<&str>, tool_calls: bool) -> &'static str {
    match finish {
        _ if tool_calls => "tool_use",
        Some("length") => "max_tokens",
        _ => "end_turn",
    }
}

/// `stop_sequence` (and the stop string) when one of the request's stop sequences
/// ended an answer that would otherwise have ended its turn.
fn with_stop_sequence(
    reason: &'static str,
    stop: Option<String>,
) -> (&'static str, Option<String>) {
    match (reason, stop) {
        ("end_turn", Some(s)) => ("stop_sequence", Some(s)),
        (r, _) => (r, None),
    }
}

/// A tool call as a `tool_use` block; arguments that are not a JSON object stay
/// text (Anthropic's `input` is always an object).
fn tool_use(call: &ToolCall, id: &str, i: usize) -> Option<ResponseBlock> {
    let input: serde_json::Value = serde_json::from_str(&call.function.arguments).ok()?;
    input.is_object().then(|| ResponseBlock::ToolUse {
        id: format!("toolu_{id}_{i}"),
        name: call.function.name.clone(),
        input,
    })
}

/// The answer's blocks: its text (always one block when there is no tool call), then
/// one `tool_use` block per call.
fn answer_blocks(
    mut text: String,
    calls: &[ToolCall],
    finish: Option<&str>,
    id: &str,
) -> (Vec<ResponseBlock>, &'static str) {
    let mut uses = Vec::new();
    for (i, c) in calls.iter().enumerate() {
        match tool_use(c, id, i) {
            Some(b) => uses.push(b),
            None => text.push_str(&format!(
                "<tool_call>{{\"name\": {:?}, \"arguments\": {}}}</tool_call>",
                c.function.name, c.function.arguments
            )),
        }
    }
    let mut blocks = Vec::new();
    if !text.is_empty() || uses.is_empty() {
        blocks.push(ResponseBlock::Text { text });
    }
    let reason = stop_reason(finish, !uses.is_empty());
    blocks.extend(uses);
    (blocks, reason)
}

/// The SSE events of a streamed answer. With tools, text from a `<tool_call>` tag on
/// is held back and sent as `tool_use` blocks once complete.
struct MessageEvents {
    /// The `message_start` message (no content, no usage yet).
    message: MessagesResponse,
    /// The prompt's usage as the worker first reported it.
    start_usage: MessagesUsage,
    cache_end: Option<usize>,
    block_size: usize,
    want_tools: bool,
    held: String,
    in_tool_call: bool,
    /// The index of the open text block.
    open_text: Option<usize>,
    /// Blocks begun so far.
    blocks: usize,
    /// The stop sequence that ended the answer, once the relay says.
    stop: Option<String>,
}

impl MessageEvents {
    fn json(e: &StreamEvent) -> String {
        serde_json::to_string(e).unwrap_or_default()
    }

    /// Text as deltas of the open text block (opened first when needed).
    fn text_events(&mut self, text: String, out: &mut Vec<String>) {
        let index = match self.open_text {
            Some(i) => i,
            None => {
                let i = self.blocks;
                self.blocks += 1;
                self.open_text = Some(i);
                out.push(Self::json(&StreamEvent::ContentBlockStart {
                    index: i,
                    content_block: ResponseBlock::Text {
                        text: String::new(),
                    },
                }));
                i
            }
        };
        if !text.is_empty() {
            out.push(Self::json(&StreamEvent::ContentBlockDelta {
                index,
                delta: BlockDelta::TextDelta { text },
            }));
        }
    }

    fn close_text(&mut self, out: &mut Vec<String>) {
        if let Some(index) = self.open_text.take() {
            out.push(Self::json(&StreamEvent::ContentBlockStop { index }));
        }
    }
}

impl ChunkWriter for MessageEvents {
    fn start(&mut self) -> Vec<String> {
        let mut message = self.message.clone();
        message.usage = self.start_usage;
        vec![
            Self::json(&StreamEvent::MessageStart { message }),
            Self::json(&StreamEvent::Ping),
        ]
    }

    // Anthropic's Messages API has no log-probabilities.
    fn text(&mut self, delta: &str, _logprobs: &[pb::TokenLogprob]) -> Vec<String> {
        let mut out = Vec::new();
        if !self.want_tools {
            self.text_events(delta.to_string(), &mut out);
            return out;
        }
        self.held.push_str(delta);
        if self.in_tool_call || has_open(&self.held) {
            self.in_tool_call = true;
            return out;
        }
        let keep = partial_open_len(&self.held);
        let send: String = self.held.drain(..self.held.len() - keep).collect();
        if !send.is_empty() {
            self.text_events(send, &mut out);
        }
        out
    }

    fn finish(&mut self, reason: &'static str, usage: Option<&Usage>) -> Vec<String> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        let (text, calls) = match self.want_tools && !held.is_empty() {
            true => parse_tool_calls(&held, &self.message.id),
            false => (held, Vec::new()),
        };
        let (blocks, stop_reason) = answer_blocks(text, &calls, Some(reason), &self.message.id);
        let (stop_reason, stop_sequence) = with_stop_sequence(stop_reason, self.stop.take());
        for block in blocks {
            match block {
                ResponseBlock::Text { text } => {
                    // An empty answer still gets its (empty) text block.
                    if !text.is_empty() || self.blocks == 0 {
                        self.text_events(text, &mut out);
                    }
                }
                ResponseBlock::ToolUse { id, name, input } => {
                    self.close_text(&mut out);
                    let index = self.blocks;
                    self.blocks += 1;
                    out.push(Self::json(&StreamEvent::ContentBlockStart {
                        index,
                        content_block: ResponseBlock::ToolUse {
                            id,
                            name,
                            input: serde_json::json!({}),
                        },
                    }));
                    out.push(Self::json(&StreamEvent::ContentBlockDelta {
                        index,
                        delta: BlockDelta::InputJsonDelta {
                            partial_json: input.to_string(),
                        },
                    }));
                    out.push(Self::json(&StreamEvent::ContentBlockStop { index }));
                }
            }
        }
        self.close_text(&mut out);
        let usage = usage.map_or(self.start_usage, |u| {
            split(u, self.cache_end, self.block_size)
        });
        out.push(Self::json(&StreamEvent::MessageDelta {
            delta: MessageDelta {
                stop_reason: Some(stop_reason),
                stop_sequence,
            },
            usage,
        }));
        out.push(Self::json(&StreamEvent::MessageStop));
        out
    }

    fn stop_sequence(&mut self, stop: &str) {
        self.stop = Some(stop.to_string());
    }

    fn error(&mut self, message: &str) -> String {
        Self::json(&StreamEvent::Error {
            error: ErrorDetail {
                kind: "api_error",
                message: message.to_string(),
            },
        })
    }

    fn done(&self) -> Option<String> {
        None
    }

    /// Messages never streams several choices; should it, the usage goes out as a
    /// `message_delta`.
    fn usage_chunk(&mut self, usage: &Usage) -> String {
        Self::json(&StreamEvent::MessageDelta {
            delta: MessageDelta {
                stop_reason: None,
                stop_sequence: None,
            },
            usage: split(usage, self.cache_end, self.block_size),
        })
    }

    /// Anthropic names each event (`event:` line) after its `type`, which serde
    /// writes first in every [`StreamEvent`]: `{"type":"NAME",...`.
    fn event(&self, chunk: String) -> Event {
        let name = chunk
            .strip_prefix("{\"type\":\"")
            .and_then(|rest| rest.split('"').next())
            .unwrap_or("message")
            .to_string();
        Event::default().event(name).data(chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn writer(want_tools: bool) -> MessageEvents {
        MessageEvents {
            message: MessagesResponse {
                id: "msg_1".into(),
                kind: "message",
                role: "assistant",
                model: "m".into(),
                content: Vec::new(),
                stop_reason: None,
                stop_sequence: None,
                usage: MessagesUsage::default(),
            },
            start_usage: MessagesUsage::split(40, 16, Some(35), 16, 0),
            cache_end: Some(35),
            block_size: 16,
            want_tools,
            held: String::new(),
            in_tool_call: false,
            open_text: None,
            blocks: 0,
            stop: None,
        }
    }

    fn run(w: &mut MessageEvents, deltas: &[&str], reason: &'static str) -> Vec<Value> {
        let mut out = w.start();
        for d in deltas {
            out.extend(w.text(d, &[]));
        }
        let usage = Usage {
            prompt_tokens: 40,
            completion_tokens: 7,
            total_tokens: 47,
            prompt_tokens_details: kvfleet_core::openai::PromptTokensDetails {
                cached_tokens: 16,
                ..Default::default()
            },
        };
        out.extend(w.finish(reason, Some(&usage)));
        out.iter()
            .map(|s| serde_json::from_str(s).unwrap())
            .collect()
    }

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn text_streams_as_one_block_between_start_and_stop() {
        let events = run(&mut writer(false), &["Hel", "lo"], "length");
        assert_eq!(
            types(&events),
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let u = &events[0]["message"]["usage"];
        assert_eq!(
            (
                u["cache_read_input_tokens"].as_u64(),
                u["cache_creation_input_tokens"].as_u64()
            ),
            (Some(16), Some(16))
        );
        assert_eq!(events[6]["delta"]["stop_reason"], "max_tokens");
        assert_eq!(events[6]["usage"]["output_tokens"], 7);
        assert_eq!(events[6]["usage"]["input_tokens"], 8);
    }

    #[test]
    fn a_tool_call_streams_as_a_tool_use_block_with_its_input_json() {
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (a, b) = call.split_at(7);
        let events = run(&mut writer(true), &["Let me check. ", a, b], "stop");
        assert_eq!(
            types(&events),
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(events[3]["delta"]["text"], "Let me check. ");
        let block = &events[5]["content_block"];
        assert_eq!(
            (block["type"].as_str(), block["name"].as_str()),
            (Some("tool_use"), Some("get_weather"))
        );
        assert_eq!(events[5]["index"], 1);
        let json = events[6]["delta"]["partial_json"].as_str().unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(json).unwrap(),
            serde_json::json!({"city": "Paris"})
        );
        assert_eq!(events[8]["delta"]["stop_reason"], "tool_use");
    }

    #[test]
    fn an_empty_answer_still_has_a_text_block() {
        let events = run(&mut writer(false), &[], "stop");
        assert_eq!(events[2]["content_block"]["type"], "text");
        assert_eq!(events[3]["type"], "content_block_stop");
        assert_eq!(events[4]["delta"]["stop_reason"], "end_turn");
    }

    #[test]
    fn events_are_named_after_their_type_and_errors_have_anthropics_shape() {
        let mut w = writer(false);
        let e = w.error("worker gone");
        let v: Value = serde_json::from_str(&e).unwrap();
        assert_eq!(v["error"]["type"], "api_error");
        assert_eq!(w.done(), None);
    }
}
