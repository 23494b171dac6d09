//! Tokenizers rebuilt from the vocabulary a GGUF file stores as metadata.
//!
//! A GGUF file has no `tokenizer.json`: it keeps llama.cpp's description of the
//! tokenizer (`tokenizer.ggml.*` keys). [`GgufVocab`] holds those values, read by the
//! engine's GGUF loader, and turns them into a `tokenizers::Tokenizer` the way
//! transformers converts the same file (`integrations/gguf/gguf_tokenizer_mapping.py`),
//! with the pre-tokenizer named by `tokenizer.ggml.pre` taken from the model's original
//! `tokenizer.json`, as llama.cpp's `llama-vocab.cpp` reproduces it:
//!
//! | `tokenizer.ggml.pre` | pre-tokenizer |
//! |---|---|
//! | `smollm` (and StarCoder's family) | `Digits(individual)` then GPT-2's byte-level regex |
//! | `llama-bpe`, `llama3`, `llama-v3` | Llama 3's split regex, byte level, `ignore_merges` |
//! | `qwen2`, `deepseek-r1-qwen` | NFC, then Qwen2's split regex, byte level |
//! | `gpt2`, `gpt-2`, `default`, absent | GPT-2's byte-level regex |
//!
//! `tokenizer.ggml.model = llama` is SentencePiece BPE with byte fallback (`<0xNN>`
//! tokens), `▁` for spaces and merges recovered from the scores when the file has none.
//!
//! Checked against llama.cpp's tokenizer test vectors (ids from each model's original
//! Hugging Face tokenizer; `cargo run -p kvfleet-engine --example gguf_vocab_check`):
//! `llama-bpe`, `qwen2`, `gpt-2`, `starcoder`, `refact` and `llama-spm` all match; the
//! SmolLM2 GGUF is tested against transformers' conversion in
//! `kvfleet-engine/tests/gguf_tokenizer.rs`.

use super::{HfTokenizer, TokenizerError};
use crate::chat::{ChatError, ChatTemplate, JinjaTemplate};
use crate::tokens::TokenId;
use std::collections::{HashMap, HashSet};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, NormalizerWrapper, SplitDelimiterBehavior};

/// `llama.cpp`'s token types (`tokenizer.ggml.token_type`).
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Chat turn terminators: generation also stops at these when the template writes them,
/// because a GGUF's `eos_token_id` is sometimes the end-of-document token instead.
const END_OF_TURN_TOKENS: [&str; 2] = ["<|im_end|>", "<|eot_id|>"];

/// Llama 3's split regex (its `tokenizer.json`; llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split regex (its `tokenizer.json`; llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`):
/// Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer part of a GGUF file's metadata (`tokenizer.ggml.*` and
/// `tokenizer.chat_template`), with the file's key names in the field docs.
#[derive(Clone, Debug, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a `gpt2` vocabulary.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, one per token (empty when absent).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.scores`, one per token (empty when absent).
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.merges` as `"left right"` (empty when absent).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<TokenId>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<TokenId>,
    /// `tokenizer.ggml.eot_token_id` (end of turn), when the file names one.
    pub eot_id: Option<TokenId>,
    /// `tokenizer.ggml.eom_token_id` (end of message), when the file names one.
    pub eom_id: Option<TokenId>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk_id: Option<TokenId>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_id: Option<TokenId>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`. Read for completeness: only embedding models set
    /// it, and generation never appends EOS to a prompt.
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece only; default true).
    pub add_space_prefix: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
    /// `tokenizer.chat_template.tool_use`, used instead when a request has tools.
    pub chat_template_tool_use: Option<String>,
}

/// The pre-tokenizers this module knows, by the family of `tokenizer.ggml.pre` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PreTokenizer {
    Gpt2,
    SmolLm,
    Llama3,
    Qwen2,
}

impl PreTokenizer {
    fn from_name(name: Option<&str>) -> Option<Self> {
        Some(match name {
            None | Some("default" | "gpt2" | "gpt-2") => Self::Gpt2,
            // llama.cpp gives these the same regexes: individual digits, then GPT-2's.
            Some("smollm" | "starcoder" | "refact" | "codeshell") => Self::SmolLm,
            Some("llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "dbrx") => Self::Llama3,
            Some("qwen2" | "deepseek-r1-qwen") => Self::Qwen2,
            Some(_) => return None,
        })
    }
}

impl GgufVocab {
    fn invalid(message: impl Into<String>) -> TokenizerError {
        TokenizerError::InvalidVocab(message.into())
    }

    fn token_type(&self, id: usize) -> Option<i32> {
        self.token_types.get(id).copied()
    }

    fn token_text(&self, id: Option<TokenId>) -> Option<&str> {
        id.and_then(|id| self.tokens.get(id as usize))
            .map(String::as_str)
    }

    /// The tokenizer this metadata describes. Encoding adds nothing (no BOS); BOS is
    /// offered through [`crate::tokenizer::Tokenizer::bos_token_id_to_add`] when
    /// `add_bos_token` says so (default: true for SentencePiece, as llama.cpp and
    /// transformers assume, false for byte-level BPE).
    pub fn tokenizer(&self) -> Result<HfTokenizer, TokenizerError> {
        if self.tokens.is_empty() {
            return Err(Self::invalid("tokenizer.ggml.tokens is missing or empty"));
        }
        if !self.token_types.is_empty() && self.token_types.len() != self.tokens.len() {
            return Err(Self::invalid(format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                self.token_types.len(),
                self.tokens.len()
            )));
        }
        for (key, id) in [
            ("bos_token_id", self.bos_id),
            ("eos_token_id", self.eos_id),
            ("eot_token_id", self.eot_id),
            ("eom_token_id", self.eom_id),
            ("unknown_token_id", self.unk_id),
            ("padding_token_id", self.pad_id),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= self.tokens.len()) {
                return Err(Self::invalid(format!(
                    "tokenizer.ggml.{key} {id} is outside the vocabulary of {} tokens",
                    self.tokens.len()
                )));
            }
        }
        let (inner, add_bos_default) = match self.model.as_str() {
            "gpt2" => (self.byte_level()?, false),
            "llama" => (self.sentencepiece()?, true),
            other => {
                return Err(Self::invalid(format!(
                    "unsupported tokenizer.ggml.model {other:?} (supported: gpt2, llama)"
                )))
            }
        };
        let bos_to_add = self
            .bos_id
            .filter(|_| self.add_bos.unwrap_or(add_bos_default));
        Ok(HfTokenizer::from_parts(inner, self.eos_ids(), bos_to_add))
    }

    /// Ids that end generation: the file's EOS first, then its end-of-turn and
    /// end-of-message ids, then the end-of-turn tokens the chat template writes.
    fn eos_ids(&self) -> Vec<TokenId> {
        let mut ids: Vec<TokenId> = [self.eos_id, self.eot_id, self.eom_id]
            .into_iter()
            .flatten()
            .collect();
        for token in END_OF_TURN_TOKENS {
            let used = self
                .chat_template
                .as_deref()
                .is_none_or(|template| template.contains(token));
            if !used {
                continue;
            }
            if let Some(id) = self.tokens.iter().position(|t| t == token) {
                let id = id as TokenId;
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }

    /// The chat template of the file, with `bos_token` and `eos_token` set to the
    /// texts of the file's BOS and EOS tokens; ChatML when the file has none (as for a
    /// Hugging Face directory without one).
    pub fn chat_template(&self) -> Result<ChatTemplate, ChatError> {
        let Some(source) = &self.chat_template else {
            return Ok(ChatTemplate::ChatMl);
        };
        let bos = self.token_text(self.bos_id).map(str::to_owned);
        let eos = self.token_text(self.eos_id).map(str::to_owned);
        let mut template = JinjaTemplate::new(source.as_str(), bos, eos)?;
        if let Some(tool_use) = &self.chat_template_tool_use {
            template = template.with_tool_use_template(tool_use.as_str())?;
        }
        Ok(ChatTemplate::Jinja(template))
    }

    /// Merges as pairs; a merge is `left right` with exactly one space, since
    /// byte-level tokens spell spaces as `Ġ`.
    fn merge_pairs(&self) -> Result<Vec<(String, String)>, TokenizerError> {
        self.merges
            .iter()
            .enumerate()
            .map(|(i, merge)| {
                merge
                    .split_once(' ')
                    .map(|(l, r)| (l.to_owned(), r.to_owned()))
                    .ok_or_else(|| {
                        Self::invalid(format!("tokenizer.ggml.merges[{i}] {merge:?} has no space"))
                    })
            })
            .collect()
    }

    /// Byte-level BPE (`tokenizer.ggml.model = gpt2`).
    fn byte_level(&self) -> Result<tokenizers::Tokenizer, TokenizerError> {
        let pre_name = self.pre.as_deref();
        let pre = PreTokenizer::from_name(pre_name).ok_or_else(|| {
            Self::invalid(format!(
                "unsupported tokenizer.ggml.pre {:?} (supported: smollm, starcoder, refact, \
                 codeshell, llama-bpe, llama3, llama-v3, smaug-bpe, dbrx, qwen2, \
                 deepseek-r1-qwen, gpt2, default)",
                pre_name.unwrap_or_default()
            ))
        })?;
        // Every byte-level token is spelled in GPT-2's byte alphabet; one that is not
        // (a token stored with a real space) is respelled, as transformers does.
        let alphabet = ByteLevel::alphabet();
        let byte_spelling: Vec<char> = (0..=255u8).map(byte_char).collect();
        let spelled: Vec<String> = self
            .tokens
            .iter()
            .map(|t| {
                if t.chars().all(|c| alphabet.contains(&c)) {
                    t.clone()
                } else {
                    t.bytes().map(|b| byte_spelling[b as usize]).collect()
                }
            })
            .collect();
        let vocab: Vocab = spelled
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as TokenId))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, self.merge_pairs()?)
            .ignore_merges(pre == PreTokenizer::Llama3)
            .build()
            .map_err(|source| TokenizerError::Load {
                what: "GGUF byte-level vocabulary".into(),
                source,
            })?;
        let mut tokenizer = tokenizers::Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        let split = |regex: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
            Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map(PreTokenizerWrapper::Split)
            .map_err(|source| TokenizerError::Load {
                what: "GGUF pre-tokenizer regex".into(),
                source,
            })
        };
        let no_regex = PreTokenizerWrapper::ByteLevel(byte_level.use_regex(false));
        let pre_tokenizer = match pre {
            PreTokenizer::Gpt2 => PreTokenizerWrapper::ByteLevel(byte_level),
            PreTokenizer::SmolLm => PreTokenizerWrapper::Sequence(PreSequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ])),
            PreTokenizer::Llama3 => PreTokenizerWrapper::Sequence(PreSequence::new(vec![
                split(LLAMA3_SPLIT)?,
                no_regex,
            ])),
            PreTokenizer::Qwen2 => {
                tokenizer.with_normalizer(Some(NFC));
                PreTokenizerWrapper::Sequence(PreSequence::new(vec![split(QWEN2_SPLIT)?, no_regex]))
            }
        };
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
        tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
        let spelled_ok = |id: usize| self.tokens[id].chars().all(|c| alphabet.contains(&c));
        let spelled: HashSet<&str> = spelled.iter().map(String::as_str).collect();
        self.add_special_tokens(&mut tokenizer, spelled_ok, |id| {
            spelled.contains(self.tokens[id].as_str())
        });
        Ok(tokenizer)
    }

    /// SentencePiece BPE with byte fallback (`tokenizer.ggml.model = llama`), as
    /// the original (legacy) Llama `tokenizer.json` is built.
    fn sentencepiece(&self) -> Result<tokenizers::Tokenizer, TokenizerError> {
        let vocab: Vocab = self
            .tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.clone(), id as TokenId))
            .collect();
        let merges = if self.merges.is_empty() {
            if self.scores.len() != self.tokens.len() {
                return Err(Self::invalid(format!(
                    "a SentencePiece vocabulary without merges needs tokenizer.ggml.scores \
                     for all {} tokens (found {})",
                    self.tokens.len(),
                    self.scores.len()
                )));
            }
            merges_from_scores(&self.tokens, &self.scores, &vocab)
        } else {
            self.merge_pairs()?
        };
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .fuse_unk(true)
            .byte_fallback(true);
        if let Some(unk) = self.token_text(self.unk_id) {
            builder = builder.unk_token(unk.to_owned());
        }
        let bpe = builder.build().map_err(|source| TokenizerError::Load {
            what: "GGUF SentencePiece vocabulary".into(),
            source,
        })?;
        let mut tokenizer = tokenizers::Tokenizer::new(bpe);
        // SentencePiece's own normalization: every text segment (also one after a
        // special token) gets a leading "▁", and spaces become "▁". transformers 5's
        // `Metaspace(prepend_scheme="first")` differs on text that starts with a
        // space (" Hi" gives "▁Hi" there, "▁▁Hi" here); this is what the model's
        // original tokenizer and llama.cpp do.
        let add_prefix_space = self.add_space_prefix.unwrap_or(true);
        let to_metaspace = Replace::new(" ", "▁").map_err(|source| TokenizerError::Load {
            what: "GGUF SentencePiece normalizer".into(),
            source,
        })?;
        let normalizer = if add_prefix_space {
            NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
                NormalizerWrapper::Prepend(Prepend::new("▁".into())),
                NormalizerWrapper::Replace(to_metaspace),
            ]))
        } else {
            NormalizerWrapper::Replace(to_metaspace)
        };
        tokenizer.with_normalizer(Some(normalizer));
        let replace = Replace::new("▁", " ").map_err(|source| TokenizerError::Load {
            what: "GGUF SentencePiece decoder".into(),
            source,
        })?;
        let mut decoders = vec![
            DecoderWrapper::Replace(replace),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ];
        if add_prefix_space {
            decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
        }
        tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
        self.add_special_tokens(&mut tokenizer, |_| true, |_| true);
        Ok(tokenizer)
    }

    /// Control (and unknown) tokens become special added tokens, so their text encodes
    /// to their id and generated text leaves them out; user-defined ones (`<think>`)
    /// become plain added tokens, matched whole but kept in text. `usable` filters
    /// control tokens and `in_vocab` user-defined ones, as transformers does.
    fn add_special_tokens(
        &self,
        tokenizer: &mut tokenizers::Tokenizer,
        usable: impl Fn(usize) -> bool,
        in_vocab: impl Fn(usize) -> bool,
    ) {
        let mut special = Vec::new();
        let mut user = Vec::new();
        for (id, token) in self.tokens.iter().enumerate() {
            match self.token_type(id) {
                Some(TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN) if usable(id) => {
                    special.push(AddedToken::from(token.as_str(), true).normalized(false));
                }
                Some(TOKEN_TYPE_USER_DEFINED) if in_vocab(id) => {
                    user.push(AddedToken::from(token.as_str(), false).normalized(false));
                }
                _ => {}
            }
        }
        tokenizer.add_special_tokens(&special);
        tokenizer.add_tokens(&user);
    }
}

/// GPT-2's printable spelling of a byte (`bytes_to_unicode`).
fn byte_char(b: u8) -> char {
    // Printable Latin-1 bytes spell themselves; the rest map to U+0100 onward, in
    // byte order.
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or('\u{fffd}')
}

/// Merges implied by a scored vocabulary (transformers' `generate_merges` with
/// scores): every split of a token into two vocabulary pieces, ordered by the token's
/// score, best first, then by the longer left and right piece.
fn merges_from_scores(tokens: &[String], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    // Python's dict keeps the first position of a repeated token and its last score.
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    let mut score_of: HashMap<&str, f32> = HashMap::with_capacity(tokens.len());
    let mut seen = HashSet::with_capacity(tokens.len());
    for (token, &score) in tokens.iter().zip(scores) {
        if seen.insert(token.as_str()) {
            order.push(token);
        }
        score_of.insert(token, score);
    }
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for token in order {
        let score = score_of[token];
        let mut local: Vec<(&str, &str)> = token
            .char_indices()
            .skip(1)
            .map(|(i, _)| token.split_at(i))
            .filter(|(l, r)| vocab.contains_key(*l) && vocab.contains_key(*r))
            .collect();
        local.sort_by_key(|(l, r)| (vocab[*l], vocab[*r]));
        merges.extend(local.into_iter().map(|(l, r)| (l, r, score)));
    }
    // Python sorts by (score, len(left), len(right)) reversed, stably.
    merges.sort_by(|a, b| {
        let key = |m: &(&str, &str, f32)| (m.2, m.0.chars().count(), m.1.chars().count());
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0)
            .then(kb.1.cmp(&ka.1))
            .then(kb.2.cmp(&ka.2))
    });
    merges
        .into_iter()
        .map(|(l, r, _)| (l.to_owned(), r.to_owned()))
        .collect()
}

#[cfg(test)]
mod tests;
