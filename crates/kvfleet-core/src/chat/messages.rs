//! Chat messages and tool definitions in the shapes of the OpenAI chat completions API,
//! so the router can deserialize request JSON straight into them.
//!
//! Unknown fields are ignored, as OpenAI-compatible servers do, because clients send
//! extras (`refusal`, `strict`, ...) that do not affect the prompt.

use serde::{Deserialize, Deserializer, Serialize};

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the model. OpenAI's newer name `developer` is accepted too.
    #[serde(alias = "developer")]
    System,
    /// The end user.
    User,
    /// The model.
    Assistant,
    /// The result of a tool call.
    Tool,
}

impl Role {
    /// The role's name as chat templates write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// The content of a message: a string, or an array of content parts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts; only text parts exist for a text model, so any other part type
    /// fails deserialization rather than being silently dropped.
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The text of the content. Parts are joined with `"\n"`, as vLLM does, so a
    /// prompt sent as parts renders like the same prompt sent as one string with
    /// newlines.
    pub fn text(&self) -> String {
        let mut out = String::new();
        self.write_text(&mut out);
        out
    }

    /// Appends the text of the content to `out` without an intermediate allocation.
    pub(crate) fn write_text(&self, out: &mut String) {
        match self {
            MessageContent::Text(text) => out.push_str(text),
            MessageContent::Parts(parts) => {
                for (i, ContentPart::Text { text }) in parts.iter().enumerate() {
                    if i > 0 {
                        out.push('\n');
                    }
                    out.push_str(text);
                }
            }
        }
    }

    /// Whether the content has no text at all.
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            MessageContent::Text(text) => text.is_empty(),
            MessageContent::Parts(parts) => parts
                .iter()
                .all(|ContentPart::Text { text }| text.is_empty()),
        }
    }
}

/// One part of an array-form message content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// `{"type": "text", "text": "..."}`.
    Text {
        /// The text.
        text: String,
    },
}

/// A tool call made by the assistant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, echoed by the tool message that answers it.
    #[serde(default)]
    pub id: String,
    /// The call type; always `"function"` today.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The function called.
    pub function: FunctionCall,
}

/// The function named by a [`ToolCall`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments as a JSON string. Some clients send a JSON object instead; it is
    /// accepted and kept as its JSON text.
    #[serde(default, deserialize_with = "string_or_json_text")]
    pub arguments: String,
}

/// A tool the model may call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// The tool type; always `"function"` today.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The function's signature.
    pub function: FunctionDefinition,
}

impl ToolDefinition {
    /// The tool as the JSON object templates render: `{type, function: {name,
    /// description?, parameters?}}`.
    pub(crate) fn to_json(&self) -> serde_json::Value {
        let mut function = serde_json::Map::new();
        function.insert("name".into(), self.function.name.as_str().into());
        if let Some(description) = &self.function.description {
            function.insert("description".into(), description.as_str().into());
        }
        if let Some(parameters) = &self.function.parameters {
            function.insert("parameters".into(), parameters.clone());
        }
        serde_json::json!({"type": self.kind, "function": function})
    }
}

/// The signature of a callable function.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionDefinition {
    /// The function's name.
    pub name: String,
    /// What the function does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Its content; absent for an assistant message that only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// An optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tool calls of an assistant message. `null` is accepted as none.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_empty"
    )]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and text `content` and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message with text only.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// A tool result answering the call with id `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    /// The text of the content, empty when there is none.
    pub fn text(&self) -> String {
        self.content
            .as_ref()
            .map(MessageContent::text)
            .unwrap_or_default()
    }
}

fn function_kind() -> String {
    "function".to_owned()
}

fn null_as_empty<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default())
}

fn string_or_json_text<'de, D>(deserializer: D) -> Result<String, D::Error>
where
    D: Deserializer<'de>,
{
    Ok(match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(s) => s,
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn deserializes_an_openai_request_messages_array() {
        let request = json!([
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is the weather"},
                {"type": "text", "text": "in Paris?"}
            ], "name": "ann"},
            {"role": "assistant", "content": null, "refusal": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_2", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:00"}]},
            {"role": "assistant", "content": "18°C at 14:00.", "tool_calls": null}
        ]);
        let messages: Vec<ChatMessage> = serde_json::from_value(request).unwrap();
        assert_eq!(messages.len(), 6);
        assert_eq!(messages[0], ChatMessage::system("Be brief."));
        assert_eq!(messages[1].role, Role::User);
        assert_eq!(messages[1].text(), "What is the weather\nin Paris?");
        assert_eq!(messages[1].name.as_deref(), Some("ann"));
        assert_eq!(messages[2].content, None);
        assert_eq!(
            messages[2].tool_calls,
            vec![
                ToolCall {
                    id: "call_1".into(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "get_weather".into(),
                        arguments: r#"{"city": "Paris"}"#.into()
                    }
                },
                ToolCall {
                    id: "call_2".into(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "get_time".into(),
                        arguments: r#"{"tz":"CET"}"#.into()
                    }
                }
            ]
        );
        assert_eq!(messages[3], ChatMessage::tool("call_1", "18°C"));
        assert_eq!(messages[4].text(), "14:00");
        assert!(messages[5].tool_calls.is_empty());
    }

    #[test]
    fn rejects_non_text_parts_and_unknown_roles() {
        let image = json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}
        ]});
        assert!(serde_json::from_value::<ChatMessage>(image).is_err());
        let odd = json!({"role": "narrator", "content": "x"});
        assert!(serde_json::from_value::<ChatMessage>(odd).is_err());
    }

    #[test]
    fn serializes_back_to_the_openai_shape() {
        let message = ChatMessage::tool("call_1", "ok");
        assert_eq!(
            serde_json::to_value(&message).unwrap(),
            json!({"role": "tool", "content": "ok", "tool_call_id": "call_1"})
        );
        let tools: Vec<ToolDefinition> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ]))
        .unwrap();
        assert_eq!(tools[0].function.description, None);
        assert_eq!(
            serde_json::to_value(&tools[0]).unwrap(),
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
        );
    }
}
