//! Hugging Face chat templates (Jinja), rendered with minijinja the way
//! `transformers.apply_chat_template` renders them.
//!
//! Differences from Python that matter for caching are deliberate: `tojson` always
//! sorts keys (see `canonical_json`), and no `strftime_now` is provided, so templates
//! that would insert today's date fall back to their fixed default date. The same
//! messages therefore always render the same bytes.

use super::canonical_json::{write_with_layout, JsonLayout};
use super::messages::{ChatMessage, ToolCall, ToolDefinition};
use super::ChatError;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{json, Map, Value as Json};
use std::sync::Arc;

const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";

/// A compiled Jinja chat template, with the special-token strings it may reference.
/// Cloning is cheap: the compiled templates are shared.
#[derive(Clone, Debug)]
pub struct JinjaTemplate {
    env: Arc<Environment<'static>>,
    has_tool_use: bool,
    bos_token: String,
    eos_token: String,
}

impl JinjaTemplate {
    /// Compiles `source`. `bos_token` and `eos_token` are the strings the template sees
    /// as `bos_token` and `eos_token` (empty when the model has none).
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        // transformers compiles chat templates with these two options; without them
        // block tags leave stray newlines and indentation in the prompt.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(DEFAULT_NAME, source.into())
            .map_err(ChatError::TemplateSyntax)?;
        Ok(Self {
            env: Arc::new(env),
            has_tool_use: false,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
        })
    }

    /// Adds the template used instead of the default one when tools are given (the
    /// `tool_use` entry of a list-form `chat_template`).
    pub fn with_tool_use_template(mut self, source: impl Into<String>) -> Result<Self, ChatError> {
        Arc::make_mut(&mut self.env)
            .add_template_owned(TOOL_USE_NAME, source.into())
            .map_err(ChatError::TemplateSyntax)?;
        self.has_tool_use = true;
        Ok(self)
    }

    /// Renders `messages` with the template. The context holds `messages`, `tools`
    /// (`none` when there are none, as transformers passes them), `add_generation_prompt`,
    /// `bos_token` and `eos_token`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::EmptyMessages);
        }
        let name = if self.has_tool_use && !tools.is_empty() {
            TOOL_USE_NAME
        } else {
            DEFAULT_NAME
        };
        let template = self.env.get_template(name).map_err(ChatError::Render)?;
        let messages: Vec<Json> = messages.iter().map(message_value).collect();
        // Templates test `tools is not none`, so "no tools" must be none, not `[]`.
        let tools = if tools.is_empty() {
            Value::from(())
        } else {
            Value::from_serialize(
                tools
                    .iter()
                    .map(ToolDefinition::to_json)
                    .collect::<Vec<_>>(),
            )
        };
        let ctx = minijinja::context! {
            messages => Value::from_serialize(&messages),
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        template.render(ctx).map_err(ChatError::Render)
    }
}

/// A message as templates expect it: `content` always a string (parts joined, none
/// as empty), and tool-call `arguments` as a JSON value when they parse, because
/// templates write them with `arguments | tojson` or iterate over them.
fn message_value(message: &ChatMessage) -> Json {
    let mut obj = Map::new();
    obj.insert("role".into(), message.role.as_str().into());
    obj.insert("content".into(), message.text().into());
    if let Some(name) = &message.name {
        obj.insert("name".into(), name.as_str().into());
    }
    if !message.tool_calls.is_empty() {
        let calls = message.tool_calls.iter().map(tool_call_value).collect();
        obj.insert("tool_calls".into(), Json::Array(calls));
    }
    if let Some(id) = &message.tool_call_id {
        obj.insert("tool_call_id".into(), id.as_str().into());
    }
    Json::Object(obj)
}

fn tool_call_value(call: &ToolCall) -> Json {
    let arguments = serde_json::from_str::<Json>(&call.function.arguments)
        .unwrap_or_else(|_| Json::String(call.function.arguments.clone()));
    json!({
        "id": call.id,
        "type": call.kind,
        "function": {"name": call.function.name, "arguments": arguments},
    })
}

/// `raise_exception(message)`: templates call it to reject a conversation they cannot
/// render (for example roles that do not alternate).
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson(ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, except that keys are always sorted, for determinism. Unlike
/// minijinja's built-in filter it does not HTML-escape `<`, `>`, `&` or `'`, which
/// would change the prompt the model was trained on.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    // Accepted for compatibility; output is sorted either way.
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let mut layout = JsonLayout::with_indent(indent);
    layout.ensure_ascii = ensure_ascii.unwrap_or(false);
    if let Some(separators) = separators {
        let [item, key] = <[String; 2]>::try_from(separators).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be (item_separator, key_separator)",
            )
        })?;
        layout.item_separator = item;
        layout.key_separator = key;
    }
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let mut out = String::new();
    write_with_layout(&mut out, &json, &layout);
    Ok(Value::from_safe_string(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::Role;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String, ChatError> {
        JinjaTemplate::new(source, Some("<s>".into()), Some("</s>".into()))?.render(
            messages,
            &[],
            true,
        )
    }

    #[test]
    fn renders_a_llama3_style_template() {
        let source = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
        let template = JinjaTemplate::new(source, Some("<|begin_of_text|>".into()), None).unwrap();
        let messages = [ChatMessage::system("Be brief. "), ChatMessage::user(" Hi")];
        assert_eq!(
            template.render(&messages, &[], true).unwrap(),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn trims_blocks_like_transformers() {
        let source = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n  {% endif %}\n{% endfor %}";
        let out = render(source, &[ChatMessage::user("a"), ChatMessage::user("b")]).unwrap();
        assert_eq!(out, "[a]\n[b]\n");
    }

    #[test]
    fn python_string_and_dict_methods_work() {
        let source = "{% for m in messages %}{{ m.content.strip().upper() }}{% if m.content.startswith(' x') %}!{% endif %}{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}{{ v }}{% endfor %}{% endfor %}";
        assert_eq!(
            render(source, &[ChatMessage::user(" xy ")]).unwrap(),
            "XY!a2b1"
        );
    }

    #[test]
    fn raise_exception_becomes_a_render_error() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user message') }}{% endif %}ok";
        assert_eq!(render(source, &[ChatMessage::user("x")]).unwrap(), "ok");
        let err = render(source, &[ChatMessage::assistant("x")]).unwrap_err();
        assert!(matches!(err, ChatError::Render(_)), "{err:?}");
        assert!(
            err.to_string().contains("must start with a user message"),
            "{err}"
        );
    }

    #[test]
    fn syntax_errors_are_reported_at_construction() {
        let err = JinjaTemplate::new("{% for m in messages %}", None, None).unwrap_err();
        assert!(matches!(err, ChatError::TemplateSyntax(_)), "{err:?}");
    }

    #[test]
    fn tojson_is_sorted_python_style_and_unescaped() {
        let tool: ToolDefinition = serde_json::from_str(
            r#"{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}}}"#,
        )
        .unwrap();
        let template = JinjaTemplate::new(
            "{{ tools[0] | tojson }}|{{ {'x': '<&>', 'a': [1, 2]} | tojson(indent=1) }}|{{ 'é' | tojson(ensure_ascii=true) }}|{{ {'k': 1, 'j': 2} | tojson(separators=(',', ':')) }}",
            None,
            None,
        )
        .unwrap();
        let out = template
            .render(&[ChatMessage::user("x")], &[tool], false)
            .unwrap();
        assert_eq!(
            out,
            r#"{"function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "type": "object"}}, "type": "function"}|{
 "a": [
  1,
  2
 ],
 "x": "<&>"
}|"\u00e9"|{"j":2,"k":1}"#
        );
    }

    #[test]
    fn tools_are_none_when_absent_and_arguments_are_objects() {
        let source = "{{ tools is none }}|{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments.city }}){{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
        let mut message = ChatMessage::new(Role::Assistant, "");
        message.tool_calls = vec![ToolCall {
            id: "1".into(),
            kind: "function".into(),
            function: crate::chat::FunctionCall {
                name: "weather".into(),
                arguments: r#"{"unit": "C", "city": "Paris"}"#.into(),
            },
        }];
        assert_eq!(
            render(source, &[message]).unwrap(),
            r#"True|weather(Paris){"city": "Paris", "unit": "C"}"#
        );
    }

    #[test]
    fn the_tool_use_template_is_chosen_only_with_tools() {
        let template = JinjaTemplate::new("plain", None, None)
            .unwrap()
            .with_tool_use_template("tools:{{ tools | length }}")
            .unwrap();
        let tool: ToolDefinition =
            serde_json::from_str(r#"{"type": "function", "function": {"name": "f"}}"#).unwrap();
        let messages = [ChatMessage::user("x")];
        assert_eq!(template.render(&messages, &[], false).unwrap(), "plain");
        assert_eq!(
            template.render(&messages, &[tool], false).unwrap(),
            "tools:1"
        );
    }
}
