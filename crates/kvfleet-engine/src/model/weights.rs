//! Model weights: their in-memory layout, how they are assembled from Hugging Face
//! tensor names (out of safetensors files or the seeded generator), and how they are
//! written back.
//!
//! Projections are kept as `[out, in]` matrices (Hugging Face layout, which gemm reads
//! well from either side of a product, so nothing is re-laid out per call): dense in
//! the dtype they were stored in (f32, f16, bf16), or GGML block-quantized as read from
//! a GGUF file ([`Matrix`]). q/k/v and gate/up are each fused into one matrix where
//! their storage types agree, so a layer runs four matrix products, not seven.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};

use super::packed_quant::{PackedQuant, QuantKind};
use super::quant_dot::quant_product;
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
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

    /// A matrix (`Kind::Matrix` or `Kind::Embedding`) as a tensor, in the dtype it is
    /// stored in where that is f16 or bf16 (f32 otherwise); `Ok(None)` when absent.
    fn fetch_matrix(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: Kind,
        required: bool,
    ) -> Result<Option<Tensor>> {
        match self.fetch(name, shape, kind, required)? {
            Some(v) => Ok(Some(Tensor::from_vec(v, shape, &Device::Cpu)?)),
            None => Ok(None),
        }
    }

    /// Names the source in error messages.
    fn describe(&self) -> String;
}

fn require_matrix(
    src: &mut dyn WeightSource,
    name: &str,
    shape: &[usize],
    kind: Kind,
) -> Result<Matrix> {
    match src.fetch_matrix(name, shape, kind, true)? {
        Some(t) => Ok(Matrix::Dense(t)),
        None => Err(EngineError::Weights(format!(
            "missing tensor {name} (shape {shape:?}) in {}",
            src.describe()
        ))),
    }
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

/// Rows of an f16/bf16 or quantized matrix widened to f32 at a time for one product: small enough
/// that the widened tile stays in cache, large enough that gemm runs at full speed.
const HALF_TILE_ROWS: usize = 256;

/// A weight matrix `[out, in]` (Hugging Face layout) in the form it is multiplied in.
#[derive(Debug, Clone)]
pub(crate) enum Matrix {
    /// Dense f32, f16 or bf16. Half types stay half in memory and are widened to f32
    /// tile by tile in each product, so activations keep f32 precision.
    Dense(Tensor),
    /// GGML block-quantized (as read from a GGUF file), in a type without a kernel of
    /// its own; dequantized a tile of rows at a time inside each product, never as a
    /// whole.
    Quant(Arc<QTensor>),
    /// Q4_0, Q4_1 or Q8_0, repacked for [`quant_product`], which multiplies straight
    /// from the blocks.
    Packed(Arc<PackedQuant>),
}

impl Matrix {
    /// A block-quantized matrix in the form it is multiplied in: packed for the types
    /// with a kernel, as it is otherwise.
    pub(crate) fn quantized(q: QTensor) -> Result<Matrix> {
        if let Some(kind) = QuantKind::of(q.dtype()) {
            let (out, inp) = q.shape().dims2()?;
            if let Some(p) = PackedQuant::pack(kind, &q.data()?, out, inp) {
                return Ok(Matrix::Packed(Arc::new(p)));
            }
        }
        Ok(Matrix::Quant(Arc::new(q)))
    }

    /// `(out, in)`.
    pub(crate) fn dims(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Matrix::Dense(t) => t.dims2()?,
            Matrix::Quant(q) => q.shape().dims2()?,
            Matrix::Packed(p) => p.dims(),
        })
    }

    /// What the matrix is stored as, for messages and tests (`f32`, `bf16`, `q4_1`...).
    pub(crate) fn storage_name(&self) -> String {
        match self {
            Matrix::Dense(t) => format!("{:?}", t.dtype()).to_lowercase(),
            Matrix::Quant(q) => format!("{:?}", q.dtype()).to_lowercase(),
            Matrix::Packed(p) => format!("{:?}", p.kind().dtype()).to_lowercase(),
        }
    }

    /// `x` (`rows × in`, row-major, `xt` its tensor form, made on first use) times
    /// `Wᵀ`: `rows × out`, row-major.
    fn forward(&self, x: &[f32], xt: &LazyTensor<'_>, rows: usize) -> Result<Vec<f32>> {
        match self {
            Matrix::Dense(w) if w.dtype() == DType::F32 => dense_product(w, xt.get()?, rows),
            Matrix::Dense(w) => {
                let (out, _) = w.dims2()?;
                widened_product(out, xt.get()?, rows, |start, n| {
                    Ok(w.narrow(0, start, n)?.to_dtype(DType::F32)?)
                })
            }
            // Activations keep (at least) 16 bits on both paths: candle's QMatMul
            // quantizes them to 8, and on SmolLM2 Q4_1 its logits' cosine to the
            // f32-dequantized reference fell to 0.9978 (the issue asks ≥ 0.999).
            // Straight from the blocks, for every row count: the same sums for a row
            // however many rows share its step, so a cached prompt answers as its cold
            // prefill did (quant_dot's docs).
            Matrix::Packed(p) => quant_product(p, x, rows)
                .ok_or_else(|| internal("activations do not fit a packed matrix")),
            Matrix::Quant(q) => {
                let (out, inp) = q.shape().dims2()?;
                let data = q.data()?;
                // Weight tiles dequantized to f32 (in cache), then gemm.
                let row_bytes = data.len() / out.max(1);
                widened_product(out, xt.get()?, rows, |start, n| {
                    let bytes = &data[start * row_bytes..(start + n) * row_bytes];
                    Ok(QTensor::new(quant_storage(bytes, q.dtype())?, (n, inp))?
                        .dequantize(&Device::Cpu)?)
                })
            }
        }
    }

    /// The whole matrix in f32, row-major (a copy).
    pub(crate) fn to_f32(&self) -> Result<Vec<f32>> {
        Ok(match self {
            Matrix::Dense(t) => t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            Matrix::Quant(q) => q
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?,
            Matrix::Packed(p) => {
                let (out, inp) = p.dims();
                let mut all = vec![0.0; out * inp];
                for (o, row) in all.chunks_exact_mut(inp.max(1)).enumerate() {
                    p.dequantize_row(o, row);
                }
                all
            }
        })
    }

    /// Rows `tokens` of the matrix, in f32, one after another. Quantized rows are
    /// dequantized one at a time: the matrix itself never exists in f32.
    pub(crate) fn gather_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (rows, width) = self.dims()?;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= rows) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {t} is outside the vocabulary of {rows}"
            )));
        }
        let mut x = Vec::with_capacity(tokens.len() * width);
        match self {
            Matrix::Dense(t) => {
                let (storage, layout) = t.storage_and_layout();
                let Some((a, b)) = layout.contiguous_offsets() else {
                    return Err(internal("embedding is not contiguous"));
                };
                let row = |t: u32| a + t as usize * width..a + (t as usize + 1) * width;
                match &*storage {
                    Storage::Cpu(CpuStorage::F32(d)) => {
                        for &t in tokens {
                            x.extend_from_slice(&d[..b][row(t)]);
                        }
                    }
                    Storage::Cpu(CpuStorage::F16(d)) => {
                        for &t in tokens {
                            x.extend(d[..b][row(t)].iter().map(|v| v.to_f32()));
                        }
                    }
                    Storage::Cpu(CpuStorage::BF16(d)) => {
                        for &t in tokens {
                            x.extend(d[..b][row(t)].iter().map(|v| v.to_f32()));
                        }
                    }
                    _ => return Err(internal("embedding is not f32/f16/bf16 on the CPU")),
                }
            }
            Matrix::Quant(q) => {
                let data = q.data()?;
                let row_bytes = data.len() / rows.max(1);
                for &t in tokens {
                    let t = t as usize;
                    let bytes = &data[t * row_bytes..(t + 1) * row_bytes];
                    let storage = quant_storage(bytes, q.dtype())?;
                    let row = QTensor::new(storage, (width,))?.dequantize(&Device::Cpu)?;
                    x.extend(row.to_vec1::<f32>()?);
                }
            }
            Matrix::Packed(p) => {
                for &t in tokens {
                    let at = x.len();
                    x.resize(at + width, 0.0);
                    p.dequantize_row(t as usize, &mut x[at..]);
                }
            }
        }
        Ok(x)
    }

    /// Stacks matrices of one storage type row-wise into one (`None` when their types
    /// differ: those stay separate products).
    fn stack(mats: &[&Matrix]) -> Result<Option<Matrix>> {
        match mats {
            [] => Ok(None),
            [one] => Ok(Some((*one).clone())),
            _ => {
                let name = mats[0].storage_name();
                if mats.iter().any(|m| m.storage_name() != name) {
                    return Ok(None);
                }
                if let Matrix::Quant(first) = mats[0] {
                    let in_dim = first.shape().dims2()?.1;
                    let mut bytes = Vec::new();
                    let mut out = 0;
                    for m in mats {
                        if let Matrix::Quant(q) = m {
                            bytes.extend_from_slice(&q.data()?);
                            out += q.shape().dims2()?.0;
                        }
                    }
                    let storage = quant_storage(&bytes, first.dtype())?;
                    return Ok(Some(Matrix::Quant(Arc::new(QTensor::new(
                        storage,
                        (out, in_dim),
                    )?))));
                }
                if let Matrix::Packed(_) = mats[0] {
                    let parts: Vec<&PackedQuant> = mats
                        .iter()
                        .filter_map(|m| match m {
                            Matrix::Packed(p) => Some(&**p),
                            _ => None,
                        })
                        .collect();
                    return Ok(PackedQuant::stacked(&parts).map(|p| Matrix::Packed(Arc::new(p))));
                }
                let ts: Vec<&Tensor> = mats
                    .iter()
                    .filter_map(|m| match m {
                        Matrix::Dense(t) => Some(t),
                        _ => None,
                    })
                    .collect();
                Ok(Some(Matrix::Dense(Tensor::cat(&ts, 0)?)))
            }
        }
    }
}

/// Quantized CPU storage holding a copy of `bytes`. Always pass borrowed bytes to
/// candle here: `QStorage::from_data` casts the slice, drops its argument, then copies
/// from the cast, so a `Cow::Owned` buffer is read after it was freed (candle 0.9.2).
pub(crate) fn quant_storage(bytes: &[u8], dtype: GgmlDType) -> Result<QStorage> {
    Ok(QStorage::from_data(
        Cow::Borrowed(bytes),
        &Device::Cpu,
        dtype,
    )?)
}

fn internal(what: &str) -> EngineError {
    EngineError::Weights(format!("internal: {what}"))
}

/// `x·Wᵀ` for a contiguous f32 `W`, in the orientation that is faster for `rows`.
/// A product's activations as a tensor, copied from the slice only when a segment
/// multiplies through candle (packed matrices read the slice itself).
struct LazyTensor<'a> {
    x: &'a [f32],
    shape: (usize, usize),
    tensor: std::cell::OnceCell<Tensor>,
}

impl LazyTensor<'_> {
    fn get(&self) -> Result<&Tensor> {
        if let Some(t) = self.tensor.get() {
            return Ok(t);
        }
        let t = Tensor::from_slice(self.x, self.shape, &Device::Cpu)?;
        Ok(self.tensor.get_or_init(|| t))
    }
}

fn dense_product(w: &Tensor, xt: &Tensor, rows: usize) -> Result<Vec<f32>> {
    let out = w.dim(0)?;
    if rows <= SMALL_BATCH_ROWS {
        let yt = w.matmul(&xt.t()?)?.flatten_all()?.to_vec1::<f32>()?;
        let mut y = vec![0.0f32; rows * out];
        for (o, col) in yt.chunks_exact(rows).enumerate() {
            for (r, v) in col.iter().enumerate() {
                y[r * out + o] = *v;
            }
        }
        Ok(y)
    } else {
        Ok(xt.matmul(&w.t()?)?.flatten_all()?.to_vec1::<f32>()?)
    }
}

/// `x·Wᵀ` for a `W` of `out` rows that `tile(start, n)` gives in f32, `HALF_TILE_ROWS`
/// rows at a time, so the widened copy stays in cache.
fn widened_product(
    out: usize,
    xt: &Tensor,
    rows: usize,
    mut tile: impl FnMut(usize, usize) -> Result<Tensor>,
) -> Result<Vec<f32>> {
    let mut y = vec![0.0f32; rows * out];
    let mut start = 0;
    while start < out {
        let n = HALF_TILE_ROWS.min(out - start);
        let yt = dense_product(&tile(start, n)?, xt, rows)?;
        scatter_columns(&yt, n, &mut y, out, start);
        start += n;
    }
    Ok(y)
}

/// Copies the `rows × n` block `src` into columns `start..start + n` of `dst` (`rows × width`).
fn scatter_columns(src: &[f32], n: usize, dst: &mut [f32], width: usize, start: usize) {
    for (s, d) in src.chunks_exact(n).zip(dst.chunks_exact_mut(width)) {
        d[start..start + n].copy_from_slice(s);
    }
}

/// A projection `y = x·Wᵀ (+ b)`, possibly fused from several projections stacked
/// row-wise (`parts` remembers their heights). Its rows are held by one matrix when
/// the parts share a storage type, else by one matrix per part (`segments`, whose
/// outputs are laid side by side).
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    segments: Vec<Matrix>,
    bias: Option<Vec<f32>>,
    in_dim: usize,
    out_dim: usize,
    parts: Vec<usize>,
}

impl Linear {
    /// Stacks `[out_i, in]` matrices (and optional biases) into one `[Σ out_i, in]`.
    pub(crate) fn from_parts(mats: Vec<(Matrix, Option<Vec<f32>>)>) -> Result<Self> {
        let Some(first) = mats.first() else {
            return Err(internal("a projection of no matrices"));
        };
        let in_dim = first.0.dims()?.1;
        let mut parts = Vec::with_capacity(mats.len());
        for (m, b) in &mats {
            let (out, inp) = m.dims()?;
            if inp != in_dim || b.as_ref().is_some_and(|b| b.len() != out) {
                return Err(internal("fused projections of different widths"));
            }
            parts.push(out);
        }
        let out_dim: usize = parts.iter().sum();
        let bias = mats.iter().any(|m| m.1.is_some()).then(|| {
            let mut bias = Vec::with_capacity(out_dim);
            for ((_, b), &out) in mats.iter().zip(&parts) {
                match b {
                    Some(b) => bias.extend_from_slice(b),
                    None => bias.resize(bias.len() + out, 0.0),
                }
            }
            bias
        });
        let refs: Vec<&Matrix> = mats.iter().map(|m| &m.0).collect();
        let segments = match Matrix::stack(&refs)? {
            Some(m) => vec![m],
            None => mats.into_iter().map(|m| m.0).collect(),
        };
        Ok(Self {
            segments,
            bias,
            in_dim,
            out_dim,
            parts,
        })
    }

    /// Stacks f32 Hugging Face `[out_i, in]` matrices (and optional biases) into one.
    #[cfg(test)]
    fn fused(mats: Vec<(Vec<f32>, usize, Option<Vec<f32>>)>, in_dim: usize) -> Result<Self> {
        let mut parts = Vec::with_capacity(mats.len());
        for (m, out, b) in mats {
            let t = Tensor::from_vec(m, (out, in_dim), &Device::Cpu)?;
            parts.push((Matrix::Dense(t), b));
        }
        Self::from_parts(parts)
    }

    /// `rows` rows of width `in_dim` through the projection, as one matrix product
    /// per segment.
    pub(crate) fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let xt = LazyTensor {
            x,
            shape: (rows, self.in_dim),
            tensor: std::cell::OnceCell::new(),
        };
        let mut y = if let [one] = self.segments.as_slice() {
            one.forward(x, &xt, rows)?
        } else {
            let mut y = vec![0.0f32; rows * self.out_dim];
            let mut start = 0;
            for seg in &self.segments {
                let n = seg.dims()?.0;
                scatter_columns(&seg.forward(x, &xt, rows)?, n, &mut y, self.out_dim, start);
                start += n;
            }
            y
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

    /// The matrices that hold the rows (one when fused).
    #[cfg(test)]
    pub(crate) fn segments(&self) -> &[Matrix] {
        &self.segments
    }

    /// The `[out, in]` weights, row-major f32 (a copy; dequantized when quantized).
    pub(crate) fn weight_data(&self) -> Result<Vec<f32>> {
        let mut w = Vec::with_capacity(self.out_dim * self.in_dim);
        for seg in &self.segments {
            w.extend(seg.to_f32()?);
        }
        Ok(w)
    }

    /// The bias, if this projection has one.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// The Hugging Face `[out, in]` matrices and biases this projection was fused from.
    fn unfuse(&self) -> Result<Vec<Part>> {
        let w = self.weight_data()?;
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
    pub(crate) embed: Matrix,
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

        let embed = require_matrix(
            src,
            "model.embed_tokens.weight",
            &[vocab, h],
            Kind::Embedding,
        )?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}.");
            let mut mat = |name: &str, out: usize, inp: usize| {
                require_matrix(src, &format!("{p}{name}.weight"), &[out, inp], Kind::Matrix)
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
                qkv: Linear::from_parts(vec![(q, qb), (k, kb), (v, vb)])?,
                o: Linear::from_parts(vec![(o, ob)])?,
                qk_norm,
                gate_up: Linear::from_parts(vec![(gate, gb), (up, ub)])?,
                down: Linear::from_parts(vec![(down, db)])?,
            });
        }
        let norm = require(src, "model.norm.weight", &[h], Kind::Norm)?;
        let lm_head = if config.tie_word_embeddings {
            Linear::from_parts(vec![(embed.clone(), None)])?
        } else {
            let w = src
                .fetch_matrix("lm_head.weight", &[vocab, h], Kind::Matrix, true)?
                .ok_or_else(|| {
                    EngineError::Weights(format!(
                        "missing tensor lm_head.weight (shape {:?}) in {} (config has tie_word_embeddings: false)",
                        [vocab, h],
                        src.describe()
                    ))
                })?;
            Linear::from_parts(vec![(Matrix::Dense(w), None)])?
        };
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
            tied: config.tie_word_embeddings,
        })
    }

    /// The `[vocab, hidden]` embedding, row-major f32 (a copy; dequantized when quantized).
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn embed_data(&self) -> Result<Vec<f32>> {
        self.embed.to_f32()
    }

    /// The embedding rows of `tokens`, in f32, as a `tokens.len() × hidden` buffer.
    pub(crate) fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.embed.gather_rows(tokens)
    }

    /// Every tensor under its Hugging Face name, in Hugging Face layout.
    pub(crate) fn named_tensors(&self) -> Result<Vec<NamedTensor>> {
        let mut out = Vec::new();
        let (vocab, h) = self.embed.dims()?;
        out.push((
            "model.embed_tokens.weight".to_string(),
            vec![vocab, h],
            self.embed.to_f32()?,
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
    /// Parses `buffers` (file name, bytes: memory-mapped files) and indexes their
    /// tensor names.
    pub(crate) fn new<B: AsRef<[u8]>>(dir: &Path, buffers: &'a [(String, B)]) -> Result<Self> {
        let mut files = Vec::with_capacity(buffers.len());
        let mut index = HashMap::new();
        for (i, (name, bytes)) in buffers.iter().enumerate() {
            let st = SafeTensors::deserialize(bytes.as_ref()).map_err(|e| {
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

impl<'a> SafetensorsSource<'a> {
    /// The view of tensor `name`, checked against `shape`, with its file's name.
    fn view(&self, name: &str, shape: &[usize]) -> Result<Option<(&str, TensorView<'a>)>> {
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
        Ok(Some((file, view)))
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
        let Some((file, view)) = self.view(name, shape)? else {
            return Ok(None);
        };
        to_f32(view.dtype(), view.data()).map(Some).ok_or_else(|| {
            EngineError::Weights(format!(
                "tensor {name} in {file}: unsupported dtype {:?} (expected F32, F16 or BF16)",
                view.dtype()
            ))
        })
    }

    fn fetch_matrix(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: Kind,
        required: bool,
    ) -> Result<Option<Tensor>> {
        let Some((_, view)) = self.view(name, shape)? else {
            return Ok(None);
        };
        // Half types are copied out of the mapping as they are (no f32 copy of the model).
        let dtype = match view.dtype() {
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::F32 => DType::F32,
            _ => {
                let v = self.fetch(name, shape, kind, required)?;
                return v
                    .map(|v| Ok(Tensor::from_vec(v, shape, &Device::Cpu)?))
                    .transpose();
            }
        };
        Ok(Some(Tensor::from_raw_buffer(
            view.data(),
            dtype,
            shape,
            &Device::Cpu,
        )?))
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

    fn cos(a: &[f32], b: &[f32]) -> f64 {
        let d: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum();
        let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
        let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum();
        d / (na.sqrt() * nb.sqrt())
    }

    #[test]
    fn quantized_linear_matches_its_dequantized_weights() {
        let (out, inp, rows) = (48, 256, 5);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
            .collect();
        let x: Vec<f32> = (0..rows * inp)
            .map(|i| (i * 13 % 29) as f32 / 14.0 - 1.0)
            .collect();
        let wt = Tensor::from_vec(w, (out, inp), &Device::Cpu).unwrap();
        for dt in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let q = Arc::new(QTensor::quantize(&wt, dt).unwrap());
            let deq = Matrix::Dense(q.dequantize(&Device::Cpu).unwrap());
            // Fused with a second part of the same type: one product.
            let quant = Linear::from_parts(vec![
                (
                    Matrix::quantized(QTensor::quantize(&wt, dt).unwrap()).unwrap(),
                    None,
                ),
                (
                    Matrix::quantized(QTensor::quantize(&wt, dt).unwrap()).unwrap(),
                    Some(vec![1.0; out]),
                ),
            ])
            .unwrap();
            assert_eq!(quant.segments().len(), 1, "{dt:?}");
            let dense =
                Linear::from_parts(vec![(deq.clone(), None), (deq, Some(vec![1.0; out]))]).unwrap();
            let (a, b) = (
                quant.forward(&x, rows).unwrap(),
                dense.forward(&x, rows).unwrap(),
            );
            // Activations stay f32: the product is the dequantized weights' product.
            assert!(cos(&a, &b) > 0.999_999, "{dt:?}: cosine {}", cos(&a, &b));
            // Rows dequantized on lookup are the dequantized matrix's rows.
            let rows_q = Matrix::quantized(QTensor::quantize(&wt, dt).unwrap())
                .unwrap()
                .gather_rows(&[3, 0, 47])
                .unwrap();
            let all = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let want: Vec<f32> = [3usize, 0, 47]
                .iter()
                .flat_map(|&r| all[r * inp..(r + 1) * inp].to_vec())
                .collect();
            assert_eq!(rows_q, want, "{dt:?}");
        }
        // Parts of different types stay separate products, laid side by side.
        let a = Matrix::quantized(QTensor::quantize(&wt, GgmlDType::Q8_0).unwrap()).unwrap();
        let b = Matrix::Dense(wt.to_dtype(DType::BF16).unwrap());
        let mixed = Linear::from_parts(vec![(a.clone(), None), (b.clone(), None)]).unwrap();
        assert_eq!(mixed.segments().len(), 2);
        let y = mixed.forward(&x, rows).unwrap();
        let ya = Linear::from_parts(vec![(a, None)])
            .unwrap()
            .forward(&x, rows)
            .unwrap();
        let yb = Linear::from_parts(vec![(b, None)])
            .unwrap()
            .forward(&x, rows)
            .unwrap();
        for r in 0..rows {
            assert_eq!(
                y[r * 2 * out..r * 2 * out + out],
                ya[r * out..(r + 1) * out]
            );
            assert_eq!(
                y[r * 2 * out + out..(r + 1) * 2 * out],
                yb[r * out..(r + 1) * out]
            );
        }
    }
}
