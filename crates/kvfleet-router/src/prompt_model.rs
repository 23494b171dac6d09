//! What the router needs of a model: its tokenizer and chat template, never its
//! weights. `tiny` and `small` are the seeded presets (byte tokenizer, ChatML); any
//! other spec is a Hugging Face directory.

use kvfleet_core::chat::ChatTemplate;
use kvfleet_core::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};
use std::path::Path;
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
    /// Loads the tokenizer side of `spec` (`tiny`, `small` or a model directory).
    pub fn load(spec: &str) -> Result<Self, String> {
        if spec == "tiny" || spec == "small" {
            return Ok(PromptModel {
                tokenizer: Arc::new(ByteTokenizer::new()),
                chat_template: ChatTemplate::ChatMl,
            });
        }
        let dir = Path::new(spec);
        if !dir.is_dir() {
            return Err(format!(
                "model `{spec}` is neither a preset (tiny, small) nor a directory"
            ));
        }
        let tokenizer =
            HfTokenizer::from_dir(dir).map_err(|e| format!("tokenizer in {spec}: {e}"))?;
        let chat_template = ChatTemplate::from_model_dir(dir)
            .map_err(|e| format!("chat template in {spec}: {e}"))?;
        Ok(PromptModel {
            tokenizer: Arc::new(tokenizer),
            chat_template,
        })
    }
}
