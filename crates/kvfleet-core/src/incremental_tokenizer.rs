//! Incremental tokenization: a conversation that grows by appending turns is tokenized
//! only in its new tail.
//!
//! Each turn re-sends the whole conversation. The router renders it (cheap) and looks up
//! what it tokenized for the same conversation last time: if that rendered text is a
//! byte prefix of the new one and the cut falls right before a special token (where
//! tokenizers split anyway, so ids cannot merge across it), the old ids are reused and
//! only the tail is tokenized. Anything else falls back to tokenizing from scratch, so
//! the ids are always exactly those of a full tokenization.

use crate::byte_lru::ByteLru;
use crate::chat::{ChatError, ChatMessage, ChatTemplate, ToolDefinition};
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::TokenId;
use xxhash_rust::xxh3::Xxh3;

/// Why a conversation could not be turned into ids.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The chat template failed.
    #[error(transparent)]
    Chat(#[from] ChatError),
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// A rendered, tokenized prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedPrompt {
    /// Prompt token ids (the generation prompt included).
    pub ids: Vec<TokenId>,
    /// Leading ids reused from the conversation's previous turn.
    pub reused: usize,
    /// Leading ids that render the conversation's own messages (no tail, no generation
    /// prompt): the part a later turn can find in the prefix cache.
    pub history_len: usize,
}

struct Entry {
    /// Rendered history (no generation prompt) as of the last turn.
    text: String,
    ids: Vec<TokenId>,
}

impl Entry {
    /// What the entry holds: its text, its ids and a fixed allowance for the map.
    fn bytes(&self) -> usize {
        ENTRY_OVERHEAD_BYTES + self.text.len() + self.ids.len() * std::mem::size_of::<TokenId>()
    }
}

/// Per-entry bytes beyond text and ids: the node, its key and the map's slot.
const ENTRY_OVERHEAD_BYTES: usize = 128;

/// Per-conversation memo of rendered text → token ids, bounded in bytes (the least
/// recently used conversation goes first).
pub struct IncrementalTokenizer {
    entries: ByteLru<u64, Entry>,
}

impl IncrementalTokenizer {
    /// A memo holding at most `max_bytes` of rendered text and ids.
    pub fn new(max_bytes: usize) -> Self {
        IncrementalTokenizer {
            entries: ByteLru::new(max_bytes),
        }
    }

    /// Conversations remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes the memo holds (at most the bound it was made with).
    pub fn bytes(&self) -> usize {
        self.entries.bytes()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Renders and tokenizes `messages`, reusing the ids of an earlier turn of the same
    /// conversation where that is exact. `scope` separates models and tenants.
    pub fn tokenize(
        &mut self,
        scope: &str,
        template: &ChatTemplate,
        tokenizer: &dyn Tokenizer,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedPrompt, PromptError> {
        self.tokenize_with_tail(scope, template, tokenizer, messages, &[], tools)
    }

    /// Like [`tokenize`](Self::tokenize), with `tail` messages (a per-request agent
    /// status) rendered after `messages` but kept out of the memo, so that the next
    /// turn, which replaces the tail, still extends the remembered history.
    pub fn tokenize_with_tail(
        &mut self,
        scope: &str,
        template: &ChatTemplate,
        tokenizer: &dyn Tokenizer,
        messages: &[ChatMessage],
        tail: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedPrompt, PromptError> {
        let history = template.render(messages, tools, false)?;
        let full = if tail.is_empty() {
            template.render(messages, tools, true)?
        } else {
            let all: Vec<ChatMessage> = messages.iter().chain(tail).cloned().collect();
            template.render(&all, tools, true)?
        };

        // The previous turn is usually the conversation minus its last one or two
        // messages; try the few most recent cut points, longest first.
        let mut reused = 0;
        let mut history_ids = None;
        for k in (1..messages.len()).rev().take(MAX_CUTS_TRIED) {
            let earlier = template.render(&messages[..k], tools, false)?;
            let Some(e) = self.entries.get(&text_key(scope, &earlier)) else {
                continue;
            };
            if e.text == earlier
                && history.starts_with(&earlier)
                && safe_split(tokenizer, &history, earlier.len())
            {
                let mut ids = e.ids.clone();
                ids.extend(tokenizer.encode(&history[earlier.len()..])?);
                reused = e.ids.len();
                history_ids = Some(ids);
                break;
            }
        }
        let history_ids = match history_ids {
            Some(ids) => ids,
            None => tokenizer.encode(&history)?,
        };
        let (ids, history_len) =
            if full.starts_with(&history) && safe_split(tokenizer, &full, history.len()) {
                let mut ids = history_ids.clone();
                ids.extend(tokenizer.encode(&full[history.len()..])?);
                (ids, history_ids.len())
            } else {
                // The template does not extend the history at a special token: tokenize
                // the prompt whole; only the ids it shares with the history are history.
                let ids = tokenizer.encode(&full)?;
                let shared = ids
                    .iter()
                    .zip(&history_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                (ids, shared)
            };
        self.remember(text_key(scope, &history), history, history_ids);
        Ok(TokenizedPrompt {
            ids,
            reused,
            history_len,
        })
    }

    fn remember(&mut self, key: u64, text: String, ids: Vec<TokenId>) {
        let entry = Entry { text, ids };
        let bytes = entry.bytes();
        self.entries.insert(key, entry, bytes);
    }
}

/// How many earlier cut points a lookup renders and tries.
const MAX_CUTS_TRIED: usize = 4;

/// Entries are keyed by the rendered text itself, so conversations that share a
/// system prompt but diverge later never overwrite each other.
fn text_key(scope: &str, text: &str) -> u64 {
    let mut h = Xxh3::new();
    h.update(scope.as_bytes());
    h.update(&[0]);
    h.update(text.as_bytes());
    h.digest()
}

/// Whether ids of `text[..at]` followed by ids of `text[at..]` equal ids of `text`:
/// true at the ends, and where `text[at..]` starts with a special token (tokenizers
/// split on special tokens before anything else).
fn safe_split(tokenizer: &dyn Tokenizer, text: &str, at: usize) -> bool {
    if at == 0 || at == text.len() {
        return true;
    }
    let Some(tail) = text.get(at..) else {
        return false;
    };
    if !tail.starts_with('<') {
        return false;
    }
    // A special token is short; look at most 64 bytes ahead, cut on a char boundary
    // (the text is user input and may hold multi-byte characters there).
    let mut window = tail.len().min(64);
    while !tail.is_char_boundary(window) {
        window -= 1;
    }
    match tail[..window].find('>') {
        Some(end) => tokenizer.token_id(&tail[..=end]).is_some(),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::ByteTokenizer;

    #[test]
    fn split_check_survives_multibyte_text_after_a_tag() {
        // 63 ASCII bytes then a two-byte character straddling the 64-byte window
        // (found by schemathesis: it panicked the router).
        let text = format!("x<{}þ>", "a".repeat(62));
        assert!(!safe_split(&ByteTokenizer::new(), &text, 1));
    }

    fn conversation(turns: usize) -> Vec<ChatMessage> {
        let mut m = vec![ChatMessage::system("You are a careful agent. ".repeat(50))];
        for i in 0..turns {
            m.push(ChatMessage::user(format!(
                "question {i}: {}",
                "why? ".repeat(i + 1)
            )));
            m.push(ChatMessage::assistant(format!("answer {i}")));
        }
        m.push(ChatMessage::user("and now?"));
        m
    }

    #[test]
    fn incremental_ids_equal_a_render_from_scratch() {
        let tok = ByteTokenizer::new();
        let tpl = ChatTemplate::ChatMl;
        let mut inc = IncrementalTokenizer::new(1 << 20);
        // Each turn is the previous one plus the assistant's answer and a new question.
        let mut msgs = conversation(0);
        for turns in 0..6 {
            if turns > 0 {
                msgs.push(ChatMessage::assistant(format!("answer {turns}")));
                msgs.push(ChatMessage::user(format!("question {turns}")));
            }
            let got = inc.tokenize("tiny", &tpl, &tok, &msgs, &[]).unwrap();
            let scratch = tok.encode(&tpl.render(&msgs, &[], true).unwrap()).unwrap();
            assert_eq!(got.ids, scratch, "turn {turns}");
            if turns > 0 {
                assert!(
                    got.reused > 0,
                    "turn {turns} reused the previous turn's ids"
                );
            }
        }
    }

    #[test]
    fn conversations_sharing_a_system_prompt_do_not_evict_each_other() {
        let tok = ByteTokenizer::new();
        let tpl = ChatTemplate::ChatMl;
        let mut inc = IncrementalTokenizer::new(1 << 20);
        let a = conversation(1);
        let mut b = conversation(1);
        b[1] = ChatMessage::user("a different first question");
        inc.tokenize("m", &tpl, &tok, &a, &[]).unwrap();
        inc.tokenize("m", &tpl, &tok, &b, &[]).unwrap();
        let mut a2 = a.clone();
        a2.push(ChatMessage::assistant("ok"));
        a2.push(ChatMessage::user("next"));
        let got = inc.tokenize("m", &tpl, &tok, &a2, &[]).unwrap();
        assert!(got.reused > 0);
        assert_eq!(
            got.ids,
            tok.encode(&tpl.render(&a2, &[], true).unwrap()).unwrap()
        );
    }

    #[test]
    fn edited_history_falls_back_to_scratch() {
        let tok = ByteTokenizer::new();
        let tpl = ChatTemplate::ChatMl;
        let mut inc = IncrementalTokenizer::new(1 << 20);
        let mut msgs = conversation(2);
        inc.tokenize("tiny", &tpl, &tok, &msgs, &[]).unwrap();
        msgs[1] = ChatMessage::user("an edited question");
        let got = inc.tokenize("tiny", &tpl, &tok, &msgs, &[]).unwrap();
        assert_eq!(got.reused, 0);
        assert_eq!(
            got.ids,
            tok.encode(&tpl.render(&msgs, &[], true).unwrap()).unwrap()
        );
    }

    #[test]
    fn a_replaced_tail_stays_out_of_the_next_turns_prefix() {
        let tok = ByteTokenizer::new();
        let tpl = ChatTemplate::ChatMl;
        let mut inc = IncrementalTokenizer::new(1 << 20);
        let mut msgs = conversation(1);
        let status = [ChatMessage::user(
            "<agent_status>\nturns: 1\n</agent_status>",
        )];
        let first = inc
            .tokenize_with_tail("m", &tpl, &tok, &msgs, &status, &[])
            .unwrap();
        let mut all = msgs.clone();
        all.extend_from_slice(&status);
        assert_eq!(
            first.ids,
            tok.encode(&tpl.render(&all, &[], true).unwrap()).unwrap()
        );
        let history = tok.encode(&tpl.render(&msgs, &[], false).unwrap()).unwrap();
        assert_eq!(first.history_len, history.len());
        assert_eq!(&first.ids[..first.history_len], &history[..]);

        msgs.push(ChatMessage::assistant("done"));
        msgs.push(ChatMessage::user("next"));
        let second = inc
            .tokenize_with_tail("m", &tpl, &tok, &msgs, &status, &[])
            .unwrap();
        assert_eq!(
            second.reused,
            history.len(),
            "the memo held the history without the status"
        );
        assert_eq!(&second.ids[..history.len()], &history[..]);
    }

    /// Bytes the memo charges for `msgs`' rendered history.
    fn history_bytes(msgs: &[ChatMessage]) -> usize {
        let text = ChatTemplate::ChatMl.render(msgs, &[], false).unwrap();
        let ids = ByteTokenizer::new().encode(&text).unwrap().len();
        ENTRY_OVERHEAD_BYTES + text.len() + ids * std::mem::size_of::<TokenId>()
    }

    #[test]
    fn memory_is_bounded_in_bytes_and_the_least_recently_used_goes_first() {
        let tok = ByteTokenizer::new();
        let tpl = ChatTemplate::ChatMl;
        let convo = |i: usize| {
            vec![
                ChatMessage::system(format!("conversation {i}: {}", "x".repeat(1000))),
                ChatMessage::user("u"),
            ]
        };
        let one = history_bytes(&convo(0));
        // Room for three conversations' histories, not four.
        let mut inc = IncrementalTokenizer::new(one * 3 + one / 2);
        for i in 0..3 {
            inc.tokenize("m", &tpl, &tok, &convo(i), &[]).unwrap();
        }
        assert_eq!((inc.len(), inc.bytes()), (3, one * 3));
        // Conversation 0 is used again: 1 is now the least recently used.
        let mut next = convo(0);
        next.push(ChatMessage::assistant("a"));
        next.push(ChatMessage::user("again"));
        assert!(inc.tokenize("m", &tpl, &tok, &next, &[]).unwrap().reused > 0);
        inc.tokenize("m", &tpl, &tok, &convo(3), &[]).unwrap();
        assert!(inc.bytes() <= one * 3 + one / 2, "{}", inc.bytes());
        let reused = |inc: &mut IncrementalTokenizer, i: usize| {
            let mut m = convo(i);
            m.push(ChatMessage::assistant("a"));
            m.push(ChatMessage::user("later"));
            inc.tokenize("m", &tpl, &tok, &m, &[]).unwrap().reused > 0
        };
        assert!(reused(&mut inc, 0), "the oldest but recently used stayed");
        assert!(!reused(&mut inc, 1), "the least recently used went first");
        // A conversation larger than the whole bound is tokenized, never kept.
        let mut small = IncrementalTokenizer::new(one / 2);
        let got = small.tokenize("m", &tpl, &tok, &convo(9), &[]).unwrap();
        assert_eq!(
            got.ids,
            tok.encode(&tpl.render(&convo(9), &[], true).unwrap())
                .unwrap()
        );
        assert_eq!((small.len(), small.bytes()), (0, 0));
    }
}
