//! The served model's prompt side (tokenizer and chat template) and the incremental
//! tokenizer's conversation memo, shared by request handlers.
//!
//! Rendering and tokenizing are CPU work proportional to the prompt (up to a 32 MiB
//! body): handlers call these methods on the blocking pool, never on the async runtime.
//! The memo's own lock covers only its lookups and inserts, so one conversation's work
//! never waits for another's.

use crate::prompt_model::PromptModel;
use kvfleet_core::chat::{ChatMessage, ToolDefinition};
use kvfleet_core::incremental_tokenizer::{IncrementalTokenizer, PromptError, TokenizedPrompt};

/// The tokenizer memo: a new turn of a known conversation tokenizes only its tail.
pub struct TokenizerMemo(IncrementalTokenizer);

impl TokenizerMemo {
    /// A memo holding at most `max_bytes` of rendered conversations and their ids.
    pub fn new(max_bytes: usize) -> Self {
        TokenizerMemo(IncrementalTokenizer::new(max_bytes))
    }

    /// Renders `messages` then `tail` with `prompt`'s template and tokenizes them,
    /// reusing the ids of an earlier turn of the same conversation (`scope`: model and
    /// tenant) where that is exact; see
    /// [`IncrementalTokenizer::tokenize_with_tail`]. Blocking.
    pub fn tokenize_with_tail(
        &self,
        prompt: &PromptModel,
        scope: &str,
        messages: &[ChatMessage],
        tail: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedPrompt, PromptError> {
        self.0.tokenize_with_tail(
            scope,
            &prompt.chat_template,
            prompt.tokenizer.as_ref(),
            messages,
            tail,
            tools,
        )
    }

    /// One prompt per tail, all after the same `messages` (a fork's children): the
    /// history is rendered and tokenized once, then each prompt costs one render and
    /// the tokenization of what follows the history. Blocking.
    pub fn tokenize_tails(
        &self,
        prompt: &PromptModel,
        scope: &str,
        messages: &[ChatMessage],
        tails: &[Vec<ChatMessage>],
        tools: &[ToolDefinition],
    ) -> Result<Vec<TokenizedPrompt>, PromptError> {
        let (template, tokenizer) = (&prompt.chat_template, prompt.tokenizer.as_ref());
        let history = self
            .0
            .history(scope, template, tokenizer, messages, tools)?;
        tails
            .iter()
            .map(|tail| history.extend(template, tokenizer, messages, tail, tools))
            .collect()
    }

    /// Conversations remembered.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Bytes the memo holds.
    pub fn bytes(&self) -> usize {
        self.0.bytes()
    }

    /// Whether no conversation is remembered.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
