//! [`ModelConfig`] from a GGUF file's metadata (`{arch}.block_count`,
//! `{arch}.embedding_length`, ...), for the architectures the decoder runs.

use super::GgufFile;
use crate::error::{EngineError, Result};
use crate::model_config::{ModelConfig, RopeScaling};

/// The `general.architecture` values this engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    /// Llama 1–3, Mistral, SmolLM, TinyLlama: llama.cpp's converter permuted the rows
    /// of `attn_q` / `attn_k` for its interleaved rotary layout.
    Llama,
    /// Qwen2 / Qwen2.5: q/k/v biases, rotate-half RoPE, no permutation.
    Qwen2,
    /// Qwen3: per-head q/k RMSNorm, explicit head width, no permutation.
    Qwen3,
}

impl GgufArch {
    /// The architecture named by `general.architecture`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "qwen3" => Some(Self::Qwen3),
            _ => None,
        }
    }

    /// Its name in GGUF metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// Whether `attn_q` / `attn_k` rows are stored in llama.cpp's interleaved rotary
    /// order and must be put back into Hugging Face's rotate-half order on load.
    /// (convert_hf_to_gguf.py permutes them for `LlamaModel` only; Qwen2 and Qwen3
    /// run NeoX-style rotary in llama.cpp and are written unpermuted.)
    pub fn permuted_qk(self) -> bool {
        self == Self::Llama
    }
}

/// The architecture of `file`, or an error naming it when unsupported.
pub(crate) fn arch_of(file: &GgufFile) -> Result<GgufArch> {
    let name = file.architecture()?;
    GgufArch::from_name(name).ok_or_else(|| {
        EngineError::Config(format!(
            "{}: unsupported architecture {name:?} (supported: llama, qwen2, qwen3)",
            file.path().display()
        ))
    })
}

/// Reads the decoder's hyper-parameters from `file`'s metadata; the vocabulary size
/// is the embedding's row count.
pub(crate) fn model_config(file: &GgufFile, arch: GgufArch) -> Result<ModelConfig> {
    let a = arch.name();
    let key = |k: &str| format!("{a}.{k}");
    let err = |m: String| EngineError::Config(format!("{}: {m}", file.path().display()));
    let hidden = file.uint(&key("embedding_length"))?;
    let heads = file.uint(&key("attention.head_count"))?;
    let kv_heads = match file.opt_uint(&key("attention.head_count_kv"))? {
        Some(n) => usize::try_from(n).map_err(|_| err(format!("head_count_kv {n}")))?,
        None => heads,
    };
    let key_len = file.opt_uint(&key("attention.key_length"))?;
    let value_len = file.opt_uint(&key("attention.value_length"))?;
    if let (Some(k), Some(v)) = (key_len, value_len) {
        if k != v {
            return Err(err(format!(
                "attention.key_length {k} differs from value_length {v}, which the decoder does not support"
            )));
        }
    }
    let head_dim = match key_len {
        Some(k) => usize::try_from(k).map_err(|_| err(format!("key_length {k}")))?,
        None if heads > 0 => hidden / heads,
        None => 0,
    };
    if let Some(rot) = file.opt_uint(&key("rope.dimension_count"))? {
        if rot != head_dim as u64 {
            return Err(err(format!(
                "rope.dimension_count {rot} differs from the head width {head_dim} (partial rotary is not supported)"
            )));
        }
    }
    let vocab = match file.tensor_shape("token_embd.weight") {
        Some(&[rows, width]) if width == hidden => rows,
        Some(s) => {
            return Err(err(format!(
                "token_embd.weight has shape {s:?}, expected [vocab, {hidden}]"
            )))
        }
        None => return Err(err("missing tensor token_embd.weight".into())),
    };
    let rope_scaling = match file.get(&key("rope.scaling.type")) {
        None => None,
        Some(_) => match file.str(&key("rope.scaling.type"))? {
            "none" => None,
            "linear" => {
                let factor = file
                    .opt_float(&key("rope.scaling.factor"))?
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| err("linear rope scaling without a positive factor".into()))?;
                // llama.cpp writes factor 1 for "no scaling" in some files.
                (factor != 1.0).then_some(RopeScaling::Linear { factor })
            }
            other => {
                return Err(err(format!(
                    "unsupported rope scaling {other:?} (supported: none, linear, and Llama 3's rope_freqs tensor)"
                )))
            }
        },
    };
    let has = |n: &str| file.has_tensor(n);
    let bos = file.opt_uint("tokenizer.ggml.bos_token_id")?;
    let eos = file.opt_uint("tokenizer.ggml.eos_token_id")?;
    let config = ModelConfig {
        model_type: a.to_string(),
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: file.uint(&key("feed_forward_length"))?,
        num_hidden_layers: file.uint(&key("block_count"))?,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: Some(head_dim),
        rms_norm_eps: file
            .opt_float(&key("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| {
                err(format!(
                    "metadata {a}.attention.layer_norm_rms_epsilon is missing"
                ))
            })?,
        rope_theta: file.opt_float(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_scaling,
        max_position_embeddings: file.uint(&key("context_length"))?,
        tie_word_embeddings: !has("output.weight"),
        attention_bias: Some(has("blk.0.attn_q.bias") && arch != GgufArch::Qwen2),
        mlp_bias: has("blk.0.ffn_up.bias"),
        sliding_window: None,
        use_sliding_window: None,
        bos_token_id: bos.and_then(|b| u32::try_from(b).ok()),
        eos_token_ids: eos
            .and_then(|e| u32::try_from(e).ok())
            .into_iter()
            .collect(),
    };
    config.validate().map_err(|e| err(e.to_string()))?;
    Ok(config)
}
