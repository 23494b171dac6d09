//! Llama-family model configuration, read from a Hugging Face `config.json`.
//!
//! One struct covers Llama (2/3/3.1), Mistral, Qwen2 and Qwen3: they share the decoder
//! block and differ only in a few switches (q/k/v bias, per-head q/k RMSNorm, RoPE
//! frequency scaling, sliding window), which are resolved by the methods here so the
//! model code never looks at `model_type` itself.

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{EngineError, Result};

/// The `model_type` values this engine can run.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3"];

/// How RoPE frequencies are rescaled for long contexts (`rope_scaling` in `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 style: long wavelengths are divided by `factor`, short ones kept, and
    /// the band between them interpolated smoothly.
    Llama3 {
        /// How much the context was stretched.
        factor: f64,
        /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are scaled fully.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: usize,
    },
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// How much the context was stretched.
        factor: f64,
    },
}

/// The JSON shape of `rope_scaling`. Both `rope_type` (current transformers) and `type`
/// (older configs; some files carry both) name the kind, so both are read.
#[derive(Debug, Deserialize)]
struct RawRopeScaling {
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    factor: Option<f64>,
    #[serde(default)]
    low_freq_factor: Option<f64>,
    #[serde(default)]
    high_freq_factor: Option<f64>,
    #[serde(default)]
    original_max_position_embeddings: Option<usize>,
}

impl RawRopeScaling {
    fn resolve(self) -> std::result::Result<Option<RopeScaling>, String> {
        let kind = self
            .rope_type
            .or(self.kind)
            .unwrap_or_else(|| "default".into());
        let factor = |what: &str| {
            self.factor
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or_else(|| format!("rope_scaling of type {what} needs a positive `factor`"))
        };
        match kind.as_str() {
            "default" => Ok(None),
            "linear" => Ok(Some(RopeScaling::Linear {
                factor: factor("linear")?,
            })),
            "llama3" => {
                let factor = factor("llama3")?;
                let low = self
                    .low_freq_factor
                    .ok_or("rope_scaling llama3 needs `low_freq_factor`")?;
                let high = self
                    .high_freq_factor
                    .ok_or("rope_scaling llama3 needs `high_freq_factor`")?;
                let orig = self
                    .original_max_position_embeddings
                    .ok_or("rope_scaling llama3 needs `original_max_position_embeddings`")?;
                if !(low > 0.0 && high > low) {
                    return Err(format!(
                        "rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor, got {low} and {high}"
                    ));
                }
                Ok(Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: orig,
                }))
            }
            other => Err(format!(
                "unsupported rope_scaling type {other:?} (supported: default, linear, llama3)"
            )),
        }
    }
}

fn de_rope_scaling<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<RopeScaling>, D::Error> {
    match Option::<RawRopeScaling>::deserialize(d)? {
        None => Ok(None),
        Some(raw) => raw.resolve().map_err(serde::de::Error::custom),
    }
}

fn ser_rope_scaling<S: Serializer>(
    v: &Option<RopeScaling>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    match v {
        None => s.serialize_none(),
        Some(RopeScaling::Linear { factor }) => {
            let mut m = s.serialize_map(Some(2))?;
            m.serialize_entry("rope_type", "linear")?;
            m.serialize_entry("factor", factor)?;
            m.end()
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let mut m = s.serialize_map(Some(5))?;
            m.serialize_entry("rope_type", "llama3")?;
            m.serialize_entry("factor", factor)?;
            m.serialize_entry("low_freq_factor", low_freq_factor)?;
            m.serialize_entry("high_freq_factor", high_freq_factor)?;
            m.serialize_entry(
                "original_max_position_embeddings",
                original_max_position_embeddings,
            )?;
            m.end()
        }
    }
}

/// `eos_token_id` is a single id in most configs but a list in Llama 3.1 and later.
fn de_token_ids<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => Vec::new(),
        Some(OneOrMany::One(id)) => vec![id],
        Some(OneOrMany::Many(ids)) => ids,
    })
}

/// Whether `d` divides `n` (`d > 0`); spelled out because `is_multiple_of` is newer
/// than the workspace's minimum Rust version.
fn divides(d: usize, n: usize) -> bool {
    n / d * d == n
}

fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_rms_norm_eps() -> f64 {
    1e-6
}

/// A Llama-family decoder's hyper-parameters, as in a Hugging Face `config.json`.
///
/// Field names follow `config.json` so the struct (de)serializes directly; optional
/// fields whose default depends on other fields are resolved by the methods
/// ([`ModelConfig::head_dim`], [`ModelConfig::num_kv_heads`], ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// One of [`SUPPORTED_MODEL_TYPES`].
    pub model_type: String,
    /// Vocabulary size: rows of the embedding and of `lm_head`.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention); `None` means one per query head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; `None` means `hidden_size / num_attention_heads` (Qwen3 sets it explicitly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Epsilon inside every RMSNorm.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RoPE frequency scaling, if any.
    #[serde(
        default,
        deserialize_with = "de_rope_scaling",
        serialize_with = "ser_rope_scaling"
    )]
    pub rope_scaling: Option<RopeScaling>,
    /// Longest sequence (in tokens) the model accepts.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` reuses the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on the attention projections; `None` means the family default (see [`ModelConfig::qkv_bias`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Mistral's sliding attention window, in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
    /// Qwen's switch for its sliding window (off in every released Qwen2/Qwen3 config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Beginning-of-sequence token id, if the model has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token ids (`eos_token_id` may be one id or a list).
    #[serde(
        default,
        rename = "eos_token_id",
        deserialize_with = "de_token_ids",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// The default seeded model: tiny enough for exhaustive tests, same architecture as
    /// Llama 3 (GQA, Llama-3 RoPE scaling, tied embeddings). Its vocabulary of 320 covers
    /// kvfleet-core's byte tokenizer (256 bytes + specials, padded).
    ///
    /// RoPE scaling uses `original_max_position_embeddings = 1024` so that, with
    /// `head_dim` 16, all three frequency bands (kept, interpolated, scaled) occur.
    pub fn tiny() -> Self {
        Self {
            model_type: "llama".into(),
            vocab_size: 320,
            hidden_size: 64,
            intermediate_size: 176,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            head_dim: Some(16),
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 1024,
            }),
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            attention_bias: None,
            mlp_bias: false,
            sliding_window: None,
            use_sliding_window: None,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        }
    }

    /// A seeded model big enough that prefill has a real cost (~25M parameters): for
    /// benchmarks of chunked prefill, prefix reuse and batched decode.
    pub fn small() -> Self {
        Self {
            hidden_size: 512,
            intermediate_size: 1408,
            num_hidden_layers: 8,
            num_attention_heads: 8,
            num_key_value_heads: Some(4),
            head_dim: Some(64),
            max_position_embeddings: 32_768,
            rope_scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 4096,
            }),
            ..Self::tiny()
        }
    }

    /// Reads and validates a Hugging Face `config.json`.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text)
            .map_err(|e| EngineError::Config(format!("{}: {e}", path.display())))
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let config: Self = serde_json::from_str(text)
            .map_err(|e| EngineError::Config(format!("cannot parse config.json: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks that the dimensions are consistent and the family is supported.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(EngineError::Config(m));
        if !SUPPORTED_MODEL_TYPES.contains(&self.model_type.as_str()) {
            return err(format!(
                "unsupported model_type {:?} (supported: {})",
                self.model_type,
                SUPPORTED_MODEL_TYPES.join(", ")
            ));
        }
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads()),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return err(format!("{name} must be positive"));
            }
        }
        if self.head_dim.is_none() && !divides(self.num_attention_heads, self.hidden_size) {
            return err(format!(
                "hidden_size {} is not divisible by num_attention_heads {} (and head_dim is not given)",
                self.hidden_size, self.num_attention_heads
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || hd % 2 == 1 {
            return err(format!("head_dim must be positive and even, got {hd}"));
        }
        if !divides(self.num_kv_heads(), self.num_attention_heads) {
            return err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return err(format!("bad rms_norm_eps {}", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return err(format!("bad rope_theta {}", self.rope_theta));
        }
        if self.model_type.starts_with("qwen") && self.use_sliding_window == Some(true) {
            return err(
                "Qwen sliding-window attention (use_sliding_window: true) is not supported".into(),
            );
        }
        if self.sliding_window() == Some(0) {
            return err("sliding_window must be positive".into());
        }
        Ok(())
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Number of key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// End-of-sequence token ids (empty when the config names none).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_ids.clone()
    }

    /// Query heads that share one key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_kv_heads().max(1)
    }

    /// Whether q/k/v projections carry a bias: always in Qwen2, `attention_bias` elsewhere.
    pub fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2" || self.attention_bias.unwrap_or(false)
    }

    /// Whether `o_proj` carries a bias: `attention_bias` in Llama/Qwen3, never in Qwen2.
    pub fn o_bias(&self) -> bool {
        self.model_type != "qwen2" && self.attention_bias.unwrap_or(false)
    }

    /// Whether q and k get a per-head RMSNorm before RoPE (Qwen3). A checkpoint of
    /// another type that carries `q_norm`/`k_norm` weights also gets them (see `load`).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }

    /// The attention window, if attention is windowed: Mistral's `sliding_window`
    /// (Qwen's is rejected in [`ModelConfig::validate`] when switched on and ignored otherwise).
    pub fn sliding_window(&self) -> Option<usize> {
        if self.model_type == "mistral" {
            self.sliding_window
        } else {
            None
        }
    }

    /// Number of parameters (weights, biases and norms).
    pub fn num_parameters(&self) -> usize {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let q = self.num_attention_heads * hd;
        let kv = self.num_kv_heads() * hd;
        let mut layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h;
        if self.qkv_bias() {
            layer += q + 2 * kv;
        }
        if self.o_bias() {
            layer += h;
        }
        if self.mlp_bias {
            layer += 2 * i + h;
        }
        if self.qk_norm() {
            layer += 2 * hd;
        }
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_hidden_layers * layer + h + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate() {
        ModelConfig::tiny().validate().unwrap();
        ModelConfig::small().validate().unwrap();
        assert_eq!(ModelConfig::tiny().head_dim(), 16);
        assert_eq!(ModelConfig::small().head_dim(), 64);
        assert_eq!(ModelConfig::small().num_kv_heads(), 4);
    }

    #[test]
    fn parses_llama31_config() {
        let text = r#"{
            "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
            "intermediate_size": 14336, "max_position_embeddings": 131072, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "vocab_size": 128256
        }"#;
        let c = ModelConfig::from_json_str(text).unwrap();
        assert_eq!(c.head_dim(), 128);
        assert_eq!(c.num_kv_heads(), 8);
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        assert_eq!(c.bos_token_id, Some(128000));
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        assert!(!c.qkv_bias() && !c.qk_norm());
        // Round trip through our own serialization.
        let again = ModelConfig::from_json_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn parses_qwen_configs() {
        let qwen2 = r#"{"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "sliding_window": 32768, "use_sliding_window": false, "tie_word_embeddings": true,
            "vocab_size": 151936, "eos_token_id": 151643, "rope_scaling": null}"#;
        let c = ModelConfig::from_json_str(qwen2).unwrap();
        assert!(c.qkv_bias() && !c.o_bias() && !c.qk_norm());
        assert_eq!(c.sliding_window(), None);
        assert_eq!(c.eos_token_ids, vec![151643]);
        assert_eq!(c.rope_scaling, None);

        let qwen3 = r#"{"model_type": "qwen3", "hidden_size": 1024, "head_dim": 128,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "attention_bias": false, "tie_word_embeddings": true,
            "vocab_size": 151936}"#;
        let c = ModelConfig::from_json_str(qwen3).unwrap();
        assert_eq!(c.head_dim(), 128);
        assert!(c.qk_norm() && !c.qkv_bias());
    }

    #[test]
    fn rope_scaling_variants() {
        let base = |scaling: &str| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
                "vocab_size": 10, "rms_norm_eps": 1e-5, "rope_scaling": {scaling}}}"#
            )
        };
        // Old configs carry `type`, some carry both keys.
        let c = ModelConfig::from_json_str(&base(
            r#"{"type": "llama3", "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        ))
        .unwrap();
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        let c = ModelConfig::from_json_str(&base(r#"{"type": "linear", "factor": 2.0}"#)).unwrap();
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
        let e = ModelConfig::from_json_str(&base(r#"{"rope_type": "yarn", "factor": 4.0}"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unsupported rope_scaling type \"yarn\""), "{e}");
        let e = ModelConfig::from_json_str(&base(r#"{"rope_type": "llama3", "factor": 4.0}"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("low_freq_factor"), "{e}");
    }

    #[test]
    fn rejects_bad_configs() {
        let mut c = ModelConfig::tiny();
        c.model_type = "gpt2".into();
        assert!(c.validate().unwrap_err().to_string().contains("gpt2"));
        let mut c = ModelConfig::tiny();
        c.num_key_value_heads = Some(3);
        assert!(c.validate().is_err());
        let mut c = ModelConfig::tiny();
        c.head_dim = Some(15);
        assert!(c.validate().is_err());
    }
}
