//! The served model's prompt side (tokenizer and chat template) and the incremental
//! tokenizer's conversation memo, shared by request handlers.

use crate::prompt_model::PromptModel;
use kvfleet_core::chat::{ChatMessage, ToolDefinition};
use kvfleet_core::incremental_tokenizer::{IncrementalTokenizer, PromptError, TokenizedPrompt};
use kvfleet_core::sync::lock;
use std::sync::Mutex;

/// The tokenizer memo: a new turn of a known conversation tokenizes only its tail.
pub struct TokenizerMemo(Mutex<IncrementalTokenizer>);

impl TokenizerMemo {
    /// A memo holding at most `max_bytes` of rendered conversations and their ids.
    pub fn new(max_bytes: usize) -> Self {
        TokenizerMemo(Mutex::new(IncrementalTokenizer::new(max_bytes)))
    }

    /// Renders `messages` then `tail` with `prompt`'s template and tokenizes them,
    /// reusing the ids of an earlier turn of the same conversation (`scope`: model and
    /// tenant) where that is exact; see
    /// [`IncrementalTokenizer::tokenize_with_tail`].
    pub fn tokenize_with_tail(
        &self,
        prompt: &PromptModel,
        scope: &str,
        messages: &[ChatMessage],
        tail: &[ChatMessage],
        tools: &[ToolDefinition],
    ) -> Result<TokenizedPrompt, PromptError> {
        lock(&self.0).tokenize_with_tail(
            scope,
            &prompt.chat_template,
            prompt.tokenizer.as_ref(),
            messages,
            tail,
            tools,
        )
    }

    /// Conversations remembered.
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    /// Bytes the memo holds.
    pub fn bytes(&self) -> usize {
        lock(&self.0).bytes()
    }

    /// Whether no conversation is remembered.
    pub fn is_empty(&self) -> bool {
        lock(&self.0).is_empty()
    }
}
