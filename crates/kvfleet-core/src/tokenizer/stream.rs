//! Incremental decoding for streamed responses.
//!
//! A generated character may span several ids (a byte tokenizer emits a 4-byte emoji as
//! four ids), and some decoders render a token differently depending on what precedes
//! it (SentencePiece strips the leading space of the first token). Decoding each id on
//! its own would therefore emit broken characters and wrong spacing. [`StreamDecoder`]
//! decodes a small window of recent ids instead and emits only the text that the
//! newest id completed. Special tokens ([`Tokenizer::is_special`]) are generated text's
//! control marks, not content: they are skipped.

use super::{Tokenizer, TokenizerError};
use crate::tokens::TokenId;

/// Turns ids, pushed one at a time, into text fragments that never end inside a
/// UTF-8 character.
///
/// The decoder does not hold the tokenizer, so it can live in per-sequence state;
/// pass the same tokenizer to every call.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    /// Ids from `prefix_offset` on; older ids are dropped once emitted.
    ids: Vec<TokenId>,
    /// Start of the context window: decoded only so that the next ids render as they
    /// would in the full text.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
}

impl StreamDecoder {
    /// A decoder that has seen no ids.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `id` and returns the text it completed, which is empty while a character
    /// is still incomplete, and for a special token.
    pub fn push<T: Tokenizer + ?Sized>(
        &mut self,
        tokenizer: &T,
        id: TokenId,
    ) -> Result<String, TokenizerError> {
        if tokenizer.is_special(id) {
            return Ok(String::new());
        }
        self.ids.push(id);
        let emitted = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        // A trailing U+FFFD means the newest bytes do not form a character yet.
        if full.len() <= emitted.len() || full.ends_with('\u{fffd}') {
            return Ok(String::new());
        }
        let Some(new_text) = full.get(emitted.len()..) else {
            // The window decoded differently with the new id, so the old text is not
            // a prefix; wait for more ids rather than emit something inconsistent.
            return Ok(String::new());
        };
        let new_text = new_text.to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Keep only the window so a long generation does not re-grow this buffer.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(new_text)
    }

    /// Text held back so far, flushed at the end of a stream (incomplete characters
    /// become U+FFFD). The decoder is empty afterwards.
    pub fn finish<T: Tokenizer + ?Sized>(
        &mut self,
        tokenizer: &T,
    ) -> Result<String, TokenizerError> {
        let emitted = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        *self = Self::new();
        Ok(full
            .get(emitted.len()..)
            .filter(|_| full.starts_with(&emitted))
            .unwrap_or_default()
            .to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::ByteTokenizer;

    #[test]
    fn holds_back_a_character_split_across_ids() {
        let t = ByteTokenizer::new();
        let mut d = StreamDecoder::new();
        let ids = t.encode("a🦀é<tool_call>").unwrap();
        let pieces: Vec<String> = ids.iter().map(|&id| d.push(&t, id).unwrap()).collect();
        // 'a', then four bytes of the crab, then two of 'é', then the added token.
        assert_eq!(
            pieces,
            ["a", "", "", "", "🦀", "", "é", "<tool_call>"].map(String::from)
        );
        assert_eq!(d.finish(&t).unwrap(), "");
    }

    #[test]
    fn finish_flushes_an_incomplete_character() {
        let t = ByteTokenizer::new();
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&t, u32::from(b'x')).unwrap(), "x");
        assert_eq!(d.push(&t, 0xf0).unwrap(), "");
        assert_eq!(d.push(&t, 0x9f).unwrap(), "");
        assert_eq!(d.finish(&t).unwrap(), "\u{fffd}");
    }

    #[test]
    fn invalid_bytes_are_emitted_once_followed_by_text() {
        let t = ByteTokenizer::new();
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for id in [0xff, u32::from(b'o'), u32::from(b'k')] {
            out.push_str(&d.push(&t, id).unwrap());
        }
        out.push_str(&d.finish(&t).unwrap());
        assert_eq!(out, "\u{fffd}ok");
    }

    #[test]
    fn special_tokens_are_left_out_even_inside_a_character() {
        let t = ByteTokenizer::new();
        let mut d = StreamDecoder::new();
        let crab = "🦀".as_bytes();
        let ids = [
            u32::from(b'a'),
            crate::tokenizer::BYTE_IM_START_ID,
            u32::from(crab[0]),
            u32::from(crab[1]),
            crate::tokenizer::BYTE_ENDOFTEXT_ID,
            u32::from(crab[2]),
            u32::from(crab[3]),
            crate::tokenizer::BYTE_IM_END_ID,
        ];
        let mut out = String::new();
        for id in ids {
            out.push_str(&d.push(&t, id).unwrap());
        }
        out.push_str(&d.finish(&t).unwrap());
        assert_eq!(out, "a🦀");
    }

    #[test]
    fn concatenated_pieces_equal_the_full_decode() {
        let t = ByteTokenizer::new();
        let text = "héllo 世界 🦀 <think>x</think> done";
        let ids = t.encode(text).unwrap();
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(&t, id).unwrap());
        }
        out.push_str(&d.finish(&t).unwrap());
        assert_eq!(out, text);
    }
}
