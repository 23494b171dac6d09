//! Resolving a `--model` argument ([`crate::model_cache::locate_model`]) and loading what
//! belongs to it: the weights, the tokenizer and the chat template. The router needs only
//! the last two, which [`load_prompt_model`] reads without the weights (for a GGUF file,
//! its header alone).

use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, GgufLoadOptions};
use crate::gguf_tokenizer::tokenizer_from_gguf;
use crate::model::LlamaModel;
use crate::model_cache::{gguf_model_id, locate_model, ModelLocation};
use crate::model_config::ModelConfig;
use kvfleet_core::chat::ChatTemplate;
use kvfleet_core::cost_model::CostModel;
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

/// The prompt side of a model: what a router needs to tokenize requests.
#[derive(Clone)]
pub struct PromptSide {
    /// The model's default id.
    pub id: String,
    /// The matching tokenizer.
    pub tokenizer: Arc<dyn Tokenizer>,
    /// How conversations become prompt text.
    pub chat_template: ChatTemplate,
}

/// Loads `spec` (see [`locate_model`]): a seeded preset, a known model from the model
/// cache, a GGUF file (or a directory holding one), or a Hugging Face directory.
pub fn load_model(spec: &str) -> Result<LoadedModel> {
    match locate_model(spec)? {
        ModelLocation::Preset(name, config) => Ok(LoadedModel {
            id: name.to_string(),
            model: Arc::new(LlamaModel::seeded(*config, PRESET_SEED)?),
            tokenizer: Arc::new(ByteTokenizer::new()),
            chat_template: ChatTemplate::ChatMl,
        }),
        ModelLocation::Gguf(path) => {
            let (model, file) = LlamaModel::load_gguf(&path, GgufLoadOptions::default())?;
            let (tokenizer, chat_template) = tokenizer_from_gguf(file.content(), file.path())?;
            Ok(LoadedModel {
                id: gguf_model_id(file.path()),
                model: Arc::new(model),
                tokenizer: Arc::new(tokenizer),
                chat_template,
            })
        }
        ModelLocation::HfDir(dir) => {
            let model = LlamaModel::load(&dir)?;
            let side = hf_prompt_side(&dir)?;
            Ok(LoadedModel {
                id: side.id,
                model: Arc::new(model),
                tokenizer: side.tokenizer,
                chat_template: side.chat_template,
            })
        }
    }
}

/// A model served by the simulated engine ([`crate::sim_backend::SimBackend`]): the
/// prompt side and architecture of a seeded preset, no weights, and the cost model
/// that times its steps.
#[derive(Clone)]
pub struct SimModel {
    /// Id, tokenizer and chat template: the preset's, so a router started with the
    /// same `--model` tokenizes and hashes exactly as for the real preset.
    pub prompt: PromptSide,
    /// The preset's architecture (vocabulary size, context length).
    pub config: ModelConfig,
    /// What each engine step costs.
    pub cost: CostModel,
}

/// The simulated model for `spec`, timed by `cost`. Only the seeded presets (`tiny`,
/// `small`) are simulated: their byte-level tokenizer decodes the simulator's output
/// bytes as themselves and has no end-of-sequence token to stumble on.
pub fn load_sim_model(spec: &str, cost: CostModel) -> Result<SimModel> {
    match locate_model(spec)? {
        ModelLocation::Preset(name, config) => Ok(SimModel {
            prompt: PromptSide {
                id: name.to_string(),
                tokenizer: Arc::new(ByteTokenizer::new()),
                chat_template: ChatTemplate::ChatMl,
            },
            config: *config,
            cost,
        }),
        ModelLocation::Gguf(_) | ModelLocation::HfDir(_) => Err(EngineError::Config(format!(
            "the sim engine serves the seeded presets only (--model tiny or small), not \
             `{spec}`"
        ))),
    }
}

/// The tokenizer and chat template of `spec`, without its weights.
pub fn load_prompt_model(spec: &str) -> Result<PromptSide> {
    match locate_model(spec)? {
        ModelLocation::Preset(name, _) => Ok(PromptSide {
            id: name.to_string(),
            tokenizer: Arc::new(ByteTokenizer::new()),
            chat_template: ChatTemplate::ChatMl,
        }),
        ModelLocation::Gguf(path) => {
            let file = GgufFile::open(&path)?;
            let (tokenizer, chat_template) = tokenizer_from_gguf(file.content(), file.path())?;
            Ok(PromptSide {
                id: gguf_model_id(file.path()),
                tokenizer: Arc::new(tokenizer),
                chat_template,
            })
        }
        ModelLocation::HfDir(dir) => hf_prompt_side(&dir),
    }
}

fn hf_prompt_side(dir: &Path) -> Result<PromptSide> {
    let spec = dir.display();
    let tokenizer = HfTokenizer::from_dir(dir)
        .map_err(|e| EngineError::Config(format!("tokenizer in {spec}: {e}")))?;
    let chat_template = ChatTemplate::from_model_dir(dir)
        .map_err(|e| EngineError::Config(format!("chat template in {spec}: {e}")))?;
    let id = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| spec.to_string());
    Ok(PromptSide {
        id,
        tokenizer: Arc::new(tokenizer),
        chat_template,
    })
}
