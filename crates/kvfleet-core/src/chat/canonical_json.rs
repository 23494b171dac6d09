//! Canonical JSON text for everything a chat prompt embeds as JSON (tool signatures,
//! tool-call arguments, and the `tojson` filter of Jinja templates).
//!
//! Decision: object keys are sorted recursively. serde_json keeps the client's key
//! order here (`preserve_order`), and two clients that send the same tool with keys in
//! a different order would otherwise render different bytes, tokenize differently and
//! miss each other's cached prefix. Sorting makes the rendered prompt depend only on
//! the JSON *value*.
//!
//! The layout is Python's `json.dumps(sort_keys=True, ensure_ascii=False)`: `", "` and
//! `": "` separators, non-ASCII characters written as-is. That is what Hugging Face
//! chat templates produce and what models saw in training.

use serde_json::Value;

/// Output layout, mirroring the arguments of Python's `json.dumps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JsonLayout {
    /// Spaces per nesting level; `None` writes everything on one line.
    pub indent: Option<usize>,
    /// Between items of arrays and objects.
    pub item_separator: String,
    /// Between a key and its value.
    pub key_separator: String,
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
}

impl Default for JsonLayout {
    fn default() -> Self {
        Self {
            indent: None,
            item_separator: ", ".to_owned(),
            key_separator: ": ".to_owned(),
            ensure_ascii: false,
        }
    }
}

impl JsonLayout {
    /// Python's defaults for a given `indent`: with an indent, items end lines, so the
    /// item separator loses its trailing space.
    pub(crate) fn with_indent(indent: Option<usize>) -> Self {
        Self {
            indent,
            item_separator: if indent.is_some() { "," } else { ", " }.to_owned(),
            ..Self::default()
        }
    }
}

/// `value` as canonical JSON text: keys sorted recursively, `", "` and `": "`
/// separators, one line.
pub fn to_canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical_json(&mut out, value);
    out
}

/// Appends the canonical JSON text of `value` (see [`to_canonical_json`]) to `out`.
pub fn write_canonical_json(out: &mut String, value: &Value) {
    write_value(out, value, &JsonLayout::default(), 0);
}

/// Appends `value` to `out` in `layout`, keys sorted recursively.
pub(crate) fn write_with_layout(out: &mut String, value: &Value, layout: &JsonLayout) {
    write_value(out, value, layout, 0);
}

fn write_value(out: &mut String, value: &Value, layout: &JsonLayout, depth: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(out, s, layout.ensure_ascii),
        Value::Array(items) => {
            write_container(out, layout, depth, ('[', ']'), items, |out, item| {
                write_value(out, item, layout, depth + 1);
            });
        }
        Value::Object(map) => {
            // Rust orders strings by UTF-8 bytes, which is code-point order, the same
            // order as Python's `sort_keys`.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            write_container(out, layout, depth, ('{', '}'), &entries, |out, (k, v)| {
                write_string(out, k, layout.ensure_ascii);
                out.push_str(&layout.key_separator);
                write_value(out, v, layout, depth + 1);
            });
        }
    }
}

fn write_container<T>(
    out: &mut String,
    layout: &JsonLayout,
    depth: usize,
    (open, close): (char, char),
    items: &[T],
    mut write_item: impl FnMut(&mut String, &T),
) {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&layout.item_separator);
        }
        newline(out, layout, depth + 1);
        write_item(out, item);
    }
    newline(out, layout, depth);
    out.push(close);
}

fn newline(out: &mut String, layout: &JsonLayout, depth: usize) {
    if let Some(indent) = layout.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', indent * depth));
    }
}

/// A JSON string literal with Python's escapes: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`,
/// `\f`, other control characters as `\u00xx`; with `ensure_ascii`, everything outside
/// printable ASCII as `\uXXXX` (UTF-16 surrogate pairs above U+FFFF).
fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if c < ' ' || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sorts_keys_recursively_with_python_separators() {
        let value: Value = serde_json::from_str(
            r#"{"b": [1, {"z": null, "a": true}], "a": {"y": "é", "x": 1.5}, "c": {}, "d": []}"#,
        )
        .unwrap();
        assert_eq!(
            to_canonical_json(&value),
            r#"{"a": {"x": 1.5, "y": "é"}, "b": [1, {"a": true, "z": null}], "c": {}, "d": []}"#
        );
    }

    #[test]
    fn key_order_of_the_input_does_not_matter() {
        let a: Value = serde_json::from_str(r#"{"x": 1, "y": {"p": 1, "q": 2}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"y": {"q": 2, "p": 1}, "x": 1}"#).unwrap();
        assert_eq!(to_canonical_json(&a), to_canonical_json(&b));
    }

    #[test]
    fn escapes_like_python() {
        let value = json!("q\"b\\n\n\t\u{1}\u{7f}<&>é🦀");
        assert_eq!(
            to_canonical_json(&value),
            "\"q\\\"b\\\\n\\n\\t\\u0001\u{7f}<&>é🦀\""
        );
        let mut out = String::new();
        let layout = JsonLayout {
            ensure_ascii: true,
            ..JsonLayout::default()
        };
        write_with_layout(&mut out, &value, &layout);
        assert_eq!(
            out,
            "\"q\\\"b\\\\n\\n\\t\\u0001\\u007f<&>\\u00e9\\ud83e\\udd80\""
        );
    }

    #[test]
    fn indents_like_python() {
        let value = json!({"b": [1, 2], "a": {}});
        let mut out = String::new();
        write_with_layout(&mut out, &value, &JsonLayout::with_indent(Some(2)));
        assert_eq!(out, "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2\n  ]\n}");
    }
}
