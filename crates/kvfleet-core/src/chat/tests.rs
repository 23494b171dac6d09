//! Tests of rendering through [`ChatTemplate`]: exact ChatML bytes, determinism, the
//! append-only property, agreement with Qwen2.5's own Jinja template, and loading
//! templates from `tokenizer_config.json`.

use super::*;
use crate::tokenizer::{ByteTokenizer, Tokenizer};
use proptest::prelude::*;
use serde_json::json;

const TOOLS_PREAMBLE: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n";
const TOOLS_POSTAMBLE: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

/// Qwen2.5's chat template with its default system prompt removed (the built-in
/// renderer invents none), otherwise verbatim.
const QWEN25_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

fn weather_tool() -> ToolDefinition {
    serde_json::from_str(
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Get weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#,
    )
    .unwrap()
}

const WEATHER_TOOL_JSON: &str = r#"{"function": {"description": "Get weather", "name": "get_weather", "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, "type": "function"}"#;

fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        kind: "function".into(),
        function: FunctionCall {
            name: name.into(),
            arguments: arguments.into(),
        },
    }
}

fn calling(content: Option<&str>, calls: Vec<ToolCall>) -> ChatMessage {
    ChatMessage {
        content: content.map(|c| MessageContent::Text(c.into())),
        tool_calls: calls,
        ..ChatMessage::assistant("")
    }
}

fn tool_conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("S"),
        ChatMessage::user("Weather in Paris and Rome?"),
        calling(
            None,
            vec![
                call("call_1", "get_weather", r#"{"city": "Paris"}"#),
                call("call_2", "get_weather", r#"{"city":"Rome"}"#),
            ],
        ),
        ChatMessage::tool("call_1", "18"),
        ChatMessage::tool("call_2", "21"),
        ChatMessage::assistant("Paris 18, Rome 21."),
        ChatMessage::user("Thanks"),
    ]
}

fn chatml(messages: &[ChatMessage], tools: &[ToolDefinition], generation: bool) -> String {
    ChatTemplate::ChatMl
        .render(messages, tools, generation)
        .unwrap()
}

#[test]
fn chatml_system_and_user_with_generation_prompt() {
    let messages = [
        ChatMessage::system("You are helpful."),
        ChatMessage::user("Hi"),
    ];
    assert_eq!(
        chatml(&messages, &[], true),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        chatml(&messages[1..], &[], false),
        "<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn chatml_tools_calls_and_grouped_results() {
    let expected = [
        "<|im_start|>system\nS\n\n",
        TOOLS_PREAMBLE,
        WEATHER_TOOL_JSON,
        TOOLS_POSTAMBLE,
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n18\n</tool_response>\n<tool_response>\n21\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\nParis 18, Rome 21.<|im_end|>\n",
        "<|im_start|>user\nThanks<|im_end|>\n",
        "<|im_start|>assistant\n",
    ]
    .concat();
    assert_eq!(
        chatml(&tool_conversation(), &[weather_tool()], true),
        expected
    );
}

#[test]
fn chatml_tools_without_a_system_message_get_their_own_block() {
    let messages = [
        ChatMessage::user("Hi"),
        calling(
            Some("Let me check."),
            vec![call("c", "get_weather", "not json")],
        ),
    ];
    let expected = [
        "<|im_start|>system\n",
        TOOLS_PREAMBLE,
        WEATHER_TOOL_JSON,
        TOOLS_POSTAMBLE,
        "<|im_start|>user\nHi<|im_end|>\n",
        // Content first; arguments that are not JSON are kept verbatim.
        "<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": not json}\n</tool_call><|im_end|>\n",
    ]
    .concat();
    assert_eq!(chatml(&messages, &[weather_tool()], false), expected);
}

#[test]
fn chatml_renders_parts_developer_role_and_a_leading_tool_result() {
    let messages: Vec<ChatMessage> = serde_json::from_value(json!([
        {"role": "tool", "tool_call_id": "x", "content": "r"},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user"}
    ]))
    .unwrap();
    assert_eq!(
        chatml(&messages, &[], false),
        "<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>system\na\nb<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    );
}

#[test]
fn empty_conversations_are_rejected() {
    assert!(matches!(
        ChatTemplate::ChatMl.render(&[], &[weather_tool()], true),
        Err(ChatError::EmptyMessages)
    ));
    let jinja = ChatTemplate::Jinja(JinjaTemplate::new("x", None, None).unwrap());
    assert!(matches!(
        jinja.render(&[], &[], true),
        Err(ChatError::EmptyMessages)
    ));
}

#[test]
fn key_order_of_tools_and_arguments_does_not_change_the_prompt() {
    let permuted: ToolDefinition = serde_json::from_str(
        r#"{"function": {"parameters": {"required": ["city"], "properties": {"city": {"type": "string"}}, "type": "object"},
            "description": "Get weather", "name": "get_weather"}, "type": "function"}"#,
    )
    .unwrap();
    assert_ne!(
        serde_json::to_string(&permuted.function.parameters).unwrap(),
        serde_json::to_string(&weather_tool().function.parameters).unwrap(),
        "the inputs really differ in key order"
    );
    let mut messages = tool_conversation();
    let a = chatml(&messages, &[weather_tool()], true);
    messages[2].tool_calls[0].function.arguments = r#"{ "city" : "Paris" }"#.into();
    let b = chatml(&messages, std::slice::from_ref(&permuted), true);
    assert_eq!(a, b);

    let qwen = ChatTemplate::Jinja(JinjaTemplate::new(QWEN25_TEMPLATE, None, None).unwrap());
    assert_eq!(
        qwen.render(&messages, &[weather_tool()], true).unwrap(),
        qwen.render(&messages, &[permuted], true).unwrap()
    );
}

#[test]
fn rendering_is_a_pure_function() {
    let qwen = ChatTemplate::Jinja(JinjaTemplate::new(QWEN25_TEMPLATE, None, None).unwrap());
    for template in [ChatTemplate::ChatMl, qwen] {
        let messages = tool_conversation();
        let first = template.render(&messages, &[weather_tool()], true).unwrap();
        let second = template
            .clone()
            .render(&messages.clone(), &[weather_tool()], true)
            .unwrap();
        assert_eq!(first, second);
    }
}

#[test]
fn qwen25_jinja_template_matches_the_builtin_chatml() {
    let qwen = ChatTemplate::Jinja(JinjaTemplate::new(QWEN25_TEMPLATE, None, None).unwrap());
    let messages = tool_conversation();
    for tools in [vec![], vec![weather_tool()]] {
        for generation in [false, true] {
            for n in 1..=messages.len() {
                assert_eq!(
                    qwen.render(&messages[..n], &tools, generation).unwrap(),
                    chatml(&messages[..n], &tools, generation),
                    "n={n} tools={} generation={generation}",
                    tools.len()
                );
            }
        }
    }
}

#[test]
fn cutting_between_two_tool_results_is_the_one_non_append_only_point() {
    let messages = tool_conversation();
    let tools = [weather_tool()];
    let full = chatml(&messages, &tools, false);
    // messages[3] and messages[4] are consecutive tool results sharing one user turn.
    assert!(!full.starts_with(&chatml(&messages[..4], &tools, false)));
    for k in [1, 2, 3, 5, 6] {
        assert!(
            full.starts_with(&chatml(&messages[..k], &tools, false)),
            "k={k}"
        );
    }
}

fn text() -> impl Strategy<Value = String> {
    "[a-zé世 <>|\n{}\"]{0,12}"
}

fn message() -> impl Strategy<Value = ChatMessage> {
    let arguments = prop_oneof![
        Just(r#"{"b": 1, "a": [true, null]}"#.to_owned()),
        Just("{}".to_owned()),
        Just("not json".to_owned()),
        text(),
    ];
    let tool_call = ("[a-z_]{1,8}", arguments).prop_map(|(name, args)| call("id", &name, &args));
    prop_oneof![
        text().prop_map(ChatMessage::system),
        text().prop_map(ChatMessage::user),
        text().prop_map(ChatMessage::assistant),
        (
            proptest::option::of(text()),
            prop::collection::vec(tool_call, 1..3)
        )
            .prop_map(|(content, calls)| calling(content.as_deref(), calls)),
        text().prop_map(|t| ChatMessage::tool("id", t)),
    ]
}

proptest! {
    /// Rendering `messages[..k]` is a byte (and byte-tokenizer id) prefix of rendering
    /// any longer conversation, at every cut that does not split a run of tool results.
    #[test]
    fn chatml_is_append_only(
        messages in prop::collection::vec(message(), 1..9),
        with_tools in any::<bool>(),
    ) {
        let tools = if with_tools { vec![weather_tool()] } else { vec![] };
        let tokenizer = ByteTokenizer::new();
        let n = messages.len();
        let full = chatml(&messages, &tools, false);
        let full_prompt = chatml(&messages, &tools, true);
        let full_ids = tokenizer.encode(&full_prompt).unwrap();
        for k in 1..n {
            if messages[k - 1].role == Role::Tool && messages[k].role == Role::Tool {
                continue;
            }
            let prefix = chatml(&messages[..k], &tools, false);
            prop_assert!(full.starts_with(&prefix), "k={}", k);
            prop_assert!(full_prompt.starts_with(&prefix), "k={}", k);
            let ids = tokenizer.encode(&prefix).unwrap();
            prop_assert_eq!(&full_ids[..ids.len()], &ids[..]);
        }
    }
}

#[test]
fn list_form_chat_template_picks_default_and_tool_use() {
    let config = json!({
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "rag", "template": "rag"},
            {"name": "tool_use", "template": "{{ bos_token }}tools{{ eos_token }}"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
        ]
    });
    let template = ChatTemplate::from_tokenizer_config_json(&config).unwrap();
    let messages = [ChatMessage::user("hi")];
    assert_eq!(template.render(&messages, &[], false).unwrap(), "<s>hi</s>");
    assert_eq!(
        template
            .render(&messages, &[weather_tool()], false)
            .unwrap(),
        "<s>tools</s>"
    );

    let first_only = json!({"chat_template": [{"name": "rag", "template": "rag"}]});
    let template = ChatTemplate::from_tokenizer_config_json(&first_only).unwrap();
    assert_eq!(template.render(&messages, &[], false).unwrap(), "rag");
}

#[test]
fn tokenizer_config_errors() {
    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(&json!({"eos_token": "</s>"})),
        Err(ChatError::MissingTemplate)
    ));
    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(&json!({"chat_template": 3})),
        Err(ChatError::InvalidConfig(_))
    ));
    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(&json!({"chat_template": [{"name": "x"}]})),
        Err(ChatError::InvalidConfig(_))
    ));
    assert!(matches!(
        ChatTemplate::from_tokenizer_config_json(&json!({"chat_template": "{% if %}"})),
        Err(ChatError::TemplateSyntax(_))
    ));
}

#[test]
fn loads_from_files_including_a_separate_jinja_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tokenizer_config.json");
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&config),
        Err(ChatError::Io { .. })
    ));
    std::fs::write(&config, br#"{"bos_token": "<|begin_of_text|>"}"#).unwrap();
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&config),
        Err(ChatError::MissingTemplate)
    ));
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}",
    )
    .unwrap();
    let template = ChatTemplate::from_tokenizer_config(&config).unwrap();
    assert_eq!(
        template
            .render(&[ChatMessage::user("hi")], &[], false)
            .unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    );
    std::fs::write(&config, b"{").unwrap();
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&config),
        Err(ChatError::Json { .. })
    ));
}
