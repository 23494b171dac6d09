//! Request and response bodies of the OpenAI API subset kvfleet serves:
//! `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//!
//! An unknown top-level request field is collected into [`UnknownFields`] and answered
//! with a 400 naming it, as OpenAI does: a silently ignored parameter is a client bug
//! waiting to happen. Fields inside messages are not checked (clients echo response
//! messages back with fields such as `refusal`). Numbers that must be positive are
//! parsed as signed so a negative value gets a clear 400 instead of a generic parse
//! error.

use crate::chat::{ChatMessage, ToolCall, ToolDefinition};
use serde::{Deserialize, Serialize};

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// A single stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopSpec {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// Most stop strings one request may give: OpenAI's limit.
pub const MAX_STOP_STRINGS: usize = 4;

/// Most bytes (UTF-8) in one stop string. Stop strings are delimiters (a role marker,
/// a closing tag, a fence, a blank line): 256 bytes (about 64 tokens) is far above any
/// of them, yet keeps what a stream may hold back while its tail could still become a
/// stop (under 256 bytes) and the per-request matcher (at most 4 x 256 states) small.
pub const MAX_STOP_STRING_BYTES: usize = 256;

/// Most stop token ids one request may give (the `stop_token_ids` of the worker API):
/// far more than a model has end-of-turn tokens, and a bound on the per-token check.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Checks stop strings against [`MAX_STOP_STRINGS`] and [`MAX_STOP_STRING_BYTES`],
/// counting every string given (empty ones too, as OpenAI does). The one check every
/// front end and the worker API apply; the error says which bound was exceeded.
pub fn check_stop_strings(stops: &[String]) -> Result<(), String> {
    if stops.len() > MAX_STOP_STRINGS {
        return Err(format!(
            "stop may hold at most {MAX_STOP_STRINGS} strings, got {}",
            stops.len()
        ));
    }
    if let Some((i, s)) = stops
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_STRING_BYTES)
    {
        return Err(format!(
            "stop string {i} is {} bytes long; at most {MAX_STOP_STRING_BYTES} are allowed",
            s.len()
        ));
    }
    Ok(())
}

/// Checks stop token ids against [`MAX_STOP_TOKEN_IDS`].
pub fn check_stop_token_ids(ids: &[crate::TokenId]) -> Result<(), String> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(format!(
            "stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {}",
            ids.len()
        ));
    }
    Ok(())
}

/// The names of a body's top-level fields that no other field of its struct took.
///
/// Declared last among a struct's `#[serde(flatten)]` fields, it receives exactly the
/// keys the others left (serde hands flattened structs only their own keys); values
/// are skipped, not kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnknownFields(pub Vec<String>);

impl UnknownFields {
    /// The first unknown field, if any.
    pub fn first(&self) -> Option<&str> {
        self.0.first().map(String::as_str)
    }
}

impl<'de> Deserialize<'de> for UnknownFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl<'de> serde::de::Visitor<'de> for Names {
            type Value = UnknownFields;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UnknownFields, A::Error> {
                let mut names = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    map.next_value::<serde::de::IgnoredAny>()?;
                    names.push(k);
                }
                Ok(UnknownFields(names))
            }
        }
        d.deserialize_map(Names)
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk carrying `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both completion endpoints.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    /// Most tokens to generate (legacy name).
    pub max_tokens: Option<i64>,
    /// Most tokens to generate.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Top-k (an extension vLLM also accepts).
    pub top_k: Option<i64>,
    /// Sampling seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopSpec>,
    /// Number of choices; only 1 is served.
    pub n: Option<i64>,
    /// Keep generating past end-of-sequence (an extension).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Cache namespace (an extension): requests share cached prefixes only within one salt.
    pub cache_salt: Option<String>,
    /// Client-chosen end-user id (passed through to usage records).
    pub user: Option<String>,
    /// Structured output: free text, any JSON object, or JSON valid against a schema.
    pub response_format: Option<ResponseFormat>,
    /// Chat: `true` asks for each token's log-probability; completions: how many
    /// alternatives to list per token (0..=5).
    pub logprobs: Option<LogprobsSpec>,
    /// Chat: alternatives listed per token (0..=20), with `logprobs: true`.
    pub top_logprobs: Option<i64>,
    /// Lowers the logit of every token already generated (-2..=2).
    pub presence_penalty: Option<f32>,
    /// Lowers a token's logit by this times its count so far (-2..=2).
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) to a bias added to its logit (-100..=100), at most 300.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
}

/// `response_format`, served by constrained decoding (see
/// [`crate::structured_output`]).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against `json_schema.schema`.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// `response_format.json_schema`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct JsonSchemaFormat {
    /// The schema's name (required by OpenAI; informational here).
    pub name: String,
    /// What the output is for (informational).
    #[serde(default)]
    pub description: Option<String>,
    /// The JSON Schema; absent means any JSON value.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
    /// Strict schema adherence. Output is always constrained to the schema, so this
    /// changes nothing; accepted for compatibility.
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `logprobs`: a flag (chat) or a count of alternatives (legacy completions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum LogprobsSpec {
    /// Chat completions.
    Flag(bool),
    /// Legacy completions.
    Count(i64),
}

/// One alternative token at a step of a chat answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
}

/// One generated token of a chat answer with its log-probability.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability: the log-softmax of the model's raw logits.
    pub logprob: f32,
    /// The UTF-8 bytes of `token`.
    pub bytes: Vec<u8>,
    /// The step's most likely tokens, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// `choices[].logprobs` of a chat answer or chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<TokenLogprob>,
    /// Always null.
    pub refusal: Option<()>,
}

/// `choices[].logprobs` of a legacy completion.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// Each generated token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f32>,
    /// Per token, its step's most likely tokens (text to log-probability).
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    /// Each token's byte offset in the generated text.
    pub text_offset: Vec<usize>,
}

impl SamplingFields {
    /// The request's stop strings, checked by [`check_stop_strings`], without the
    /// empty ones (which could match nothing).
    pub fn stop_strings(&self) -> Result<Vec<String>, String> {
        let stops = match &self.stop {
            None => return Ok(Vec::new()),
            Some(StopSpec::One(s)) => std::slice::from_ref(s),
            Some(StopSpec::Many(v)) => v.as_slice(),
        };
        check_stop_strings(stops)?;
        Ok(stops.iter().filter(|s| !s.is_empty()).cloned().collect())
    }
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// Model id.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Option<Vec<ToolDefinition>>,
    /// `none` hides the tools from the model; `required` or
    /// `{"type": "function", "function": {"name": …}}` constrains the output to a call
    /// (of any tool, or of the named one); `auto` (the default) leaves the choice.
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// The agent status bar (an extension).
    #[serde(flatten)]
    pub status: crate::chat::status_bar::StatusRequest,
    /// Sampling and streaming.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Top-level fields nothing above accepts (a 400). Must stay the last field.
    #[serde(flatten)]
    pub unknown: UnknownFields,
}

/// The prompt of `/v1/completions`: text or token ids, one or a batch of one.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<i64>),
    /// A batch of texts (only one is served).
    Texts(Vec<String>),
    /// A batch of token lists (only one is served).
    TokenLists(Vec<Vec<i64>>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model id.
    pub model: String,
    /// The prompt.
    pub prompt: PromptInput,
    /// Echo the prompt (not supported).
    #[serde(default)]
    pub echo: bool,
    /// Sampling and streaming.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Top-level fields nothing above accepts (a 400). Must stay the last field.
    #[serde(flatten)]
    pub unknown: UnknownFields,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// The part of `cached_tokens` promoted from a lower tier or a peer: kept for the
    /// usage records, not part of the OpenAI body.
    #[serde(skip)]
    pub promoted: crate::kv_events::PromotedTokens,
}

/// Token accounting of a response.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Cached prompt tokens.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// The assistant message of a chat choice.
#[derive(Clone, Debug, Serialize)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// Text, or null when the answer is only tool calls.
    pub content: Option<String>,
    /// Tool calls the model made.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One choice of a chat completion.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChoice {
    /// Always 0 (n = 1).
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: Option<&'static str>,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
}

/// A non-streamed chat completion.
#[derive(Clone, Debug, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-…`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// The choices.
    pub choices: Vec<ChatChoice>,
    /// Token accounting.
    pub usage: Usage,
    /// The agent status as rendered for this request (an extension), present when
    /// the request asked for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_status: Option<RenderedStatus>,
}

/// The agent status a request was served with.
#[derive(Clone, Debug, Serialize)]
pub struct RenderedStatus {
    /// `replace`: the message was seen by the model for this request only — do not
    /// keep it. `append`: keep the message in the history of the next turns.
    pub mode: &'static str,
    /// The status as the `user` message the model saw.
    pub message: ChatMessage,
}

/// The delta of a streamed chat chunk.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChunkDelta {
    /// Set on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool calls, sent whole once parsed (with their index).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A streamed tool call.
#[derive(Clone, Debug, Serialize)]
pub struct ToolCallDelta {
    /// Position of the call in the message.
    pub index: usize,
    /// Call id.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Name and arguments.
    pub function: crate::chat::FunctionCall,
}

/// One choice of a streamed chat chunk.
#[derive(Clone, Debug, Serialize)]
pub struct ChunkChoice {
    /// Always 0.
    pub index: usize,
    /// What is new.
    pub delta: ChunkDelta,
    /// Set on the last content chunk.
    pub finish_reason: Option<&'static str>,
    /// The log-probabilities of this chunk's tokens, when asked for.
    pub logprobs: Option<ChatLogprobs>,
}

/// A streamed chat chunk.
#[derive(Clone, Debug, Serialize)]
pub struct ChatCompletionChunk {
    /// Same id on every chunk of a response.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// Zero or one choice (zero on the usage-only chunk).
    pub choices: Vec<ChunkChoice>,
    /// Only on the final chunk, when `stream_options.include_usage` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a text completion.
#[derive(Clone, Debug, Serialize)]
pub struct CompletionChoice {
    /// Always 0.
    pub index: usize,
    /// Generated text (new text only, when streamed).
    pub text: String,
    /// `stop` or `length`; null on intermediate stream chunks.
    pub finish_reason: Option<&'static str>,
    /// Log-probabilities (of this chunk's tokens, when streamed), when asked for.
    pub logprobs: Option<CompletionLogprobs>,
}

/// A text completion (or one streamed chunk of it).
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    /// `cmpl-…`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// The choices.
    pub choices: Vec<CompletionChoice>,
    /// Token accounting (on the final chunk when streamed with include_usage).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// An entry of `/v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCard {
    /// Model id.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// `kvfleet`.
    pub owned_by: &'static str,
    /// Context length.
    pub max_model_len: usize,
}

/// `/v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The models.
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_exactly_those_no_struct_takes() {
        let req: ChatCompletionRequest = serde_json::from_str(
            r#"{"model": "m", "messages": [], "frobnicate": {"deep": [1]}, "top_k": 3,
                "cache_salt": "s", "agent_status": {"a": 1}, "zzz": null}"#,
        )
        .unwrap();
        assert_eq!(
            req.unknown.0,
            vec!["frobnicate".to_string(), "zzz".to_string()]
        );
        assert_eq!(req.sampling.top_k, Some(3));
        assert!(req.status.agent_status.is_some());
        let req: CompletionRequest =
            serde_json::from_str(r#"{"model": "m", "prompt": "p", "echo": false}"#).unwrap();
        assert_eq!(req.unknown.first(), None);
    }
}
