//! Tokenizers: turning rendered prompts into token ids and generated ids back into text.
//!
//! The router tokenizes rendered chat prompts, so every tokenizer must treat special
//! tokens written *as text* (for example `<|im_start|>`) as the single special id they
//! stand for; otherwise the ids would differ from what the model was trained on and
//! prefix hashes would not line up with other clients of the same model.
//!
//! Two implementations share the [`Tokenizer`] trait:
//! - [`ByteTokenizer`]: the byte-level vocabulary of the seeded default model;
//! - [`HfTokenizer`]: a Hugging Face `tokenizer.json`, for real models, or one rebuilt
//!   from a GGUF file's vocabulary ([`GgufVocab`]).
//!
//! [`StreamDecoder`] turns ids produced one at a time into text fragments that never
//! split a UTF-8 character, for streaming responses.

mod byte;
mod gguf_vocab;
mod hf;
mod stream;

pub use byte::{
    ByteTokenizer, BYTE_ENDOFTEXT_ID, BYTE_IM_END_ID, BYTE_IM_START_ID, BYTE_SPECIAL_BASE,
    BYTE_SPECIAL_TOKENS, BYTE_VOCAB_SIZE,
};
pub use gguf_vocab::GgufVocab;
pub use hf::HfTokenizer;
pub use stream::StreamDecoder;

use crate::tokens::TokenId;
use std::path::PathBuf;

/// Why a tokenizer could not be loaded, or could not encode or decode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A tokenizer or tokenizer configuration file is malformed.
    #[error("invalid tokenizer data in {what}: {source}")]
    Load {
        /// What was being loaded (a path, or "bytes").
        what: String,
        /// The parser's error.
        #[source]
        source: tokenizers::Error,
    },
    /// A JSON configuration file next to the tokenizer is malformed.
    #[error("invalid JSON in {path}: {source}")]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The Hugging Face tokenizer failed to encode text.
    #[error("encoding failed: {0}")]
    Encode(#[source] tokenizers::Error),
    /// The Hugging Face tokenizer failed to decode ids.
    #[error("decoding failed: {0}")]
    Decode(#[source] tokenizers::Error),
    /// A vocabulary given as values (a GGUF file's metadata) is inconsistent or of a
    /// kind not supported.
    #[error("{0}")]
    InvalidVocab(String),
    /// An id outside the vocabulary was given to decode.
    #[error("token id {id} is outside the vocabulary of size {vocab_size}")]
    UnknownId {
        /// The offending id.
        id: TokenId,
        /// The vocabulary size it exceeds.
        vocab_size: usize,
    },
}

/// A tokenizer as the router and engine use it.
///
/// Implementations are shared between request handlers, hence `Send + Sync`.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`. Special tokens written in the text are encoded as their
    /// single id, and nothing is added (no BOS): chat templates render BOS themselves
    /// when a model needs it.
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, TokenizerError>;

    /// Text of `ids`, special tokens included as their text. Byte sequences that are
    /// not valid UTF-8 decode as U+FFFD.
    fn decode(&self, ids: &[TokenId]) -> Result<String, TokenizerError>;

    /// Number of ids the tokenizer can produce, special tokens included.
    fn vocab_size(&self) -> usize;

    /// The id of a token given by its exact text, if the vocabulary has one.
    fn token_id(&self, token: &str) -> Option<TokenId>;

    /// Ids that end generation; the first is the model's primary end-of-sequence id.
    fn eos_token_ids(&self) -> Vec<TokenId>;

    /// The BOS id to put before a raw-text prompt (`/v1/completions`) when the model's
    /// tokenizer asks for one (`add_bos_token`). Chat prompts get BOS from their
    /// template instead, so [`Tokenizer::encode`] never adds it.
    fn bos_token_id_to_add(&self) -> Option<TokenId> {
        None
    }

    /// The ids of a raw-text prompt (`/v1/completions`, `kvfleet generate`): its tokens,
    /// after the BOS the tokenizer asks for, as transformers and llama.cpp tokenize a
    /// completion prompt. A prompt that already starts with BOS (written as text) keeps
    /// just that one.
    fn encode_text_prompt(&self, text: &str) -> Result<Vec<TokenId>, TokenizerError> {
        let mut ids = self.encode(text)?;
        if let Some(bos) = self.bos_token_id_to_add() {
            if !ids.is_empty() && ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Whether `id` is a special (control) token such as `<|im_start|>`: generated
    /// text leaves these out, as Hugging Face's `skip_special_tokens` does. Added tokens
    /// that are not special (`<tool_call>`, `<think>`) stay in the text.
    fn is_special(&self, id: TokenId) -> bool {
        let _ = id;
        false
    }

    /// The bytes each id stands for, in id order, for a constrained-decoding token
    /// trie ([`crate::structured_output::GrammarCompiler`]): special tokens are their
    /// text after a 0xFF byte (never valid UTF-8, so grammar text cannot produce them).
    /// `None`: this tokenizer cannot say, and structured outputs are unavailable.
    fn token_bytes(&self) -> Option<Vec<Vec<u8>>> {
        None
    }
}

/// The text of a special token as `tokenizer_config.json` writes it: either a plain
/// string or an added-token object `{"content": "...", ...}`.
pub(crate) fn special_token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(map) => map
            .get("content")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte tokenizer, asking for `<|endoftext|>` (256) as BOS.
    struct WithBos(ByteTokenizer);

    impl Tokenizer for WithBos {
        fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
            self.0.encode(text)
        }
        fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
            self.0.decode(ids)
        }
        fn vocab_size(&self) -> usize {
            self.0.vocab_size()
        }
        fn token_id(&self, token: &str) -> Option<u32> {
            self.0.token_id(token)
        }
        fn eos_token_ids(&self) -> Vec<u32> {
            self.0.eos_token_ids()
        }
        fn bos_token_id_to_add(&self) -> Option<u32> {
            Some(256)
        }
    }

    #[test]
    fn text_prompts_get_bos_once_when_the_tokenizer_asks() {
        let with = WithBos(ByteTokenizer::new());
        assert_eq!(with.encode_text_prompt("hi").unwrap(), vec![256, 104, 105]);
        assert_eq!(
            with.encode_text_prompt("<|endoftext|>hi").unwrap(),
            vec![256, 104, 105]
        );
        assert!(with.encode_text_prompt("").unwrap().is_empty());
        let without = ByteTokenizer::new();
        assert_eq!(without.encode_text_prompt("hi").unwrap(), vec![104, 105]);
    }
    use serde_json::json;

    #[test]
    fn special_token_text_accepts_both_forms() {
        assert_eq!(special_token_text(&json!("</s>")).as_deref(), Some("</s>"));
        assert_eq!(
            special_token_text(&json!({"__type": "AddedToken", "content": "<|im_end|>"}))
                .as_deref(),
            Some("<|im_end|>")
        );
        assert_eq!(special_token_text(&json!(null)), None);
    }

    #[test]
    fn tokenizers_are_object_safe() {
        let t: Box<dyn Tokenizer> = Box::new(ByteTokenizer::new());
        assert_eq!(t.vocab_size(), BYTE_VOCAB_SIZE);
    }
}
