//! Deterministic chat rendering: OpenAI-style messages in, prompt text out.
//!
//! The router renders every request with a [`ChatTemplate`] and tokenizes the result;
//! requests share cached KV blocks only if their prompts are byte-identical. Rendering
//! is therefore a pure function of the messages and tools: no timestamps, no
//! randomness, and JSON embedded in the prompt (tool signatures, call arguments) is
//! written canonically with sorted keys (see [`to_canonical_json`]), so clients that
//! order keys differently still share a prefix.
//!
//! [`ChatTemplate::ChatMl`] is the built-in ChatML renderer (Qwen2.5's layout, used by
//! the default model) and is append-only across turns; [`ChatTemplate::Jinja`] runs a
//! model's own Hugging Face chat template.

mod canonical_json;
mod chatml;
pub mod fork_message;
mod jinja;
mod messages;
pub mod status_bar;

pub use canonical_json::{to_canonical_json, write_canonical_json};
pub use jinja::JinjaTemplate;
pub use messages::{
    ChatMessage, ContentPart, FunctionCall, FunctionDefinition, MessageContent, Role, ToolCall,
    ToolDefinition,
};

use crate::tokenizer::special_token_text;
use std::path::{Path, PathBuf};

/// Why a chat template could not be loaded or a conversation could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// There were no messages to render.
    #[error("cannot render an empty conversation")]
    EmptyMessages,
    /// The Jinja template does not compile.
    #[error("chat template syntax error: {0:#}")]
    TemplateSyntax(#[source] minijinja::Error),
    /// The Jinja template failed while rendering, including by `raise_exception`.
    #[error("chat template rendering failed: {0:#}")]
    Render(#[source] minijinja::Error),
    /// A template configuration file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A template configuration file is not valid JSON.
    #[error("invalid JSON in {path}: {source}")]
    Json {
        /// The configuration file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The configuration has a `chat_template` of an unexpected shape.
    #[error("invalid chat_template: {0}")]
    InvalidConfig(String),
    /// The configuration has no chat template.
    #[error("the tokenizer configuration has no chat_template")]
    MissingTemplate,
}

/// How conversations are turned into prompt text.
#[derive(Clone, Debug, Default)]
pub enum ChatTemplate {
    /// Built-in ChatML in Qwen2.5's layout, tool calls included.
    #[default]
    ChatMl,
    /// A Hugging Face Jinja chat template.
    Jinja(JinjaTemplate),
}

impl ChatTemplate {
    /// Reads the chat template of a `tokenizer_config.json` file. When the file has no
    /// `chat_template`, a `chat_template.jinja` next to it is used (where recent
    /// versions of transformers save it).
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self, ChatError> {
        let path = path.as_ref();
        let bytes = read(path)?;
        let mut config: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|source| ChatError::Json {
                path: path.to_owned(),
                source,
            })?;
        if config.get("chat_template").is_none() {
            let sibling = path.with_file_name("chat_template.jinja");
            if sibling.is_file() {
                let source = String::from_utf8_lossy(&read(&sibling)?).into_owned();
                if let Some(obj) = config.as_object_mut() {
                    obj.insert("chat_template".into(), source.into());
                }
            }
        }
        Self::from_tokenizer_config_json(&config)
    }

    /// The chat template of a parsed `tokenizer_config.json`: `chat_template` is either
    /// a string or a list of `{name, template}`, from which `default` (or else the first
    /// entry) is used, and `tool_use`, when present, for requests with tools.
    /// `bos_token` and `eos_token` (strings or `{content}` objects) are passed to the
    /// template.
    pub fn from_tokenizer_config_json(config: &serde_json::Value) -> Result<Self, ChatError> {
        let token = |key: &str| config.get(key).and_then(special_token_text);
        let (bos, eos) = (token("bos_token"), token("eos_token"));
        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => Err(ChatError::MissingTemplate),
            Some(serde_json::Value::String(source)) => {
                Ok(Self::Jinja(JinjaTemplate::new(source.as_str(), bos, eos)?))
            }
            Some(serde_json::Value::Array(entries)) => {
                let mut named = Vec::with_capacity(entries.len());
                for entry in entries {
                    let field = |key: &str| entry.get(key).and_then(serde_json::Value::as_str);
                    match (field("name"), field("template")) {
                        (Some(name), Some(template)) => named.push((name, template)),
                        _ => {
                            return Err(ChatError::InvalidConfig(
                                "list entries need string `name` and `template`".into(),
                            ))
                        }
                    }
                }
                let find = |wanted: &str| named.iter().find(|(name, _)| *name == wanted);
                let (_, default) = find("default")
                    .or_else(|| named.first())
                    .ok_or(ChatError::MissingTemplate)?;
                let mut template = JinjaTemplate::new(*default, bos, eos)?;
                if let Some((_, tool_use)) = find("tool_use") {
                    template = template.with_tool_use_template(*tool_use)?;
                }
                Ok(Self::Jinja(template))
            }
            Some(other) => Err(ChatError::InvalidConfig(format!(
                "expected a string or a list, found {other}"
            ))),
        }
    }

    /// The chat template of a Hugging Face model directory: its
    /// `tokenizer_config.json` template when it has one, ChatML otherwise.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self, ChatError> {
        let tc = dir.as_ref().join("tokenizer_config.json");
        if !tc.is_file() {
            return Ok(ChatTemplate::ChatMl);
        }
        match Self::from_tokenizer_config(&tc) {
            Err(ChatError::MissingTemplate) => Ok(ChatTemplate::ChatMl),
            other => other,
        }
    }

    /// Renders a conversation as prompt text. `add_generation_prompt` appends the
    /// header of the assistant turn the model is to write. The result depends only on
    /// the arguments' values (not on JSON key order).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        match self {
            ChatTemplate::ChatMl => chatml::render(messages, tools, add_generation_prompt),
            ChatTemplate::Jinja(template) => {
                template.render(messages, tools, add_generation_prompt)
            }
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, ChatError> {
    std::fs::read(path).map_err(|source| ChatError::Io {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests;
