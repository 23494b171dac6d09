//! What the router needs of a model: its tokenizer and chat template, never its
//! weights. The binary builds it from the model's files (kvfleet-engine reads a GGUF
//! header or a Hugging Face directory's tokenizer files), so this crate parses no model.

use kvfleet_core::chat::ChatTemplate;
use kvfleet_core::tokenizer::{ByteTokenizer, Tokenizer};
use std::sync::Arc;

/// Tokenizer and chat template of the model a fleet serves.
#[derive(Clone)]
pub struct PromptModel {
    /// Turns text into ids.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// Turns conversations into text.
    pub chat_template: ChatTemplate,
}

impl PromptModel {
    /// The seeded presets' side (`tiny`, `small`): byte tokenizer, ChatML.
    pub fn byte_level() -> Self {
        PromptModel {
            tokenizer: Arc::new(ByteTokenizer::new()),
            chat_template: ChatTemplate::ChatMl,
        }
    }
}

impl std::fmt::Debug for PromptModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptModel")
            .field("vocab_size", &self.tokenizer.vocab_size())
            .finish_non_exhaustive()
    }
}
