//! The byte-level tokenizer of the seeded default model.
//!
//! Ids 0..=255 are raw bytes, so any text encodes without a vocabulary file; a few
//! ChatML and tool-calling special tokens follow. The vocabulary is padded to
//! [`BYTE_VOCAB_SIZE`] so the model's embedding table has a round size.

use super::{Tokenizer, TokenizerError};
use crate::tokens::TokenId;

/// Vocabulary size of [`ByteTokenizer`], padding included.
pub const BYTE_VOCAB_SIZE: usize = 320;

/// Id of the first special token; ids below it are raw bytes.
pub const BYTE_SPECIAL_BASE: TokenId = 256;

/// The special tokens of [`ByteTokenizer`]; the one at index `i` has id
/// `BYTE_SPECIAL_BASE + i`.
pub const BYTE_SPECIAL_TOKENS: [&str; 9] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

/// Id of `<|endoftext|>`.
pub const BYTE_ENDOFTEXT_ID: TokenId = 256;
/// Id of `<|im_start|>`.
pub const BYTE_IM_START_ID: TokenId = 257;
/// Id of `<|im_end|>`, the end of a chat turn and the primary end-of-sequence id.
pub const BYTE_IM_END_ID: TokenId = 258;

const SPECIAL_END: TokenId = BYTE_SPECIAL_BASE + BYTE_SPECIAL_TOKENS.len() as TokenId;

/// Tokenizer whose ids are bytes plus [`BYTE_SPECIAL_TOKENS`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// The byte tokenizer (it has no state).
    pub fn new() -> Self {
        Self
    }

    /// The special token starting `rest`, as (id, length in bytes).
    fn match_special(rest: &[u8]) -> Option<(TokenId, usize)> {
        BYTE_SPECIAL_TOKENS
            .iter()
            .zip(BYTE_SPECIAL_BASE..)
            .find(|(s, _)| rest.starts_with(s.as_bytes()))
            .map(|(s, id)| (id, s.len()))
    }
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<TokenId>, TokenizerError> {
        // Every special token starts with '<', so only those positions need matching;
        // `str::find` on a char is memchr-accelerated, which keeps 32k-token prompts
        // cheap. Positions after '<' or a special token are char boundaries because
        // both are ASCII.
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut pos = 0;
        while let Some(off) = text[pos..].find('<') {
            let lt = pos + off;
            out.extend(bytes[pos..lt].iter().map(|&b| TokenId::from(b)));
            match Self::match_special(&bytes[lt..]) {
                Some((id, len)) => {
                    out.push(id);
                    pos = lt + len;
                }
                None => {
                    out.push(TokenId::from(b'<'));
                    pos = lt + 1;
                }
            }
        }
        out.extend(bytes[pos..].iter().map(|&b| TokenId::from(b)));
        Ok(out)
    }

    fn decode(&self, ids: &[TokenId]) -> Result<String, TokenizerError> {
        let mut buf = Vec::with_capacity(ids.len());
        for &id in ids {
            match id {
                0..=255 => buf.push(id as u8),
                BYTE_SPECIAL_BASE..SPECIAL_END => {
                    let name = BYTE_SPECIAL_TOKENS[(id - BYTE_SPECIAL_BASE) as usize];
                    buf.extend_from_slice(name.as_bytes());
                }
                // Padding ids carry no text; a model that emits one produced nothing.
                _ if (id as usize) < BYTE_VOCAB_SIZE => {}
                _ => {
                    return Err(TokenizerError::UnknownId {
                        id,
                        vocab_size: BYTE_VOCAB_SIZE,
                    })
                }
            }
        }
        Ok(match String::from_utf8(buf) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    fn vocab_size(&self) -> usize {
        BYTE_VOCAB_SIZE
    }

    fn token_id(&self, token: &str) -> Option<TokenId> {
        match token.as_bytes() {
            [b] => Some(TokenId::from(*b)),
            bytes => Self::match_special(bytes)
                .filter(|&(_, len)| len == bytes.len())
                .map(|(id, _)| id),
        }
    }

    fn eos_token_ids(&self) -> Vec<TokenId> {
        vec![BYTE_IM_END_ID, BYTE_ENDOFTEXT_ID]
    }

    /// The ChatML control tokens are special; the tool-call and thinking tags stay in
    /// generated text, where the router parses them (as in Qwen's vocabulary).
    fn is_special(&self, id: TokenId) -> bool {
        matches!(id, BYTE_ENDOFTEXT_ID | BYTE_IM_START_ID | BYTE_IM_END_ID)
    }

    fn token_bytes(&self) -> Option<Vec<Vec<u8>>> {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for (text, id) in BYTE_SPECIAL_TOKENS.iter().zip(BYTE_SPECIAL_BASE..) {
            let mut w = Vec::with_capacity(text.len() + 1);
            if self.is_special(id) {
                w.push(0xFF);
            }
            w.extend_from_slice(text.as_bytes());
            words.push(w);
        }
        words.resize(BYTE_VOCAB_SIZE, Vec::new());
        Some(words)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn specials_have_the_documented_ids() {
        let t = ByteTokenizer::new();
        let expected = [
            ("<|endoftext|>", 256),
            ("<|im_start|>", 257),
            ("<|im_end|>", 258),
            ("<tool_call>", 259),
            ("</tool_call>", 260),
            ("<tool_response>", 261),
            ("</tool_response>", 262),
            ("<think>", 263),
            ("</think>", 264),
        ];
        for (name, id) in expected {
            assert_eq!(t.token_id(name), Some(id), "{name}");
            assert_eq!(t.encode(name).unwrap(), vec![id], "{name}");
        }
        assert_eq!(t.token_id("a"), Some(97));
        assert_eq!(t.token_id("<|im_end"), None);
        assert_eq!(t.token_id("ab"), None);
        assert_eq!(t.eos_token_ids(), vec![258, 256]);
        assert_eq!(t.vocab_size(), 320);
    }

    #[test]
    fn encodes_specials_inside_text_and_bytes_elsewhere() {
        let t = ByteTokenizer::new();
        let ids = t.encode("<|im_start|>user\na<b é<|im_end|>\n").unwrap();
        let mut expected = vec![257];
        expected.extend("user\na<b é".bytes().map(u32::from));
        expected.extend([258, u32::from(b'\n')]);
        assert_eq!(ids, expected);
        // A '<' that starts no special token, including at the very end, is a byte.
        assert_eq!(t.encode("<<").unwrap(), vec![60, 60]);
        assert_eq!(t.encode("<|im_sta").unwrap().len(), 8);
    }

    #[test]
    fn round_trips_multibyte_text_and_specials() {
        let t = ByteTokenizer::new();
        let text =
            "<|im_start|>system\nhéllo, 世界 🦀<think>…</think><tool_call>{}</tool_call><|im_end|>";
        assert_eq!(t.decode(&t.encode(text).unwrap()).unwrap(), text);
    }

    #[test]
    fn decode_handles_padding_out_of_range_and_bad_utf8() {
        let t = ByteTokenizer::new();
        assert_eq!(t.decode(&[104, 265, 319, 105]).unwrap(), "hi");
        assert!(matches!(
            t.decode(&[320]),
            Err(TokenizerError::UnknownId { id: 320, .. })
        ));
        assert_eq!(t.decode(&[0xe4, 104]).unwrap(), "\u{fffd}h");
    }

    proptest! {
        #[test]
        fn any_text_round_trips(text in "(<|\\||im_|start|end|>|tool_call|/|[a-zé世🦀\n ]){0,40}") {
            let t = ByteTokenizer::new();
            let ids = t.encode(&text).unwrap();
            prop_assert!(ids.iter().all(|&id| (id as usize) < BYTE_VOCAB_SIZE));
            prop_assert_eq!(t.decode(&ids).unwrap(), text);
        }
    }
}
