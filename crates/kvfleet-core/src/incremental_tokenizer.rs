//! Incremental tokenization: a conversation that grows by appending turns is tokenized
//! only in its new tail.
//!
//! Each turn re-sends the whole conversation. The router renders its history once and
//! looks up what it tokenized for the same conversation last time: every point of the
//! new history right before a special token (where tokenizers split anyway, so ids
//! cannot merge across it) is a candidate end of an earlier turn, and all candidates'
//! keys come from one pass of a streaming hash over the text, so no earlier turn is
//! rendered again. If a remembered text is a byte prefix of the new one, its ids are
//! reused and only the tail is tokenized. Anything else falls back to tokenizing from
//! scratch, so the ids are always exactly those of a full tokenization.
//!
//! The memo is shared by every request: its lock is held only to look entries up and
//! insert them, never while rendering or tokenizing, so conversations never wait on each
//! other's work (two turns of one conversation at once both compute exact ids).

use crate::byte_lru::ByteLru;
use crate::chat::{ChatError, ChatMessage, ChatTemplate, ToolDefinition};
use crate::sync::lock;
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::TokenId;
use std::sync::{Arc, Mutex};
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
/// recently used conversation goes first). Shared: every method takes `&self`.
pub struct IncrementalTokenizer {
    /// Held only for lookups and inserts (see the module docs).
    entries: Mutex<ByteLru<u64, Arc<Entry>>>,
}

/// A conversation's history, rendered and tokenized once: every prompt built on it (a
/// turn with its status tail, each child of a fork) extends it with one render.
pub struct TokenizedHistory {
    entry: Arc<Entry>,
    reused: usize,
}

impl IncrementalTokenizer {
    /// A memo holding at most `max_bytes` of rendered text and ids.
    pub fn new(max_bytes: usize) -> Self {
        IncrementalTokenizer {
            entries: Mutex::new(ByteLru::new(max_bytes)),
        }
    }

    /// Conversations remembered.
    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    /// Bytes the memo holds (at most the bound it was made with).
    pub fn bytes(&self) -> usize {
        lock(&self.entries).bytes()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        lock(&self.entries).is_empty()
    }

    /// Renders and tokenizes `messages`, reusing the ids of an earlier turn of the same
    /// conversation where that is exact. `scope` separates models and tenants.
    pub fn tokenize(
        &self,
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
    /// turn, which replaces the tail, still extends the remembered history. Two
    /// renders: the history and the prompt.
    pub fn tokenize_with_tail(
        &self,
        scope: &str,
        template: &ChatTemplate,
        tokenizer: &dyn Tokenizer,
        messages: &[ChatMessage],
        tail: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedPrompt, PromptError> {
        self.history(scope, template, tokenizer, messages, tools)?
            .extend(template, tokenizer, messages, tail, tools)
    }

    /// Renders `messages` as history (no generation prompt) once, tokenizes it reusing
    /// an earlier turn's ids where exact, and remembers it for later turns.
    pub fn history(
        &self,
        scope: &str,
        template: &ChatTemplate,
        tokenizer: &dyn Tokenizer,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedHistory, PromptError> {
        let history = template.render(messages, tools, false)?;
        let (cuts, whole) = cut_keys(scope, tokenizer, &history);
        // Longest first; the lock is released before any comparison or tokenization.
        let found: Vec<(usize, Arc<Entry>)> = {
            let mut entries = lock(&self.entries);
            cuts.iter()
                .rev()
                .filter_map(|&(at, key)| entries.get(&key).map(|e| (at, e.clone())))
                .collect()
        };
        let mut reused = 0;
        let mut history_ids = None;
        for (at, e) in found {
            if e.text.len() == at && history.as_bytes()[..at] == *e.text.as_bytes() {
                let mut ids = e.ids.clone();
                if at < history.len() {
                    ids.extend(tokenizer.encode(&history[at..])?);
                }
                reused = e.ids.len();
                history_ids = Some(ids);
                break;
            }
        }
        let ids = match history_ids {
            Some(ids) => ids,
            None => tokenizer.encode(&history)?,
        };
        let entry = Arc::new(Entry { text: history, ids });
        let bytes = entry.bytes();
        lock(&self.entries).insert(whole, entry.clone(), bytes);
        Ok(TokenizedHistory { entry, reused })
    }
}

impl TokenizedHistory {
    /// The history's ids.
    pub fn ids(&self) -> &[TokenId] {
        &self.entry.ids
    }

    /// The prompt of `messages` (the messages this history was rendered from) followed
    /// by `tail`, with the generation prompt: one render, and only what follows the
    /// history is tokenized.
    pub fn extend(
        &self,
        template: &ChatTemplate,
        tokenizer: &dyn Tokenizer,
        messages: &[ChatMessage],
        tail: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedPrompt, PromptError> {
        let full = if tail.is_empty() {
            template.render(messages, tools, true)?
        } else {
            let all: Vec<ChatMessage> = messages.iter().chain(tail).cloned().collect();
            template.render(&all, tools, true)?
        };
        let (history, history_ids) = (&self.entry.text, &self.entry.ids);
        let (ids, history_len) =
            if full.starts_with(history.as_str()) && safe_split(tokenizer, &full, history.len()) {
                let mut ids = history_ids.clone();
                ids.extend(tokenizer.encode(&full[history.len()..])?);
                (ids, history_ids.len())
            } else {
                // The template does not extend the history at a special token: tokenize
                // the prompt whole; only the ids it shares with the history are history.
                let ids = tokenizer.encode(&full)?;
                let shared = ids
                    .iter()
                    .zip(history_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                (ids, shared)
            };
        Ok(TokenizedPrompt {
            ids,
            reused: self.reused,
            history_len,
        })
    }
}

/// How many candidate ends of an earlier turn a lookup tries (the last ones before the
/// end of the history: a turn adds a few messages of a few special tokens each).
const MAX_CUTS_TRIED: usize = 16;

/// Entries are keyed by the rendered text itself, so conversations that share a system
/// prompt but diverge later never overwrite each other. The memo keys of `text`'s
/// candidate cut points (ascending: the byte offset, the key
/// of the text before it) and of the whole text, from one pass of a streaming hash.
fn cut_keys(scope: &str, tokenizer: &dyn Tokenizer, text: &str) -> (Vec<(usize, u64)>, u64) {
    let bytes = text.as_bytes();
    let mut cuts = Vec::new();
    let mut end = bytes.len();
    while cuts.len() < MAX_CUTS_TRIED {
        let Some(at) = bytes[..end].iter().rposition(|&b| b == b'<') else {
            break;
        };
        if at > 0 && safe_split(tokenizer, text, at) {
            cuts.push(at);
        }
        end = at;
    }
    cuts.reverse();
    let mut h = Xxh3::new();
    h.update(scope.as_bytes());
    h.update(&[0]);
    let mut done = 0;
    let mut keys = Vec::with_capacity(cuts.len());
    for at in cuts {
        h.update(&bytes[done..at]);
        done = at;
        keys.push((at, h.digest()));
    }
    h.update(&bytes[done..]);
    (keys, h.digest())
}

/// The key [`cut_keys`] gives `text` (tests check the two agree).
#[cfg(test)]
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
        let inc = IncrementalTokenizer::new(1 << 20);
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
        let inc = IncrementalTokenizer::new(1 << 20);
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
        let inc = IncrementalTokenizer::new(1 << 20);
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
        let inc = IncrementalTokenizer::new(1 << 20);
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

    #[test]
    fn cut_keys_are_the_keys_of_the_text_before_each_special_token() {
        let tpl = ChatTemplate::ChatMl;
        let text = tpl.render(&conversation(3), &[], false).unwrap();
        let tok = crate::tokenizer::ByteTokenizer::new();
        let (cuts, whole) = cut_keys("m", &tok, &text);
        assert_eq!(whole, text_key("m", &text));
        assert!(!cuts.is_empty() && cuts.len() <= MAX_CUTS_TRIED);
        for (at, key) in &cuts {
            assert!(text[*at..].starts_with("<|im_"), "cut at {at}");
            assert_eq!(*key, text_key("m", &text[..*at]));
        }
        // Every message boundary of the last turns is among them.
        let earlier = tpl.render(&conversation(3)[..5], &[], false).unwrap();
        assert!(cuts.iter().any(|(at, _)| *at == earlier.len()));
    }

    #[test]
    fn one_history_extends_into_every_tail_exactly() {
        // A fork: one parent, a child message per directive.
        let tok = ByteTokenizer::new();
        let tpl = ChatTemplate::ChatMl;
        let inc = IncrementalTokenizer::new(1 << 20);
        let parent = conversation(2);
        let history = inc.history("m", &tpl, &tok, &parent, &[]).unwrap();
        for d in ["first directive", "second", "<|im_start|>odd"] {
            let tail = [ChatMessage::user(d)];
            let got = history.extend(&tpl, &tok, &parent, &tail, &[]).unwrap();
            let mut all = parent.clone();
            all.extend_from_slice(&tail);
            assert_eq!(
                got.ids,
                tok.encode(&tpl.render(&all, &[], true).unwrap()).unwrap()
            );
            assert_eq!(&got.ids[..got.history_len], history.ids());
        }
        assert_eq!(inc.len(), 1, "the parent's history is remembered once");
    }

    #[test]
    fn the_memo_is_shared_by_threads_and_stays_exact() {
        let inc = std::sync::Arc::new(IncrementalTokenizer::new(1 << 20));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let inc = inc.clone();
                std::thread::spawn(move || {
                    let (tok, tpl) = (ByteTokenizer::new(), ChatTemplate::ChatMl);
                    let mut msgs = conversation(t);
                    for turn in 0..5 {
                        msgs.push(ChatMessage::assistant(format!("a{t}.{turn}")));
                        msgs.push(ChatMessage::user(format!("q{t}.{turn}")));
                        let got = inc.tokenize("m", &tpl, &tok, &msgs, &[]).unwrap();
                        let want = tok.encode(&tpl.render(&msgs, &[], true).unwrap()).unwrap();
                        assert_eq!(got.ids, want);
                        assert!(turn == 0 || got.reused > 0, "thread {t} turn {turn}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
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
        let inc = IncrementalTokenizer::new(one * 3 + one / 2);
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
        let reused = |inc: &IncrementalTokenizer, i: usize| {
            let mut m = convo(i);
            m.push(ChatMessage::assistant("a"));
            m.push(ChatMessage::user("later"));
            inc.tokenize("m", &tpl, &tok, &m, &[]).unwrap().reused > 0
        };
        assert!(reused(&inc, 0), "the oldest but recently used stayed");
        assert!(!reused(&inc, 1), "the least recently used went first");
        // A conversation larger than the whole bound is tokenized, never kept.
        let small = IncrementalTokenizer::new(one / 2);
        let got = small.tokenize("m", &tpl, &tok, &convo(9), &[]).unwrap();
        assert_eq!(
            got.ids,
            tok.encode(&tpl.render(&convo(9), &[], true).unwrap())
                .unwrap()
        );
        assert_eq!((small.len(), small.bytes()), (0, 0));
    }
}
