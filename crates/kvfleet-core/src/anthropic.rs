//! Request and response bodies of Anthropic's Messages API (`POST /v1/messages`), and
//! their mapping onto the chat messages every front end renders with one template.
//!
//! Unlike the OpenAI bodies, unknown fields are refused (Anthropic answers 400 for
//! them): a silently ignored parameter is a client bug waiting to happen. kvfleet's
//! own extensions (`cache_salt`, the agent status fields) are accepted by name.
//!
//! The mapping ([`Conversation::from_request`]): `system` becomes the first system
//! message (its blocks joined with `"\n"`, as content parts are); text blocks become
//! content parts; an assistant's `tool_use` blocks become its tool calls (input as
//! canonical JSON); a user's `tool_result` blocks become tool messages, before the
//! message's text. `cache_control` breakpoints are collected in prefix order (tools,
//! then system, then messages) and [`Conversation::prefix`] gives the conversation
//! that ends at one, so the front end can find the breakpoint's token position.

use crate::chat::{ChatMessage, ContentPart, MessageContent, Role, ToolDefinition};
use crate::chat::{FunctionCall, FunctionDefinition, ToolCall};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

/// Most `cache_control` breakpoints one request may set (Anthropic's limit).
pub const MAX_BREAKPOINTS: usize = 4;

/// `POST /v1/messages`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    /// Model id.
    pub model: String,
    /// Most tokens to generate (required, as in Anthropic's API).
    pub max_tokens: i64,
    /// The conversation.
    pub messages: Vec<InputMessage>,
    /// The system prompt: a string or text blocks.
    #[serde(default, deserialize_with = "system_prompt")]
    pub system: Option<Vec<TextBlock>>,
    /// Tools the model may call.
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    /// How the model should use the tools.
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Custom stop strings.
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// Sampling temperature, 0 to 1.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k sampling.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Request metadata; `user_id` is the session.
    #[serde(default)]
    pub metadata: Option<Metadata>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// A breakpoint on the request's last block (Anthropic's automatic caching).
    #[serde(default)]
    pub cache_control: Option<CacheControl>,
    /// Cache namespace (a kvfleet extension).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Agent status fields (a kvfleet extension, as on chat completions).
    #[serde(default)]
    pub agent_status: Option<Map<String, Value>>,
    /// `replace` (default) or `append` (a kvfleet extension).
    #[serde(default)]
    pub status_mode: Option<crate::chat::status_bar::StatusMode>,
    /// Server-observed status fields (a kvfleet extension).
    #[serde(default)]
    pub status_fields: Option<Vec<String>>,
    /// Per-tool call limits for the status bar (a kvfleet extension).
    #[serde(default)]
    pub tool_call_limits: Option<Map<String, Value>>,
}

impl MessagesRequest {
    /// The agent status fields, in the shape chat completions take them.
    pub fn status(&self) -> crate::chat::status_bar::StatusRequest {
        crate::chat::status_bar::StatusRequest {
            agent_status: self.agent_status.clone(),
            status_mode: self.status_mode,
            status_fields: self.status_fields.clone(),
            tool_call_limits: self.tool_call_limits.clone(),
        }
    }

    /// The sampling fields, in the shape chat completions take them (then checked by
    /// the same code). Anthropic's temperature range (0 to 1) is checked here.
    pub fn sampling(&self) -> Result<crate::openai::SamplingFields, MessagesError> {
        if let Some(t) = self.temperature {
            if !t.is_finite() || !(0.0..=1.0).contains(&t) {
                return Err(MessagesError::new(
                    "temperature",
                    format!("temperature must be between 0 and 1, got {t}"),
                ));
            }
        }
        Ok(crate::openai::SamplingFields {
            max_tokens: Some(self.max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self
                .stop_sequences
                .clone()
                .map(crate::openai::StopSpec::Many),
            stream: self.stream,
            cache_salt: self.cache_salt.clone(),
            user: self.metadata.as_ref().and_then(|m| m.user_id.clone()),
            ..Default::default()
        })
    }
}

/// `metadata`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    /// An opaque id of the end user: kvfleet's session id.
    #[serde(default)]
    pub user_id: Option<String>,
}

/// Who wrote an input message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputRole {
    /// The end user (and tool results).
    User,
    /// The model (and its tool calls).
    Assistant,
}

/// One message of the conversation.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputMessage {
    /// Who wrote it.
    pub role: InputRole,
    /// A string or content blocks.
    #[serde(deserialize_with = "content_blocks")]
    pub content: Vec<ContentBlock>,
}

/// A system prompt block.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextBlock {
    /// Always `text`.
    #[serde(rename = "type")]
    pub kind: TextKind,
    /// The text.
    pub text: String,
    /// A cache breakpoint after this block.
    #[serde(default)]
    pub cache_control: Option<CacheControl>,
    /// Accepted and ignored.
    #[serde(default)]
    pub citations: Option<Value>,
}

/// The only system block type.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextKind {
    /// `text`.
    Text,
}

/// A content block of an input message.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ContentBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
        /// A cache breakpoint after this block.
        #[serde(default)]
        cache_control: Option<CacheControl>,
        /// Accepted and ignored.
        #[serde(default)]
        citations: Option<Value>,
    },
    /// An image: parsed so that it is refused by name (a text model cannot see it).
    Image {
        /// The image source.
        #[serde(default)]
        source: Option<Value>,
        /// A cache breakpoint after this block.
        #[serde(default)]
        cache_control: Option<CacheControl>,
    },
    /// A tool call the assistant made.
    ToolUse {
        /// The call id, answered by a `tool_result`'s `tool_use_id`.
        id: String,
        /// The tool's name.
        name: String,
        /// The arguments (an object).
        input: Value,
        /// A cache breakpoint after this block.
        #[serde(default)]
        cache_control: Option<CacheControl>,
        /// Who made the call (the SDK echoes it back); accepted and ignored.
        #[serde(default)]
        caller: Option<Value>,
        /// The tool's toolset (the SDK echoes it back); accepted and ignored.
        #[serde(default)]
        toolset_name: Option<Value>,
    },
    /// The result of a tool call.
    ToolResult {
        /// The call this answers.
        tool_use_id: String,
        /// A string or text blocks.
        #[serde(default, deserialize_with = "optional_content_blocks")]
        content: Option<Vec<ContentBlock>>,
        /// Whether the tool failed.
        #[serde(default)]
        is_error: Option<bool>,
        /// The tool's toolset; accepted and ignored.
        #[serde(default)]
        toolset_name: Option<Value>,
        /// A cache breakpoint after this block.
        #[serde(default)]
        cache_control: Option<CacheControl>,
    },
}

impl ContentBlock {
    fn cache_control(&self) -> Option<&CacheControl> {
        match self {
            ContentBlock::Text { cache_control, .. }
            | ContentBlock::Image { cache_control, .. }
            | ContentBlock::ToolUse { cache_control, .. }
            | ContentBlock::ToolResult { cache_control, .. } => cache_control.as_ref(),
        }
    }
}

/// `cache_control`: `{"type": "ephemeral", "ttl": "5m" | "1h"}`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheControl {
    /// Always `ephemeral`.
    #[serde(rename = "type")]
    pub kind: CacheKind,
    /// How long the prefix should live: `5m` (default) or `1h`.
    #[serde(default)]
    pub ttl: Option<String>,
}

/// The only cache type.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheKind {
    /// `ephemeral`.
    Ephemeral,
}

/// A tool the model may call.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// `custom` when given; Anthropic's server tools are not served.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The tool's name.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: Option<String>,
    /// JSON Schema of its input.
    pub input_schema: Value,
    /// A cache breakpoint after this tool.
    #[serde(default)]
    pub cache_control: Option<CacheControl>,
}

/// `tool_choice`.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToolChoice {
    /// The model decides.
    Auto {
        /// Accepted; one call at a time is not enforced.
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must use one of the tools (forced by constrained decoding).
    Any {
        /// Accepted; not enforced.
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must use this tool: only it is shown to the model, and the call is
    /// forced by constrained decoding.
    Tool {
        /// The tool's name.
        name: String,
        /// Accepted; not enforced.
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    /// No tools: they are hidden from the model.
    None {},
}

/// A bad Messages request: the field at fault and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessagesError {
    /// The request field at fault.
    pub param: &'static str,
    /// What is wrong.
    pub message: String,
}

impl MessagesError {
    fn new(param: &'static str, message: impl Into<String>) -> Self {
        MessagesError {
            param,
            message: message.into(),
        }
    }
}

/// Where a `cache_control` breakpoint sits. The derived order is Anthropic's prefix
/// order: tools, then system blocks, then message blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Breakpoint {
    /// After tool `i`.
    Tool(usize),
    /// After system block `i`.
    System(usize),
    /// After block `block` of message `message`.
    Message {
        /// The message's index.
        message: usize,
        /// The block's index in the message.
        block: usize,
    },
}

/// A breakpoint and its requested lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachePoint {
    /// Where it sits.
    pub at: Breakpoint,
    /// Seconds the prefix should live (`5m`: 300, `1h`: 3600).
    pub ttl_s: u64,
}

/// A Messages request as chat messages and tools, with its breakpoints.
#[derive(Clone, Debug)]
pub struct Conversation {
    /// The messages to render (system first when there is one).
    pub messages: Vec<ChatMessage>,
    /// The tools shown to the model (after `tool_choice`).
    pub tools: Vec<ToolDefinition>,
    /// The breakpoints, in prefix order.
    pub breakpoints: Vec<CachePoint>,
}

impl Conversation {
    /// Maps `req` onto chat messages and checks its content and breakpoints: images,
    /// more than [`MAX_BREAKPOINTS`] breakpoints, a breakpoint inside a tool result's
    /// content, a `ttl` other than `5m`/`1h`, an unknown `tool_choice` tool are errors.
    pub fn from_request(req: &MessagesRequest) -> Result<Self, MessagesError> {
        if req.messages.is_empty() {
            return Err(MessagesError::new(
                "messages",
                "messages: at least one message is required",
            ));
        }
        let breakpoints = breakpoints(req)?;
        let tools = tools(req)?;
        let messages = messages(req, None)?;
        Ok(Conversation {
            messages,
            tools,
            breakpoints,
        })
    }

    /// The conversation `req` has up to and including the block at `at` (with every
    /// tool shown unless `at` is a tool; tools render with the system prompt, so a tool
    /// breakpoint's prefix holds the system prompt too). Rendered without a generation
    /// prompt, its tokens agree with the full prompt's up to the breakpoint.
    pub fn prefix(
        req: &MessagesRequest,
        at: Breakpoint,
    ) -> Result<(Vec<ChatMessage>, Vec<ToolDefinition>), MessagesError> {
        let mut tools = tools(req)?;
        if let Breakpoint::Tool(i) = at {
            tools.truncate(i + 1);
        }
        let mut messages = messages(req, Some(at))?;
        if messages.is_empty() {
            // A template needs a message; an empty user turn starts as the next one would.
            messages.push(ChatMessage::user(""));
        }
        Ok((messages, tools))
    }

    /// The last breakpoint, if any: the end of what the request asks to cache.
    pub fn last_breakpoint(&self) -> Option<CachePoint> {
        self.breakpoints.last().copied()
    }
}

fn ttl_seconds(c: &CacheControl, param: &'static str) -> Result<u64, MessagesError> {
    match c.ttl.as_deref() {
        None | Some("5m") => Ok(300),
        Some("1h") => Ok(3600),
        Some(other) => Err(MessagesError::new(
            param,
            format!("cache_control.ttl must be \"5m\" or \"1h\", got {other:?}"),
        )),
    }
}

fn breakpoints(req: &MessagesRequest) -> Result<Vec<CachePoint>, MessagesError> {
    let mut out = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        if let Some(c) = &t.cache_control {
            out.push(CachePoint {
                at: Breakpoint::Tool(i),
                ttl_s: ttl_seconds(c, "tools")?,
            });
        }
    }
    for (i, b) in req.system.iter().flatten().enumerate() {
        if let Some(c) = &b.cache_control {
            out.push(CachePoint {
                at: Breakpoint::System(i),
                ttl_s: ttl_seconds(c, "system")?,
            });
        }
    }
    for (m, msg) in req.messages.iter().enumerate() {
        for (b, block) in msg.content.iter().enumerate() {
            if let ContentBlock::ToolResult {
                content: Some(inner),
                ..
            } = block
            {
                if inner.iter().any(|x| x.cache_control().is_some()) {
                    return Err(MessagesError::new(
                        "messages",
                        format!(
                            "messages.{m}.content.{b}: cache_control may not be set inside a \
                             tool_result's content (set it on the tool_result block)"
                        ),
                    ));
                }
            }
            if let Some(c) = block.cache_control() {
                out.push(CachePoint {
                    at: Breakpoint::Message {
                        message: m,
                        block: b,
                    },
                    ttl_s: ttl_seconds(c, "messages")?,
                });
            }
        }
    }
    // The top-level marker applies to the last block of the last message.
    if let Some(c) = &req.cache_control {
        let last = req
            .messages
            .iter()
            .enumerate()
            .rev()
            .find(|(_, m)| !m.content.is_empty());
        if let Some((m, msg)) = last {
            let at = Breakpoint::Message {
                message: m,
                block: msg.content.len() - 1,
            };
            let ttl_s = ttl_seconds(c, "cache_control")?;
            if !out.iter().any(|p| p.at == at) {
                out.push(CachePoint { at, ttl_s });
            }
        }
    }
    if out.len() > MAX_BREAKPOINTS {
        return Err(MessagesError::new(
            "cache_control",
            format!(
                "a request may set at most {MAX_BREAKPOINTS} cache_control breakpoints, got {}",
                out.len()
            ),
        ));
    }
    Ok(out)
}

fn tools(req: &MessagesRequest) -> Result<Vec<ToolDefinition>, MessagesError> {
    let all = req.tools.as_deref().unwrap_or_default();
    for t in all {
        if let Some(kind) = t.kind.as_deref().filter(|k| *k != "custom") {
            return Err(MessagesError::new(
                "tools",
                format!("tool type {kind:?} is not served here; only custom tools are"),
            ));
        }
    }
    let shown: Vec<&Tool> = match &req.tool_choice {
        Some(ToolChoice::None {}) => Vec::new(),
        Some(ToolChoice::Tool { name, .. }) => {
            let named: Vec<&Tool> = all.iter().filter(|t| &t.name == name).collect();
            if named.is_empty() {
                return Err(MessagesError::new(
                    "tool_choice",
                    format!("tool_choice names tool {name:?}, which is not in tools"),
                ));
            }
            named
        }
        _ => all.iter().collect(),
    };
    Ok(shown
        .into_iter()
        .map(|t| ToolDefinition {
            kind: "function".into(),
            function: FunctionDefinition {
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: Some(t.input_schema.clone()),
            },
        })
        .collect())
}

/// The text of text blocks (a tool result's content), refusing anything else.
fn blocks_text(blocks: &[ContentBlock], at: &str) -> Result<String, MessagesError> {
    let mut out = String::new();
    for (i, b) in blocks.iter().enumerate() {
        match b {
            ContentBlock::Text { text, .. } => {
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(text);
            }
            ContentBlock::Image { .. } => return Err(image_error(at)),
            _ => {
                return Err(MessagesError::new(
                    "messages",
                    format!("{at}: a tool_result's content may hold only text blocks"),
                ))
            }
        }
    }
    Ok(out)
}

fn image_error(at: &str) -> MessagesError {
    MessagesError::new(
        "messages",
        format!("{at}: image content is not supported: this model reads text only"),
    )
}

/// The chat messages of `req`, stopping after the block at `cut` when given.
fn messages(
    req: &MessagesRequest,
    cut: Option<Breakpoint>,
) -> Result<Vec<ChatMessage>, MessagesError> {
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        let take = match cut {
            Some(Breakpoint::System(i)) => i + 1,
            _ => system.len(),
        };
        if take > 0 {
            let parts = system[..take.min(system.len())]
                .iter()
                .map(|b| ContentPart::Text {
                    text: b.text.clone(),
                })
                .collect();
            out.push(ChatMessage {
                content: Some(MessageContent::Parts(parts)),
                ..ChatMessage::system("")
            });
        }
    }
    let last = match cut {
        Some(Breakpoint::Tool(_)) | Some(Breakpoint::System(_)) => return Ok(out),
        Some(Breakpoint::Message { message, block }) => Some((message, block)),
        None => None,
    };
    for (m, msg) in req.messages.iter().enumerate() {
        let blocks = match last {
            Some((lm, _)) if m > lm => break,
            Some((lm, lb)) if m == lm => &msg.content[..(lb + 1).min(msg.content.len())],
            _ => &msg.content[..],
        };
        let mut parts = Vec::new();
        let mut calls = Vec::new();
        for (b, block) in blocks.iter().enumerate() {
            let at = format!("messages.{m}.content.{b}");
            match (msg.role, block) {
                (_, ContentBlock::Text { text, .. }) => {
                    parts.push(ContentPart::Text { text: text.clone() })
                }
                (_, ContentBlock::Image { .. }) => return Err(image_error(&at)),
                (
                    InputRole::Assistant,
                    ContentBlock::ToolUse {
                        id, name, input, ..
                    },
                ) => {
                    if !input.is_object() {
                        return Err(MessagesError::new(
                            "messages",
                            format!("{at}: a tool_use's input must be an object"),
                        ));
                    }
                    calls.push(ToolCall {
                        id: id.clone(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: name.clone(),
                            arguments: crate::chat::to_canonical_json(input),
                        },
                    })
                }
                (
                    InputRole::User,
                    ContentBlock::ToolResult {
                        tool_use_id,
                        content,
                        is_error,
                        ..
                    },
                ) => {
                    let mut text = blocks_text(content.as_deref().unwrap_or_default(), &at)?;
                    if is_error.unwrap_or(false) {
                        text.insert_str(0, "error: ");
                    }
                    if !parts.is_empty() {
                        return Err(MessagesError::new(
                            "messages",
                            format!("{at}: tool_result blocks must come before any text"),
                        ));
                    }
                    out.push(ChatMessage::tool(tool_use_id.clone(), text));
                }
                (InputRole::User, ContentBlock::ToolUse { .. }) => {
                    return Err(MessagesError::new(
                        "messages",
                        format!("{at}: tool_use blocks belong in assistant messages"),
                    ))
                }
                (InputRole::Assistant, ContentBlock::ToolResult { .. }) => {
                    return Err(MessagesError::new(
                        "messages",
                        format!("{at}: tool_result blocks belong in user messages"),
                    ))
                }
            }
        }
        let role = match msg.role {
            InputRole::User => Role::User,
            InputRole::Assistant => Role::Assistant,
        };
        let only_tool_results = parts.is_empty()
            && calls.is_empty()
            && !blocks.is_empty()
            && role == Role::User
            && blocks
                .iter()
                .all(|b| matches!(b, ContentBlock::ToolResult { .. }));
        if !only_tool_results {
            out.push(ChatMessage {
                role,
                content: if parts.is_empty() && !calls.is_empty() {
                    None
                } else {
                    Some(MessageContent::Parts(parts))
                },
                name: None,
                tool_calls: calls,
                tool_call_id: None,
            });
        }
    }
    Ok(out)
}

/// A string as one text block, or a list of blocks.
fn content_blocks<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ContentBlock>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Blocks(Value),
    }
    match Raw::deserialize(d)? {
        Raw::Text(text) => Ok(vec![ContentBlock::Text {
            text,
            cache_control: None,
            citations: None,
        }]),
        // Deserialized from the value, so a bad block's own error reaches the client.
        Raw::Blocks(v) => serde_json::from_value(v).map_err(serde::de::Error::custom),
    }
}

fn optional_content_blocks<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<ContentBlock>>, D::Error> {
    content_blocks(d).map(Some)
}

fn system_prompt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<TextBlock>>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(vec![TextBlock {
            kind: TextKind::Text,
            text,
            cache_control: None,
            citations: None,
        }])),
        Some(v) => serde_json::from_value(v)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

/// How many leading tokens of `full` (the ids of `req`'s whole prompt, rendered with
/// `template` and tokenized with `tokenizer`) belong to the prefix that ends at
/// breakpoint `at`: the prefix conversation is rendered without a generation prompt
/// and tokenized, and the ids it shares with `full` are counted. Blocking CPU work.
pub fn breakpoint_tokens(
    req: &MessagesRequest,
    at: Breakpoint,
    template: &crate::chat::ChatTemplate,
    tokenizer: &dyn crate::tokenizer::Tokenizer,
    full: &[crate::TokenId],
) -> Result<usize, MessagesError> {
    let (messages, tools) = Conversation::prefix(req, at)?;
    let text = template
        .render(&messages, &tools, false)
        .map_err(|e| MessagesError::new("messages", e.to_string()))?;
    let ids = tokenizer
        .encode(&text)
        .map_err(|e| MessagesError::new("messages", e.to_string()))?;
    Ok(ids.iter().zip(full).take_while(|(a, b)| a == b).count())
}

/// A content block of the answer.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseBlock {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// A tool call.
    ToolUse {
        /// `toolu_…`.
        id: String,
        /// The tool's name.
        name: String,
        /// The arguments.
        input: Value,
    },
}

/// `usage`, as Anthropic defines it; the four counts add up to the prompt plus the
/// answer. See docs/agents.md for how kvfleet counts each.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MessagesUsage {
    /// Prompt tokens neither read from nor written to the cache.
    pub input_tokens: usize,
    /// Generated tokens.
    pub output_tokens: usize,
    /// Prompt tokens this request computed and wrote to the cache (up to the last
    /// breakpoint, whole blocks).
    pub cache_creation_input_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cache_read_input_tokens: usize,
}

impl MessagesUsage {
    /// Splits a prompt of `prompt` tokens, `cached` of them served from the cache, for
    /// a request whose cacheable prefix ends at `cache_end` tokens (its last
    /// breakpoint; `None` without one), with blocks of `block_size` tokens. Only whole
    /// blocks are cached, so only whole blocks count as written.
    pub fn split(
        prompt: usize,
        cached: usize,
        cache_end: Option<usize>,
        block_size: usize,
        output: usize,
    ) -> Self {
        let cached = cached.min(prompt);
        let written_end = cache_end.map_or(0, |e| e.min(prompt) / block_size.max(1) * block_size);
        let creation = written_end.saturating_sub(cached);
        MessagesUsage {
            input_tokens: prompt - cached - creation,
            output_tokens: output,
            cache_creation_input_tokens: creation,
            cache_read_input_tokens: cached,
        }
    }
}

/// A non-streamed answer (also the `message` of `message_start`).
#[derive(Clone, Debug, Serialize)]
pub struct MessagesResponse {
    /// `msg_…`.
    pub id: String,
    /// `message`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `assistant`.
    pub role: &'static str,
    /// Model id.
    pub model: String,
    /// Text and tool-use blocks.
    pub content: Vec<ResponseBlock>,
    /// `end_turn`, `max_tokens`, `stop_sequence` or `tool_use`; null in `message_start`.
    pub stop_reason: Option<&'static str>,
    /// The stop sequence that ended the answer (never known today: null).
    pub stop_sequence: Option<String>,
    /// Token accounting.
    pub usage: MessagesUsage,
}

/// A delta of a streamed content block.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    /// More text.
    TextDelta {
        /// The new text.
        text: String,
    },
    /// More of a tool call's input JSON.
    InputJsonDelta {
        /// The JSON text.
        partial_json: String,
    },
}

/// `message_delta`'s `delta`.
#[derive(Clone, Debug, Serialize)]
pub struct MessageDelta {
    /// Why the answer ended.
    pub stop_reason: Option<&'static str>,
    /// The stop sequence (never known today: null).
    pub stop_sequence: Option<String>,
}

/// An error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorDetail {
    /// `invalid_request_error`, `authentication_error`, `not_found_error`, ...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What went wrong.
    pub message: String,
}

/// One server-sent event of a streamed answer. The event name (`event:` line) is the
/// `type` field, which serde writes first.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// The answer begins (with the prompt's usage).
    MessageStart {
        /// The message, without content.
        message: MessagesResponse,
    },
    /// A content block begins.
    ContentBlockStart {
        /// The block's index.
        index: usize,
        /// The block, empty.
        content_block: ResponseBlock,
    },
    /// More of a content block.
    ContentBlockDelta {
        /// The block's index.
        index: usize,
        /// What is new.
        delta: BlockDelta,
    },
    /// A content block ends.
    ContentBlockStop {
        /// The block's index.
        index: usize,
    },
    /// The answer's end state.
    MessageDelta {
        /// Stop reason and sequence.
        delta: MessageDelta,
        /// Final usage (`output_tokens` is what changed).
        usage: MessagesUsage,
    },
    /// The answer is complete.
    MessageStop,
    /// Keep-alive.
    Ping,
    /// A failure after the stream began.
    Error {
        /// What failed.
        error: ErrorDetail,
    },
}

impl StreamEvent {
    /// The event's name: its `type`.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Ping => "ping",
            StreamEvent::Error { .. } => "error",
        }
    }
}

#[cfg(test)]
mod tests;
