//! The tokenizer and chat template of a GGUF file, from its `tokenizer.*` metadata.
//!
//! This module only reads the values out of candle's parsed header; building the
//! tokenizer is `kvfleet_core::tokenizer::GgufVocab`'s job, so the core crate stays free
//! of candle.

use crate::error::{EngineError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use kvfleet_core::chat::ChatTemplate;
use kvfleet_core::tokenizer::{GgufVocab, HfTokenizer};
use kvfleet_core::TokenId;
use std::path::Path;

/// The tokenizer and chat template described by `content`, the parsed header of the
/// GGUF file at `path` (named in errors). An unsupported `tokenizer.ggml.model` or
/// `tokenizer.ggml.pre`, missing or mistyped keys and inconsistent ids are errors that
/// name the file and the key.
pub fn tokenizer_from_gguf(content: &Content, path: &Path) -> Result<(HfTokenizer, ChatTemplate)> {
    let vocab = vocab_from_gguf(content, path)?;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        EngineError::Config(format!("{}: {what}: {e}", path.display()))
    };
    let tokenizer = vocab.tokenizer().map_err(|e| fail("tokenizer", &e))?;
    let template = vocab
        .chat_template()
        .map_err(|e| fail("tokenizer.chat_template", &e))?;
    Ok((tokenizer, template))
}

/// The `tokenizer.*` metadata of `content` as a [`GgufVocab`].
pub fn vocab_from_gguf(content: &Content, path: &Path) -> Result<GgufVocab> {
    let meta = Metadata { content, path };
    let model = meta
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| meta.error("tokenizer.ggml.model", "missing: the file has no tokenizer"))?;
    Ok(GgufVocab {
        model,
        pre: meta.string("tokenizer.ggml.pre")?,
        tokens: meta.strings("tokenizer.ggml.tokens")?.unwrap_or_default(),
        token_types: meta.ints("tokenizer.ggml.token_type")?.unwrap_or_default(),
        scores: meta.floats("tokenizer.ggml.scores")?.unwrap_or_default(),
        merges: meta.strings("tokenizer.ggml.merges")?.unwrap_or_default(),
        bos_id: meta.token_id("tokenizer.ggml.bos_token_id")?,
        eos_id: meta.token_id("tokenizer.ggml.eos_token_id")?,
        eot_id: meta.token_id("tokenizer.ggml.eot_token_id")?,
        eom_id: meta.token_id("tokenizer.ggml.eom_token_id")?,
        unk_id: meta.token_id("tokenizer.ggml.unknown_token_id")?,
        pad_id: meta.token_id("tokenizer.ggml.padding_token_id")?,
        add_bos: meta.bool("tokenizer.ggml.add_bos_token")?,
        add_eos: meta.bool("tokenizer.ggml.add_eos_token")?,
        add_space_prefix: meta.bool("tokenizer.ggml.add_space_prefix")?,
        chat_template: meta.string("tokenizer.chat_template")?,
        chat_template_tool_use: meta.string("tokenizer.chat_template.tool_use")?,
    })
}

/// Typed access to a file's metadata; every error names the file and the key.
struct Metadata<'a> {
    content: &'a Content,
    path: &'a Path,
}

impl Metadata<'_> {
    fn error(&self, key: &str, problem: impl std::fmt::Display) -> EngineError {
        EngineError::Config(format!(
            "{}: metadata {key}: {problem}",
            self.path.display()
        ))
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => {
                Err(self.error(key, format!("expected a string, found {}", short(other))))
            }
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(self.error(key, format!("expected a bool, found {}", short(other)))),
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<TokenId>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => integer(v)
                .and_then(|i| TokenId::try_from(i).ok())
                .map(Some)
                .ok_or_else(|| self.error(key, format!("expected a token id, found {}", short(v)))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&Vec<Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(other) => {
                Err(self.error(key, format!("expected an array, found {}", short(other))))
            }
        }
    }

    /// An array whose every item `convert` accepts; the first bad item is named.
    fn array_of<T>(
        &self,
        key: &str,
        kind: &str,
        convert: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                convert(v).ok_or_else(|| {
                    self.error(key, format!("item {i} is not {kind}: {:?}", short(v)))
                })
            })
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.array_of(key, "a string", |v| match v {
            Value::String(s) => Some(s.clone()),
            _ => None,
        })
    }

    fn ints(&self, key: &str) -> Result<Option<Vec<i32>>> {
        self.array_of(key, "an i32", |v| {
            integer(v).and_then(|i| i32::try_from(i).ok())
        })
    }

    fn floats(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.array_of(key, "a number", |v| match v {
            Value::F32(f) => Some(*f),
            Value::F64(f) => Some(*f as f32),
            _ => None,
        })
    }
}

/// Any integer-typed value (writers differ in the width they use for ids).
fn integer(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

/// A value for an error message, without dumping a whole nested array.
fn short(v: &Value) -> String {
    match v {
        Value::Array(items) => format!("an array of {} items", items.len()),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::VersionedMagic;
    use kvfleet_core::Tokenizer;
    use std::collections::HashMap;

    fn content(metadata: Vec<(&str, Value)>) -> Content {
        Content {
            magic: VersionedMagic::GgufV3,
            metadata: metadata
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
            tensor_infos: HashMap::new(),
            tensor_data_offset: 0,
        }
    }

    fn strings(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|s| Value::String((*s).into())).collect())
    }

    fn small_vocab() -> Vec<(&'static str, Value)> {
        vec![
            ("tokenizer.ggml.model", Value::String("gpt2".into())),
            ("tokenizer.ggml.pre", Value::String("smollm".into())),
            (
                "tokenizer.ggml.tokens",
                strings(&["<|im_end|>", "h", "i", "hi"]),
            ),
            (
                "tokenizer.ggml.token_type",
                Value::Array(vec![
                    Value::I32(3),
                    Value::I32(1),
                    Value::I32(1),
                    Value::I32(1),
                ]),
            ),
            ("tokenizer.ggml.merges", strings(&["h i"])),
            ("tokenizer.ggml.eos_token_id", Value::U32(0)),
            ("tokenizer.ggml.bos_token_id", Value::U64(0)),
            ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
            (
                "tokenizer.chat_template",
                Value::String("{{ bos_token }}{{ messages[0].content }}<|im_end|>".into()),
            ),
        ]
    }

    #[test]
    fn reads_the_tokenizer_and_template() {
        let (t, template) =
            tokenizer_from_gguf(&content(small_vocab()), Path::new("m.gguf")).unwrap();
        assert_eq!(t.encode("hi<|im_end|>").unwrap(), vec![3, 0]);
        assert_eq!(t.eos_token_ids(), vec![0]);
        assert_eq!(t.bos_token_id_to_add(), Some(0));
        let text = template
            .render(&[kvfleet_core::ChatMessage::user("hi")], &[], false)
            .unwrap();
        assert_eq!(text, "<|im_end|>hi<|im_end|>");
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let mut meta = small_vocab();
        meta.retain(|(k, _)| *k != "tokenizer.ggml.model");
        let err = tokenizer_from_gguf(&content(meta), Path::new("/m/x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/m/x.gguf") && err.contains("tokenizer.ggml.model"),
            "{err}"
        );

        let mut meta = small_vocab();
        meta[1].1 = Value::String("exotic".into());
        let err = tokenizer_from_gguf(&content(meta), Path::new("/m/x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/m/x.gguf") && err.contains("\"exotic\""),
            "{err}"
        );

        let mut meta = small_vocab();
        meta[2].1 = Value::Array(vec![Value::String("a".into()), Value::U8(1)]);
        let err = tokenizer_from_gguf(&content(meta), Path::new("/m/x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tokenizer.ggml.tokens: item 1"), "{err}");

        let mut meta = small_vocab();
        meta[5].1 = Value::I32(-1);
        let err = tokenizer_from_gguf(&content(meta), Path::new("/m/x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tokenizer.ggml.eos_token_id"), "{err}");
    }
}
