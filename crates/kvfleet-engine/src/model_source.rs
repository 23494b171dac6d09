//! Resolving a `--model` argument: a seeded preset (`tiny`, `small`) or a Hugging Face
//! directory, with the tokenizer and chat template that belong to it.

use crate::error::{EngineError, Result};
use crate::model::LlamaModel;
use crate::model_config::ModelConfig;
use kvfleet_core::chat::ChatTemplate;
use kvfleet_core::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};
use std::path::Path;
use std::sync::Arc;

/// Seed of the preset models' weights: fixed, so every process of a fleet (and every
/// test) builds bit-identical weights without sharing files.
pub const PRESET_SEED: u64 = 0x006b_7666_6c65_6574;

/// A model ready to serve: weights, tokenizer, chat template and its id.
#[derive(Clone)]
pub struct LoadedModel {
    /// The id clients name in requests; it also seeds block-hash namespaces.
    pub id: String,
    /// The weights.
    pub model: Arc<LlamaModel>,
    /// The matching tokenizer.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// How conversations become prompt text.
    pub chat_template: ChatTemplate,
}

/// Loads `spec`: `tiny` or `small` (seeded presets with a byte tokenizer and ChatML),
/// or the path of a directory with config.json, *.safetensors and tokenizer.json
/// (tokenizer_config.json's chat_template is used when present).
pub fn load_model(spec: &str) -> Result<LoadedModel> {
    let preset = match spec {
        "tiny" => Some(ModelConfig::tiny()),
        "small" => Some(ModelConfig::small()),
        _ => None,
    };
    if let Some(config) = preset {
        return Ok(LoadedModel {
            id: spec.to_string(),
            model: Arc::new(LlamaModel::seeded(config, PRESET_SEED)?),
            tokenizer: Arc::new(ByteTokenizer::new()),
            chat_template: ChatTemplate::ChatMl,
        });
    }
    let dir = Path::new(spec);
    if !dir.is_dir() {
        return Err(EngineError::Config(format!(
            "model `{spec}` is neither a preset (tiny, small) nor a directory"
        )));
    }
    let model = LlamaModel::load(dir)?;
    let tokenizer = HfTokenizer::from_dir(dir)
        .map_err(|e| EngineError::Config(format!("tokenizer in {spec}: {e}")))?;
    let chat_template = ChatTemplate::from_model_dir(dir)
        .map_err(|e| EngineError::Config(format!("chat template in {spec}: {e}")))?;
    let id = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| spec.to_string());
    Ok(LoadedModel {
        id,
        model: Arc::new(model),
        tokenizer: Arc::new(tokenizer),
        chat_template,
    })
}
