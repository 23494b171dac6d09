//! GGUF loading: synthetic files written from seeded models (the q/k permutation, the
//! metadata config, quantized matrices), the real SmolLM2 file, and corrupt input.

mod support;
use std::path::{Path, PathBuf};
use support::cosine;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kvfleet_engine::model::LlamaModel;
use kvfleet_engine::model_config::{ModelConfig, RopeScaling};
use kvfleet_engine::{GgufFile, GgufLoadOptions};
use safetensors::SafeTensors;

/// The real model, found as CI and `bash scripts/fetch-model.sh` lay it out.
fn real_model() -> PathBuf {
    kvfleet_engine::model_cache::default_model_file().unwrap_or_else(|e| panic!("{e}"))
}

fn prompt(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Hugging Face tensors of `model` (via its safetensors save).
fn hf_tensors(model: &LlamaModel) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let dir = tempfile::tempdir().unwrap();
    model.save(dir.path()).unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let data = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, v.shape().to_vec(), data)
        })
        .collect()
}

/// The GGUF name of a Hugging Face tensor name.
fn gguf_name(hf: &str) -> String {
    let map = [
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
    ];
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, rest) = rest.split_once('.').unwrap();
    for (from, to) in map {
        if let Some(suffix) = rest.strip_prefix(from) {
            return format!("blk.{layer}.{to}{suffix}");
        }
    }
    panic!("unmapped tensor {hf}");
}

/// llama.cpp's converter permutation of q/k rows (convert_hf_to_gguf.py `permute`):
/// `w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)`.
fn llama_cpp_permute(w: &[f32], rows: usize, n_head: usize) -> Vec<f32> {
    let width = w.len() / rows;
    let d = rows / n_head;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for i in 0..d / 2 {
            for j in 0..2 {
                let r = h * d + j * (d / 2) + i;
                out.extend_from_slice(&w[r * width..(r + 1) * width]);
            }
        }
    }
    out
}

struct Synth {
    arch: &'static str,
    /// Apply the converter's q/k permutation (llama does; qwen does not).
    permute: bool,
    matrix_type: GgmlDType,
}

/// Writes `model` as a GGUF file the way llama.cpp's converter lays one out.
fn write_gguf(path: &Path, model: &LlamaModel, s: &Synth) {
    let c = model.config();
    let hd = c.head_dim();
    let mut tensors = Vec::new();
    for (name, shape, data) in hf_tensors(model) {
        let gname = gguf_name(&name);
        let data = if s.permute && gname.ends_with("attn_q.weight") {
            llama_cpp_permute(&data, shape[0], c.num_attention_heads)
        } else if s.permute && gname.ends_with("attn_k.weight") {
            llama_cpp_permute(&data, shape[0], c.num_kv_heads())
        } else {
            data
        };
        let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).unwrap();
        let dtype = if shape.len() == 2 {
            s.matrix_type
        } else {
            GgmlDType::F32
        };
        tensors.push((gname, QTensor::quantize(&t, dtype).unwrap()));
    }
    // Llama 3 GGUFs carry their rope scaling as per-pair frequency divisors.
    if let Some(RopeScaling::Llama3 { .. }) = &c.rope_scaling {
        let plain = rope_inv_freq(c, false);
        let scaled = rope_inv_freq(c, true);
        let f: Vec<f32> = plain.iter().zip(&scaled).map(|(p, q)| p / q).collect();
        let t = Tensor::from_vec(f, hd / 2, &Device::Cpu).unwrap();
        tensors.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&t, GgmlDType::F32).unwrap(),
        ));
    }
    let a = s.arch;
    let u = |v: usize| Value::U32(v as u32);
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (format!("{a}.block_count"), u(c.num_hidden_layers)),
        (format!("{a}.embedding_length"), u(c.hidden_size)),
        (format!("{a}.feed_forward_length"), u(c.intermediate_size)),
        (
            format!("{a}.attention.head_count"),
            u(c.num_attention_heads),
        ),
        (format!("{a}.attention.head_count_kv"), u(c.num_kv_heads())),
        (format!("{a}.attention.key_length"), u(hd)),
        (format!("{a}.attention.value_length"), u(hd)),
        (format!("{a}.rope.dimension_count"), u(hd)),
        (
            format!("{a}.rope.freq_base"),
            Value::F32(c.rope_theta as f32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (format!("{a}.context_length"), u(c.max_position_embeddings)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

/// transformers' Llama 3 inverse frequencies (with or without the scaling), in f32.
fn rope_inv_freq(c: &ModelConfig, scaled: bool) -> Vec<f32> {
    let d = c.head_dim();
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / c.rope_theta.powf((2 * i) as f64 / d as f64);
            let f = match (&c.rope_scaling, scaled) {
                (
                    Some(RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings,
                    }),
                    true,
                ) => {
                    let old = *original_max_position_embeddings as f64;
                    let wl = 2.0 * std::f64::consts::PI / f;
                    if wl < old / high_freq_factor {
                        f
                    } else if wl > old / low_freq_factor {
                        f / factor
                    } else {
                        let s = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - s) * f / factor + s * f
                    }
                }
                _ => f,
            };
            f as f32
        })
        .collect()
}

fn qwen3_tiny() -> ModelConfig {
    ModelConfig {
        model_type: "qwen3".into(),
        tie_word_embeddings: false,
        rope_scaling: None,
        rope_theta: 1_000_000.0,
        head_dim: Some(32),
        ..ModelConfig::tiny()
    }
}

fn logits(model: &LlamaModel, tokens: &[u32]) -> Vec<f32> {
    model.forward_reference(tokens).unwrap().concat()
}

#[test]
fn llama_gguf_unpermutes_q_and_k() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 11).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let synth = Synth {
        arch: "llama",
        permute: true,
        matrix_type: GgmlDType::F32,
    };
    write_gguf(&path, &model, &synth);
    let (loaded, file) = LlamaModel::load_gguf(&path, GgufLoadOptions::default()).unwrap();
    assert_eq!(file.architecture().unwrap(), "llama");
    let c = loaded.config();
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.num_hidden_layers,
            c.num_kv_heads(),
            c.head_dim()
        ),
        (320, 64, 2, 2, 16)
    );
    assert!(c.tie_word_embeddings);
    let tokens = prompt(30, 5, 320);
    let (want, got) = (logits(&model, &tokens), logits(&loaded, &tokens));
    // Only the rope frequencies differ (f32 divisors instead of the f64 formula).
    let diff = max_diff(&want, &got);
    assert!(diff < 1e-3 * max_abs(&want), "max diff {diff}");

    // The same file without the converter's permutation loads into a different model:
    // the test would catch an un-permute that is missing or applied twice.
    let unpermuted = dir.path().join("unpermuted.gguf");
    write_gguf(
        &unpermuted,
        &model,
        &Synth {
            permute: false,
            ..synth
        },
    );
    let (wrong, _) = LlamaModel::load_gguf(&unpermuted, GgufLoadOptions::default()).unwrap();
    let diff = max_diff(&want, &logits(&wrong, &tokens));
    assert!(diff > 0.05 * max_abs(&want), "max diff {diff}");
}

#[test]
fn qwen3_gguf_is_not_permuted_and_reads_key_length() {
    let model = LlamaModel::seeded(qwen3_tiny(), 12).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qwen3.gguf");
    write_gguf(
        &path,
        &model,
        &Synth {
            arch: "qwen3",
            permute: false,
            matrix_type: GgmlDType::F32,
        },
    );
    // A directory holding one .gguf names it too.
    let (loaded, _) = LlamaModel::load_gguf(dir.path(), GgufLoadOptions::default()).unwrap();
    assert_eq!(loaded.config().head_dim(), 32);
    assert!(!loaded.config().tie_word_embeddings);
    let tokens = prompt(30, 6, 320);
    assert_eq!(logits(&model, &tokens), logits(&loaded, &tokens));
}

#[test]
fn quantized_matrices_stay_close_and_dequantize_matches() {
    // Rows of every matrix must be whole Q8_0 blocks of 32.
    let config = ModelConfig {
        intermediate_size: 192,
        ..ModelConfig::tiny()
    };
    let model = LlamaModel::seeded(config, 13).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q8.gguf");
    write_gguf(
        &path,
        &model,
        &Synth {
            arch: "llama",
            permute: true,
            matrix_type: GgmlDType::Q8_0,
        },
    );
    let tokens = prompt(24, 7, 320);
    let want = logits(&model, &tokens);
    let (quant, _) = LlamaModel::load_gguf(&path, GgufLoadOptions::default()).unwrap();
    let (deq, _) = LlamaModel::load_gguf(&path, GgufLoadOptions { dequantize: true }).unwrap();
    let (q, d) = (logits(&quant, &tokens), logits(&deq, &tokens));
    assert!(cosine(&want, &q) > 0.999, "{}", cosine(&want, &q));
    assert!(cosine(&want, &d) > 0.999, "{}", cosine(&want, &d));
    // Quantized weights are dequantized tile by tile inside each product, so the
    // result is the dequantized model's up to f32 rounding.
    let diff = max_diff(&q, &d);
    assert!(diff < 1e-4 * max_abs(&d), "max diff {diff}");
}

// ---- the real file ----

#[test]
fn smollm2_config_and_forward() {
    let path = real_model();
    let (model, file) = LlamaModel::load_gguf(&path, GgufLoadOptions::default()).unwrap();
    let c = model.config();
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(c.num_hidden_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.num_attention_heads, 9);
    assert_eq!(c.num_kv_heads(), 3);
    assert_eq!(c.head_dim(), 64);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.intermediate_size, 1536);
    assert!(c.tie_word_embeddings);
    // "The capital of France is": each word is one token of the byte-level BPE
    // vocabulary (Ġ marks a leading space); the next token should be " Paris".
    let vocab = match file.get("tokenizer.ggml.tokens") {
        Some(Value::Array(v)) => v,
        other => panic!("tokenizer.ggml.tokens: {other:?}"),
    };
    let id = |s: &str| {
        vocab
            .iter()
            .position(|v| matches!(v, Value::String(t) if t == s))
            .unwrap_or_else(|| panic!("{s} not in the vocabulary")) as u32
    };
    let tokens: Vec<u32> = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
        .map(id)
        .to_vec();
    for l in [
        model.forward_reference(&tokens).unwrap(),
        LlamaModel::load_gguf(&path, GgufLoadOptions { dequantize: true })
            .unwrap()
            .0
            .forward_reference(&tokens)
            .unwrap(),
    ] {
        let last = l.last().unwrap();
        let best = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap();
        assert_eq!(best as u32, id("ĠParis"), "argmax {best}");
    }
}

// ---- bad input ----

fn load_err(path: &Path) -> String {
    match LlamaModel::load_gguf(path, GgufLoadOptions::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn truncated_and_corrupt_files_are_errors_naming_the_file() {
    let real = std::fs::read(real_model()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    let name = path.display().to_string();
    // Cut inside the magic, the metadata, the tensor table and the tensor data.
    for cut in [
        0usize,
        3,
        20,
        1000,
        100_000,
        2_000_000,
        real.len() / 2,
        real.len() - 1,
    ] {
        std::fs::write(&path, &real[..cut]).unwrap();
        let e = load_err(&path);
        assert!(e.contains(&name), "cut at {cut}: {e}");
        assert!(
            e.contains("truncated") || e.contains("not a GGUF file"),
            "cut at {cut}: {e}"
        );
    }
    // Header fields overwritten with huge or impossible values.
    let mut cases: Vec<(&str, Vec<u8>, &str)> = Vec::new();
    let mut bad_magic = real.clone();
    bad_magic[0] = b'X';
    cases.push(("magic", bad_magic, "not a GGUF file"));
    let mut version = real.clone();
    version[4..8].copy_from_slice(&99u32.to_le_bytes());
    cases.push(("version", version, "unsupported GGUF version 99"));
    let mut tensor_count = real.clone();
    tensor_count[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("tensor count", tensor_count, "corrupt"));
    let mut kv_count = real.clone();
    kv_count[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    cases.push(("metadata count", kv_count, "corrupt"));
    // The first key's length (right after the counts).
    let mut key_len = real.clone();
    key_len[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    cases.push(("key length", key_len, "corrupt"));
    for (what, bytes, want) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let e = load_err(&path);
        assert!(e.contains(&name) && e.contains(want), "{what}: {e}");
    }
}

/// A minimal GGUF with the given metadata and tensors.
fn write_small(path: &Path, meta: &[(&str, Value)], tensors: &[(&str, QTensor)]) {
    let m: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let t: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &m, &t).unwrap();
}

#[test]
fn unsupported_architecture_type_and_missing_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let v = Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    write_small(
        &path,
        &[("general.architecture", Value::String("gpt2".into()))],
        &[(
            "token_embd.weight",
            QTensor::quantize(&v, GgmlDType::F32).unwrap(),
        )],
    );
    let e = load_err(&path);
    assert!(
        e.contains("unsupported architecture \"gpt2\"") && e.contains("m.gguf"),
        "{e}"
    );

    // A tensor of a type candle cannot read (IQ4_NL = 20): patch the type id of the
    // only tensor, which follows its name, dimension count and dimensions.
    write_small(
        &path,
        &[("general.architecture", Value::String("llama".into()))],
        &[(
            "token_embd.weight",
            QTensor::quantize(&v, GgmlDType::Q8_0).unwrap(),
        )],
    );
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .windows(17)
        .position(|w| w == b"token_embd.weight")
        .unwrap()
        + 17
        + 4
        + 16;
    assert_eq!(
        bytes[at..at + 4],
        8u32.to_le_bytes(),
        "found the Q8_0 type id"
    );
    bytes[at..at + 4].copy_from_slice(&20u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&path);
    assert!(
        e.contains("token_embd.weight") && e.contains("IQ4_NL") && e.contains("not supported"),
        "{e}"
    );

    // A real model file with a layer's tensor renamed away.
    let mut real = std::fs::read(real_model()).unwrap();
    let at = real
        .windows(19)
        .position(|w| w == b"blk.7.ffn_up.weight")
        .unwrap();
    real[at..at + 19].copy_from_slice(b"blk.7.ffn_XX.weight");
    std::fs::write(&path, &real).unwrap();
    let e = load_err(&path);
    assert!(
        e.contains("missing tensor blk.7.ffn_up.weight") && e.contains("m.gguf"),
        "{e}"
    );
}

#[test]
fn directories_must_hold_exactly_one_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let e = GgufFile::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("no *.gguf file"), "{e}");
    std::fs::write(dir.path().join("a.gguf"), b"GGUF").unwrap();
    std::fs::write(dir.path().join("b.gguf"), b"GGUF").unwrap();
    let e = GgufFile::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("2 *.gguf files") && e.contains("a.gguf, b.gguf"),
        "{e}"
    );
}
