//! Structured outputs: the grammar a request's output must follow, compiled by
//! `llguidance` (the constrained-decoding engine vLLM, SGLang and llama.cpp use).
//!
//! [`OutputGrammar`] is what travels from router to worker: OpenAI's `response_format`
//! (`json_object`, `json_schema`) or a Lark grammar (a forced tool call).
//! [`OutputGrammar::check`] compiles it against a byte vocabulary, so a router refuses
//! a grammar llguidance rejects before any work is done. [`GrammarCompiler`] holds one
//! model's token trie (built once per model load) and makes a [`Matcher`] per request.

use crate::tokenizer::Tokenizer;
use crate::tokens::TokenId;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

pub use llguidance::toktrie::SimpleVob;

/// What a constrained request's output must be.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputGrammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this JSON Schema (the schema's JSON text).
    JsonSchema(String),
    /// A Lark grammar in llguidance's dialect (may embed `%json {…}` schemas).
    Lark(String),
}

/// Layout of generated JSON: no free whitespace (a model, above all one with random
/// weights, could otherwise emit blanks until `max_tokens`), separators as models
/// usually write them. A schema's own `x-guidance` wins.
fn json_layout() -> serde_json::Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

impl OutputGrammar {
    /// The llguidance grammar; an error says what is wrong with the schema's JSON.
    pub fn top_level(&self) -> Result<TopLevelGrammar, String> {
        let with_layout = |mut schema: serde_json::Value| {
            if let Some(obj) = schema.as_object_mut() {
                obj.entry("x-guidance").or_insert_with(json_layout);
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        match self {
            OutputGrammar::JsonObject => Ok(with_layout(serde_json::json!({"type": "object"}))),
            OutputGrammar::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| format!("the JSON schema is not valid JSON: {e}"))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err("a JSON schema must be an object or a boolean".into());
                }
                Ok(with_layout(schema))
            }
            OutputGrammar::Lark(text) => Ok(TopLevelGrammar::from_lark(text.clone())),
        }
    }

    /// Compiles the grammar against a byte vocabulary: `Err` carries llguidance's
    /// message for a grammar it rejects (unsupported keyword, unsatisfiable schema,
    /// Lark syntax error). Cheap enough for a router to run on every request.
    pub fn check(&self) -> Result<(), String> {
        static BYTES: OnceLock<Result<ParserFactory, String>> = OnceLock::new();
        let factory = BYTES
            .get_or_init(|| {
                let mut f = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env())
                    .map_err(|e| e.to_string())?;
                f.quiet();
                Ok(f)
            })
            .as_ref()
            .map_err(Clone::clone)?;
        compile(factory, self).map(drop)
    }
}

fn compile(factory: &ParserFactory, grammar: &OutputGrammar) -> Result<Matcher, String> {
    let parser = factory
        .create_parser(grammar.top_level()?)
        .map_err(|e| format!("invalid grammar: {e}"))?;
    let matcher = Matcher::new(Ok(parser));
    match matcher.get_error() {
        Some(e) => Err(format!("invalid grammar: {e}")),
        None => Ok(matcher),
    }
}

/// One model's token trie and grammar factory: built once per model load, shared by
/// every constrained request on it.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    eos: TokenId,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .field("eos", &self.eos)
            .finish()
    }
}

impl GrammarCompiler {
    /// The trie of `tokenizer`'s vocabulary, padded to `vocab_size` ids (a model's
    /// logit rows may be longer than its tokenizer's vocabulary; padding is never
    /// allowed). Generation ends with the tokenizer's primary end-of-sequence id.
    pub fn new(tokenizer: &dyn Tokenizer, vocab_size: usize) -> Result<Self, String> {
        let mut words = tokenizer
            .token_bytes()
            .ok_or("this model's tokenizer does not expose its token bytes")?;
        if words.len() < vocab_size {
            words.resize(vocab_size, Vec::new());
        }
        let eos = *tokenizer
            .eos_token_ids()
            .first()
            .ok_or("this model's tokenizer has no end-of-sequence token")?;
        let n = u32::try_from(words.len()).map_err(|_| "vocabulary too large")?;
        if eos >= n {
            return Err(format!(
                "end-of-sequence id {eos} is outside the vocabulary"
            ));
        }
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            eos,
        })
    }

    /// A fresh matcher for one request; `Err` is llguidance's message.
    pub fn matcher(&self, grammar: &OutputGrammar) -> Result<Matcher, String> {
        compile(&self.factory, grammar)
    }

    /// The id that ends a constrained generation (allowed once the grammar accepts).
    pub fn eos(&self) -> TokenId {
        self.eos
    }
}

/// Token bytes from a Hugging Face `tokenizer.json` value (byte-level or byte-fallback
/// vocabularies), special tokens marked with a leading 0xFF. `None` when llguidance
/// cannot read the vocabulary.
pub(crate) fn token_bytes_from_tokenizer_json(json: &serde_json::Value) -> Option<Vec<Vec<u8>>> {
    // llguidance asserts on some malformed vocabularies; a panic here must not take the
    // model load down, only structured outputs.
    std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(json).ok())
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{ByteTokenizer, BYTE_IM_END_ID, BYTE_VOCAB_SIZE};

    fn schema(v: serde_json::Value) -> OutputGrammar {
        OutputGrammar::JsonSchema(v.to_string())
    }

    #[test]
    fn good_grammars_compile_and_bad_ones_say_why() {
        OutputGrammar::JsonObject.check().unwrap();
        schema(serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}}))
            .check()
            .unwrap();
        OutputGrammar::Lark("start: \"yes\" | \"no\"".into())
            .check()
            .unwrap();
        let e = schema(serde_json::json!({"type": "strnig"}))
            .check()
            .unwrap_err();
        assert!(e.contains("strnig"), "{e}");
        let e = OutputGrammar::JsonSchema("{not json".into())
            .check()
            .unwrap_err();
        assert!(e.contains("not valid JSON"), "{e}");
        let e = OutputGrammar::Lark("start: (".into()).check().unwrap_err();
        assert!(e.starts_with("invalid grammar"), "{e}");
    }

    #[test]
    fn byte_vocabulary_matcher_walks_a_schema_to_eos() {
        let tok = ByteTokenizer::new();
        let c = GrammarCompiler::new(&tok, BYTE_VOCAB_SIZE).unwrap();
        assert_eq!(c.eos(), BYTE_IM_END_ID);
        let mut m = c
            .matcher(&schema(serde_json::json!({"enum": ["ok"]})))
            .unwrap();
        for b in b"\"ok\"" {
            let mask = m.compute_mask().unwrap();
            assert!(mask.is_allowed(u32::from(*b)));
            assert_eq!(mask.num_set(), 1, "only one byte can follow");
            m.consume_token(u32::from(*b)).unwrap();
        }
        // Nothing can follow: the matcher stops, and would allow only end-of-sequence.
        assert!(m.is_stopped());
        let mask = m.compute_mask_or_eos().unwrap();
        assert!(mask.is_allowed(BYTE_IM_END_ID));
        assert_eq!(mask.num_set(), 1);
    }
}
