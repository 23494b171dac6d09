//! The worker's per-token log-probabilities in OpenAI's two shapes: chat's
//! `logprobs.content` and legacy completions' parallel arrays. A token's text is the
//! tokenizer's decoding of that token alone; `bytes` are that text's UTF-8 bytes.

use kvfleet_core::openai::{ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob};
use kvfleet_core::tokenizer::Tokenizer;
use kvfleet_proto::v1 as pb;

fn text(tok: &dyn Tokenizer, id: u32) -> String {
    tok.decode(&[id]).unwrap_or_default()
}

/// Chat's `logprobs.content` entries for `lps`.
pub fn chat_entries(tok: &dyn Tokenizer, lps: &[pb::TokenLogprob]) -> Vec<TokenLogprob> {
    lps.iter()
        .map(|l| {
            let token = text(tok, l.token_id);
            TokenLogprob {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob: l.logprob,
                top_logprobs: l
                    .top
                    .iter()
                    .map(|t| {
                        let token = text(tok, t.token_id);
                        TopLogprob {
                            bytes: token.as_bytes().to_vec(),
                            token,
                            logprob: t.logprob,
                        }
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Chat's `logprobs` object for `lps`.
pub fn chat(tok: &dyn Tokenizer, lps: &[pb::TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: chat_entries(tok, lps),
        refusal: None,
    }
}

/// Legacy completions' `logprobs` for `lps`; `offset` is the byte offset of the first
/// token in the generated text (the text already sent, when streamed).
pub fn completion(
    tok: &dyn Tokenizer,
    lps: &[pb::TokenLogprob],
    mut offset: usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for l in lps {
        let token = text(tok, l.token_id);
        out.text_offset.push(offset);
        offset += token.len();
        out.tokens.push(token);
        out.token_logprobs.push(l.logprob);
        out.top_logprobs.push(
            l.top
                .iter()
                .map(|t| (text(tok, t.token_id), t.logprob.into()))
                .collect(),
        );
    }
    out
}
