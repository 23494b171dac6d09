//! Hugging Face tokenizers (`tokenizer.json`) for real models.

use super::{special_token_text, Tokenizer, TokenizerError};
use crate::tokens::TokenId;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// End-of-turn tokens of common chat models. Generation stops at any of them that the
/// vocabulary has, because a model's configured EOS is often the end-of-*document*
/// token while chat turns end with one of these.
const KNOWN_EOS_TOKENS: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>"];

/// A Hugging Face tokenizer loaded from `tokenizer.json`.
///
/// Encoding never adds special tokens (`add_special_tokens = false`): the chat template
/// writes BOS as text where the model needs it, and the added-token matcher turns that
/// text into the BOS id, so BOS is never added twice.
#[derive(Clone, Debug)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    eos_ids: Vec<TokenId>,
    /// BOS to put before raw-text prompts, when the model's configuration asks for it.
    bos_to_add: Option<TokenId>,
    /// Ids of the added tokens marked special, left out of generated text.
    special_ids: HashSet<TokenId>,
}

impl HfTokenizer {
    /// Loads a `tokenizer.json` file. EOS ids are the known end-of-turn tokens present
    /// in the vocabulary; use [`HfTokenizer::from_dir`] to honour the model's config.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&bytes, path.display().to_string())
    }

    /// Parses the contents of a `tokenizer.json` file.
    pub fn from_bytes(bytes: impl AsRef<[u8]>) -> Result<Self, TokenizerError> {
        Self::parse(bytes.as_ref(), "bytes".to_owned())
    }

    /// A tokenizer built in code (see [`super::GgufVocab`]), with its end-of-generation
    /// ids (primary EOS first) and the BOS id raw-text prompts should start with.
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        eos_ids: Vec<TokenId>,
        bos_to_add: Option<TokenId>,
    ) -> Self {
        let special_ids = special_ids(&inner);
        Self {
            inner,
            eos_ids: dedup(eos_ids),
            bos_to_add,
            special_ids,
        }
    }

    /// Loads a model directory: `tokenizer.json`, plus the EOS token named by
    /// `tokenizer_config.json` (`eos_token`) and the ids listed in
    /// `generation_config.json` (`eos_token_id`) when those files exist. BOS is added
    /// to raw-text prompts when `tokenizer_config.json` sets `add_bos_token`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let mut tokenizer = Self::from_file(dir.join("tokenizer.json"))?;
        let mut configured = Vec::new();
        if let Some(config) = read_optional_json(&dir.join("tokenizer_config.json"))? {
            if let Some(id) = config
                .get("eos_token")
                .and_then(special_token_text)
                .and_then(|text| tokenizer.inner.token_to_id(&text))
            {
                configured.push(id);
            }
            if config
                .get("add_bos_token")
                .and_then(serde_json::Value::as_bool)
                == Some(true)
            {
                tokenizer.bos_to_add = config
                    .get("bos_token")
                    .and_then(special_token_text)
                    .and_then(|text| tokenizer.inner.token_to_id(&text));
            }
        }
        if let Some(config) = read_optional_json(&dir.join("generation_config.json"))? {
            match config.get("eos_token_id") {
                Some(serde_json::Value::Array(ids)) => {
                    configured.extend(ids.iter().filter_map(json_token_id));
                }
                Some(id) => configured.extend(json_token_id(id)),
                None => {}
            }
        }
        // Configured ids come first so that the first id is the model's own EOS.
        let known = std::mem::take(&mut tokenizer.eos_ids);
        tokenizer.eos_ids = dedup(configured.into_iter().chain(known));
        Ok(tokenizer)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn parse(bytes: &[u8], what: String) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|source| TokenizerError::Load { what, source })?;
        let eos_ids = dedup(
            KNOWN_EOS_TOKENS
                .iter()
                .filter_map(|token| inner.token_to_id(token)),
        );
        let special_ids = special_ids(&inner);
        Ok(Self {
            inner,
            eos_ids,
            bos_to_add: None,
            special_ids,
        })
    }
}

/// Ids of the added tokens marked special.
fn special_ids(inner: &tokenizers::Tokenizer) -> HashSet<TokenId> {
    inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, token)| token.special)
        .map(|(id, _)| id)
        .collect()
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, TokenizerError> {
        // `encode_fast` skips computing character offsets, which the router never uses.
        self.inner
            .encode_fast(text, false)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(TokenizerError::Encode)
    }

    fn decode(&self, ids: &[TokenId]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(TokenizerError::Decode)
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn token_id(&self, token: &str) -> Option<TokenId> {
        self.inner.token_to_id(token)
    }

    fn eos_token_ids(&self) -> Vec<TokenId> {
        self.eos_ids.clone()
    }

    fn bos_token_id_to_add(&self) -> Option<TokenId> {
        self.bos_to_add
    }

    fn is_special(&self, id: TokenId) -> bool {
        self.special_ids.contains(&id)
    }

    fn token_bytes(&self) -> Option<Vec<Vec<u8>>> {
        // llguidance reads byte-level and byte-fallback vocabularies from the JSON form.
        let json: serde_json::Value =
            serde_json::from_str(&self.inner.to_string(false).ok()?).ok()?;
        let mut words = crate::structured_output::token_bytes_from_tokenizer_json(&json)?;
        words.resize(words.len().max(self.vocab_size()), Vec::new());
        Some(words)
    }
}

/// The parsed JSON file at `path`, or `None` if it does not exist.
fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>, TokenizerError> {
    let io_error = |source| TokenizerError::Io {
        path: PathBuf::from(path),
        source,
    };
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| TokenizerError::Config {
            path: path.to_owned(),
            source,
        })
}

fn json_token_id(value: &serde_json::Value) -> Option<TokenId> {
    value.as_u64().and_then(|id| TokenId::try_from(id).ok())
}

/// `ids` without repeats, first occurrence kept.
fn dedup(ids: impl IntoIterator<Item = TokenId>) -> Vec<TokenId> {
    let mut out: Vec<TokenId> = Vec::new();
    for id in ids {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::StreamDecoder;
    use serde_json::json;

    fn added(id: u32, content: &str) -> serde_json::Value {
        json!({
            "id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        })
    }

    /// A word-level tokenizer with ChatML specials and a post-processor that would add
    /// `<s>` if special tokens were added on encode.
    fn tokenizer_json() -> serde_json::Value {
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                added(0, "<unk>"),
                added(6, "<|im_start|>"),
                added(7, "<|im_end|>"),
                added(8, "<s>"),
                added(9, "</s>"),
                added(10, "<|endoftext|>")
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}
                ],
                "pair": [
                    {"SpecialToken": {"id": "<s>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}
                ],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [8], "tokens": ["<s>"]}}
            },
            "decoder": null,
            "model": {
                "type": "WordLevel",
                "vocab": {
                    "<unk>": 0, "hello": 1, "world": 2, "user": 3, "assistant": 4, "hi": 5,
                    "<|im_start|>": 6, "<|im_end|>": 7, "<s>": 8, "</s>": 9,
                    "<|endoftext|>": 10
                },
                "unk_token": "<unk>"
            }
        })
    }

    fn write_dir(with_config: bool) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            serde_json::to_vec(&tokenizer_json()).unwrap(),
        )
        .unwrap();
        if with_config {
            let config = json!({
                "bos_token": "<s>",
                "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>"}
            });
            std::fs::write(
                dir.path().join("tokenizer_config.json"),
                serde_json::to_vec(&config).unwrap(),
            )
            .unwrap();
        }
        dir
    }

    #[test]
    fn encodes_exact_ids_with_specials_and_no_added_bos() {
        let dir = write_dir(true);
        let t = HfTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.encode("hello world").unwrap(), vec![1, 2]);
        // Specials written as text are single ids, even without surrounding spaces.
        assert_eq!(
            t.encode("<|im_start|>user hello<|im_end|>").unwrap(),
            vec![6, 3, 1, 7]
        );
        // BOS written by a template appears exactly once.
        assert_eq!(t.encode("<s>hi").unwrap(), vec![8, 5]);
        assert_eq!(t.encode("nope").unwrap(), vec![0]);
        assert_eq!(t.token_id("<|im_end|>"), Some(7));
        assert_eq!(t.token_id("missing"), None);
        assert_eq!(t.vocab_size(), 11);
        assert_eq!(
            t.decode(&[6, 3, 1, 7]).unwrap(),
            "<|im_start|> user hello <|im_end|>"
        );
    }

    #[test]
    fn eos_ids_put_the_configured_token_first() {
        let dir = write_dir(true);
        let t = HfTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.eos_token_ids(), vec![10, 7, 9]);

        std::fs::write(
            dir.path().join("generation_config.json"),
            br#"{"eos_token_id": [9, 7]}"#,
        )
        .unwrap();
        let t = HfTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.eos_token_ids(), vec![10, 9, 7]);
    }

    #[test]
    fn without_config_eos_ids_are_the_known_tokens_present() {
        let dir = write_dir(false);
        let t = HfTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.eos_token_ids(), vec![7, 10, 9]);
        let bytes = std::fs::read(dir.path().join("tokenizer.json")).unwrap();
        assert_eq!(
            HfTokenizer::from_bytes(bytes).unwrap().eos_token_ids(),
            vec![7, 10, 9]
        );
    }

    #[test]
    fn load_errors_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            HfTokenizer::from_dir(dir.path()),
            Err(TokenizerError::Io { .. })
        ));
        assert!(matches!(
            HfTokenizer::from_bytes(b"{not json"),
            Err(TokenizerError::Load { .. })
        ));
        let dir = write_dir(false);
        std::fs::write(dir.path().join("tokenizer_config.json"), b"{").unwrap();
        assert!(matches!(
            HfTokenizer::from_dir(dir.path()),
            Err(TokenizerError::Config { .. })
        ));
    }

    #[test]
    fn stream_decoder_inserts_the_decoder_spacing() {
        let dir = write_dir(false);
        let t = HfTokenizer::from_dir(dir.path()).unwrap();
        let mut d = StreamDecoder::new();
        let pieces: Vec<String> = [1, 2, 5]
            .iter()
            .map(|&id| d.push(&t, id).unwrap())
            .collect();
        assert_eq!(pieces, ["hello", " world", " hi"]);
    }
}
