//! Model weights: their in-memory layout, how they are assembled from Hugging Face
//! tensor names (out of safetensors files or the seeded generator), and how they are
//! written back.
//!
//! Projections are kept as contiguous `[out, in]` f32 matrices (Hugging Face layout,
//! which gemm reads well from either side of a product, so nothing is re-laid out per
//! call); q/k/v and gate/up are each fused into one matrix so a layer runs four matrix
//! products, not seven.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{CpuStorage, Device, Storage, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::ops::add_assign;
use crate::error::{EngineError, Result};
use crate::model_config::ModelConfig;

/// A tensor under its Hugging Face name: (name, shape, row-major f32 data).
pub(crate) type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// One projection of a fused [`Linear`]: `[out, in]` weights and optional bias.
type Part = (Vec<f32>, Option<Vec<f32>>);

/// What a tensor is, which decides how the seeded generator fills it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A projection `[out, in]`.
    Matrix,
    /// The token embedding `[vocab, hidden]`.
    Embedding,
    /// A bias vector.
    Bias,
    /// An RMSNorm weight.
    Norm,
}

/// Where named tensors come from.
pub(crate) trait WeightSource {
    /// The tensor `name` in row-major f32, checked against `shape`; `Ok(None)` when
    /// absent. `required` tells generators whether to invent it.
    fn fetch(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: Kind,
        required: bool,
    ) -> Result<Option<Vec<f32>>>;

    /// Names the source in error messages.
    fn describe(&self) -> String;
}

fn require(
    src: &mut dyn WeightSource,
    name: &str,
    shape: &[usize],
    kind: Kind,
) -> Result<Vec<f32>> {
    src.fetch(name, shape, kind, true)?.ok_or_else(|| {
        EngineError::Weights(format!(
            "missing tensor {name} (shape {shape:?}) in {}",
            src.describe()
        ))
    })
}

fn optional(
    src: &mut dyn WeightSource,
    name: &str,
    shape: &[usize],
    kind: Kind,
) -> Result<Option<Vec<f32>>> {
    src.fetch(name, shape, kind, false)
}

/// A tensor that must be present when `needed`, and is used when present otherwise.
fn maybe(
    src: &mut dyn WeightSource,
    needed: bool,
    name: &str,
    shape: &[usize],
    kind: Kind,
) -> Result<Option<Vec<f32>>> {
    if needed {
        require(src, name, shape, kind).map(Some)
    } else {
        optional(src, name, shape, kind)
    }
}

/// Batches up to this many rows are multiplied as `W·xᵀ` (weights as the long side of
/// the product), larger ones as `x·Wᵀ`: measured on candle's gemm, each orientation
/// is the faster one in its range (decode vs. prefill).
const SMALL_BATCH_ROWS: usize = 32;

/// A dense projection `y = x·Wᵀ (+ b)` with `W` stored contiguously `[out, in]` as in
/// Hugging Face, possibly fused from several projections stacked row-wise (`parts`
/// remembers their heights).
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    w: Tensor,
    bias: Option<Vec<f32>>,
    in_dim: usize,
    out_dim: usize,
    parts: Vec<usize>,
}

impl Linear {
    /// Stacks Hugging Face `[out_i, in]` matrices (and optional biases) into one `[Σ out_i, in]`.
    fn fused(mats: Vec<(Vec<f32>, usize, Option<Vec<f32>>)>, in_dim: usize) -> Result<Self> {
        let out_dim: usize = mats.iter().map(|m| m.1).sum();
        let any_bias = mats.iter().any(|m| m.2.is_some());
        let mut w = Vec::with_capacity(in_dim * out_dim);
        let mut bias = Vec::with_capacity(if any_bias { out_dim } else { 0 });
        let mut parts = Vec::with_capacity(mats.len());
        for (m, out, b) in mats {
            w.extend_from_slice(&m);
            if any_bias {
                match b {
                    Some(b) => bias.extend_from_slice(&b),
                    None => bias.resize(bias.len() + out, 0.0),
                }
            }
            parts.push(out);
        }
        Ok(Self {
            w: Tensor::from_vec(w, (out_dim, in_dim), &Device::Cpu)?,
            bias: any_bias.then_some(bias),
            in_dim,
            out_dim,
            parts,
        })
    }

    fn single(m: Vec<f32>, out: usize, in_dim: usize, bias: Option<Vec<f32>>) -> Result<Self> {
        Self::fused(vec![(m, out, bias)], in_dim)
    }

    /// A projection over an existing `[out, in]` tensor (the tied embedding).
    fn shared(w: Tensor) -> Result<Self> {
        let (out_dim, in_dim) = w.dims2()?;
        Ok(Self {
            w,
            bias: None,
            in_dim,
            out_dim,
            parts: vec![out_dim],
        })
    }

    /// `rows` rows of width `in_dim` through the projection, as one matrix product.
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let xt = Tensor::from_slice(x, (rows, self.in_dim), &Device::Cpu)?;
        let mut y = if rows <= SMALL_BATCH_ROWS {
            let yt = self.w.matmul(&xt.t()?)?.flatten_all()?.to_vec1::<f32>()?;
            let mut y = vec![0.0f32; rows * self.out_dim];
            for (o, col) in yt.chunks_exact(rows).enumerate() {
                for (r, v) in col.iter().enumerate() {
                    y[r * self.out_dim + o] = *v;
                }
            }
            y
        } else {
            xt.matmul(&self.w.t()?)?.flatten_all()?.to_vec1::<f32>()?
        };
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out_dim) {
                add_assign(row, b);
            }
        }
        Ok(y)
    }

    pub(crate) fn out_dim(&self) -> usize {
        self.out_dim
    }

    /// The `[out, in]` weights, row-major (a copy).
    pub(crate) fn weight_data(&self) -> Result<Vec<f32>> {
        Ok(self.w.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The bias, if this projection has one.
    pub(crate) fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// The Hugging Face `[out, in]` matrices and biases this projection was fused from.
    fn unfuse(&self) -> Result<Vec<Part>> {
        let w = self.w.flatten_all()?.to_vec1::<f32>()?;
        let mut res = Vec::with_capacity(self.parts.len());
        let mut off = 0;
        for &out in &self.parts {
            let m = w[off * self.in_dim..(off + out) * self.in_dim].to_vec();
            let b = self.bias.as_ref().map(|b| b[off..off + out].to_vec());
            res.push((m, b));
            off += out;
        }
        Ok(res)
    }
}

/// Weights of one decoder layer.
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) input_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    /// q | k | v, fused.
    pub(crate) qkv: Linear,
    pub(crate) o: Linear,
    /// Qwen3's per-head RMSNorm weights (`head_dim` wide) for q and k.
    pub(crate) qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// gate | up, fused.
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
}

/// All weights of a model.
#[derive(Debug, Clone)]
pub(crate) struct Weights {
    /// `[vocab, hidden]`.
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    /// `[vocab, hidden]`; shares `embed`'s storage when tied.
    pub(crate) lm_head: Linear,
    pub(crate) tied: bool,
}

impl Weights {
    /// Assembles the weights `config` calls for from `src`, checking every shape.
    pub(crate) fn build(config: &ModelConfig, src: &mut dyn WeightSource) -> Result<Self> {
        let h = config.hidden_size;
        let hd = config.head_dim();
        let qd = config.num_attention_heads * hd;
        let kvd = config.num_kv_heads() * hd;
        let inter = config.intermediate_size;
        let vocab = config.vocab_size;

        let embed = require(
            src,
            "model.embed_tokens.weight",
            &[vocab, h],
            Kind::Embedding,
        )?;
        let embed = Tensor::from_vec(embed, (vocab, h), &Device::Cpu)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}.");
            let mut mat = |name: &str, out: usize, inp: usize| {
                require(src, &format!("{p}{name}.weight"), &[out, inp], Kind::Matrix)
            };
            let q = mat("self_attn.q_proj", qd, h)?;
            let k = mat("self_attn.k_proj", kvd, h)?;
            let v = mat("self_attn.v_proj", kvd, h)?;
            let o = mat("self_attn.o_proj", h, qd)?;
            let gate = mat("mlp.gate_proj", inter, h)?;
            let up = mat("mlp.up_proj", inter, h)?;
            let down = mat("mlp.down_proj", h, inter)?;
            let mut bias = |name: &str, needed: bool, n: usize| {
                maybe(src, needed, &format!("{p}{name}.bias"), &[n], Kind::Bias)
            };
            let qkv_b = config.qkv_bias();
            let (qb, kb, vb) = (
                bias("self_attn.q_proj", qkv_b, qd)?,
                bias("self_attn.k_proj", qkv_b, kvd)?,
                bias("self_attn.v_proj", qkv_b, kvd)?,
            );
            let ob = bias("self_attn.o_proj", config.o_bias(), h)?;
            let mlp_b = config.mlp_bias;
            let (gb, ub, db) = (
                bias("mlp.gate_proj", mlp_b, inter)?,
                bias("mlp.up_proj", mlp_b, inter)?,
                bias("mlp.down_proj", mlp_b, h)?,
            );
            let mut norm = |name: &str, needed: bool, n: usize| {
                maybe(src, needed, &format!("{p}{name}.weight"), &[n], Kind::Norm)
            };
            let qn = norm("self_attn.q_norm", config.qk_norm(), hd)?;
            let kn = norm("self_attn.k_norm", config.qk_norm(), hd)?;
            let qk_norm = match (qn, kn) {
                (Some(a), Some(b)) => Some((a, b)),
                (None, None) => None,
                _ => {
                    return Err(EngineError::Weights(format!(
                        "layer {i} has only one of self_attn.q_norm / self_attn.k_norm in {}",
                        src.describe()
                    )))
                }
            };
            let input_norm = require(src, &format!("{p}input_layernorm.weight"), &[h], Kind::Norm)?;
            let post_norm = require(
                src,
                &format!("{p}post_attention_layernorm.weight"),
                &[h],
                Kind::Norm,
            )?;
            layers.push(Layer {
                input_norm,
                post_norm,
                qkv: Linear::fused(vec![(q, qd, qb), (k, kvd, kb), (v, kvd, vb)], h)?,
                o: Linear::single(o, h, qd, ob)?,
                qk_norm,
                gate_up: Linear::fused(vec![(gate, inter, gb), (up, inter, ub)], h)?,
                down: Linear::single(down, h, inter, db)?,
            });
        }
        let norm = require(src, "model.norm.weight", &[h], Kind::Norm)?;
        let lm_head = if config.tie_word_embeddings {
            Linear::shared(embed.clone())?
        } else {
            let w = src
                .fetch("lm_head.weight", &[vocab, h], Kind::Matrix, true)?
                .ok_or_else(|| {
                    EngineError::Weights(format!(
                        "missing tensor lm_head.weight (shape {:?}) in {} (config has tie_word_embeddings: false)",
                        [vocab, h],
                        src.describe()
                    ))
                })?;
            Linear::single(w, vocab, h, None)?
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
            tied: config.tie_word_embeddings,
        })
    }

    /// The `[vocab, hidden]` embedding, row-major (a copy).
    pub(crate) fn embed_data(&self) -> Result<Vec<f32>> {
        Ok(self.embed.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Copies the embedding rows of `tokens` into a `tokens.len() × hidden` buffer.
    pub(crate) fn embed_rows(&self, tokens: &[u32], hidden: usize) -> Result<Vec<f32>> {
        with_f32(&self.embed, |e| {
            let mut x = Vec::with_capacity(tokens.len() * hidden);
            for &t in tokens {
                let t = t as usize;
                x.extend_from_slice(&e[t * hidden..(t + 1) * hidden]);
            }
            x
        })
    }

    /// Every tensor under its Hugging Face name, in Hugging Face layout.
    pub(crate) fn named_tensors(&self) -> Result<Vec<NamedTensor>> {
        let mut out = Vec::new();
        let (vocab, h) = self.embed.dims2()?;
        out.push((
            "model.embed_tokens.weight".to_string(),
            vec![vocab, h],
            self.embed.flatten_all()?.to_vec1::<f32>()?,
        ));
        let push_linear = |out: &mut Vec<_>, names: &[&str], lin: &Linear| -> Result<()> {
            for ((m, b), (name, &rows)) in
                lin.unfuse()?.into_iter().zip(names.iter().zip(&lin.parts))
            {
                out.push((format!("{name}.weight"), vec![rows, lin.in_dim], m));
                if let Some(b) = b {
                    out.push((format!("{name}.bias"), vec![rows], b));
                }
            }
            Ok(())
        };
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}.");
            let n = |s: &str| format!("{p}{s}");
            push_linear(
                &mut out,
                &[
                    &n("self_attn.q_proj"),
                    &n("self_attn.k_proj"),
                    &n("self_attn.v_proj"),
                ],
                &l.qkv,
            )?;
            push_linear(&mut out, &[&n("self_attn.o_proj")], &l.o)?;
            push_linear(
                &mut out,
                &[&n("mlp.gate_proj"), &n("mlp.up_proj")],
                &l.gate_up,
            )?;
            push_linear(&mut out, &[&n("mlp.down_proj")], &l.down)?;
            if let Some((qn, kn)) = &l.qk_norm {
                out.push((n("self_attn.q_norm.weight"), vec![qn.len()], qn.clone()));
                out.push((n("self_attn.k_norm.weight"), vec![kn.len()], kn.clone()));
            }
            out.push((n("input_layernorm.weight"), vec![h], l.input_norm.clone()));
            out.push((
                n("post_attention_layernorm.weight"),
                vec![h],
                l.post_norm.clone(),
            ));
        }
        out.push(("model.norm.weight".to_string(), vec![h], self.norm.clone()));
        if !self.tied {
            push_linear(&mut out, &["lm_head"], &self.lm_head)?;
        }
        Ok(out)
    }
}

/// Runs `f` on the f32 data of a contiguous CPU tensor without copying it.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(data)), Some((a, b))) => Ok(f(&data[a..b])),
        _ => Err(EngineError::Weights(
            "internal: expected a contiguous f32 CPU tensor".into(),
        )),
    }
}

/// Decodes little-endian tensor bytes of a supported float type to f32.
pub(crate) fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        _ => return None,
    })
}

/// Tensors of one or more parsed safetensors files.
pub(crate) struct SafetensorsSource<'a> {
    dir: PathBuf,
    files: Vec<(String, SafeTensors<'a>)>,
    index: HashMap<String, usize>,
}

impl<'a> SafetensorsSource<'a> {
    /// Parses `buffers` (file name, bytes) and indexes their tensor names.
    pub(crate) fn new(dir: &Path, buffers: &'a [(String, Vec<u8>)]) -> Result<Self> {
        let mut files = Vec::with_capacity(buffers.len());
        let mut index = HashMap::new();
        for (i, (name, bytes)) in buffers.iter().enumerate() {
            let st = SafeTensors::deserialize(bytes).map_err(|e| {
                EngineError::Weights(format!(
                    "{}: not a safetensors file: {e}",
                    dir.join(name).display()
                ))
            })?;
            for t in st.names() {
                if let Some(prev) = index.insert(t.to_string(), i) {
                    return Err(EngineError::Weights(format!(
                        "tensor {t} appears in both {} and {name}",
                        buffers[prev].0
                    )));
                }
            }
            files.push((name.clone(), st));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            index,
        })
    }
}

impl WeightSource for SafetensorsSource<'_> {
    fn fetch(
        &mut self,
        name: &str,
        shape: &[usize],
        _kind: Kind,
        _required: bool,
    ) -> Result<Option<Vec<f32>>> {
        let Some(&i) = self.index.get(name) else {
            return Ok(None);
        };
        let (file, st) = &self.files[i];
        let view = st
            .tensor(name)
            .map_err(|e| EngineError::Weights(format!("tensor {name} in {file}: {e}")))?;
        if view.shape() != shape {
            return Err(EngineError::Weights(format!(
                "tensor {name} in {file}: expected shape {shape:?}, found {:?}",
                view.shape()
            )));
        }
        to_f32(view.dtype(), view.data()).map(Some).ok_or_else(|| {
            EngineError::Weights(format!(
                "tensor {name} in {file}: unsupported dtype {:?} (expected F32, F16 or BF16)",
                view.dtype()
            ))
        })
    }

    fn describe(&self) -> String {
        format!("the safetensors files of {}", self.dir.display())
    }
}

/// Writes `tensors` (f32) as one safetensors file.
pub(crate) fn write_safetensors(path: &Path, tensors: &[NamedTensor]) -> Result<()> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| d.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, shape, _), b) in tensors.iter().zip(&bytes) {
        let view = TensorView::new(Dtype::F32, shape.clone(), b)
            .map_err(|e| EngineError::Weights(format!("tensor {name}: {e}")))?;
        views.push((name.clone(), view));
    }
    let mut metadata = HashMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    safetensors::tensor::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| EngineError::Weights(format!("writing {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_half_types() {
        let vals = [1.5f32, -0.25, 3.0];
        let f16: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(to_f32(Dtype::F16, &f16).unwrap(), vals);
        assert_eq!(to_f32(Dtype::BF16, &bf16).unwrap(), vals);
        assert_eq!(to_f32(Dtype::F32, &f32b).unwrap(), vals);
        assert!(to_f32(Dtype::I64, &f32b).is_none());
    }

    #[test]
    fn fused_linear_round_trips_and_multiplies() {
        // Two HF matrices [2,3] and [1,3], one with a bias.
        let a = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = vec![-1.0, 0.5, 2.0];
        let lin = Linear::fused(
            vec![(a.clone(), 2, None), (b.clone(), 1, Some(vec![10.0]))],
            3,
        )
        .unwrap();
        let y = lin.forward(&[1.0, 1.0, 1.0, 0.0, 1.0, 0.0], 2).unwrap();
        assert_eq!(y, vec![6.0, 15.0, 11.5, 2.0, 5.0, 10.5]);
        let parts = lin.unfuse().unwrap();
        assert_eq!(parts[0], (a, Some(vec![0.0, 0.0])));
        assert_eq!(parts[1], (b, Some(vec![10.0])));
    }
}
