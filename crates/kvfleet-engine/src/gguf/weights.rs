//! A GGUF file's tensors as engine [`Weights`]: matrices stay in their GGML type (or
//! are dequantized to f32 on request), norms and biases become f32, and llama's q/k
//! rows are put back into Hugging Face order.

use std::fs::File;
use std::io::BufReader;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};

use super::config::GgufArch;
use super::{GgufFile, GgufLoadOptions};
use crate::error::{EngineError, Result};
use crate::model::weights::{quant_storage, Layer, Linear, Matrix, Weights};
use crate::model_config::ModelConfig;

/// The Hugging Face row that GGUF row `r` of a permuted `attn_q` / `attn_k` holds.
///
/// llama.cpp's converter reshapes each head's `d` rows as `[2, d/2]` and swaps the two
/// axes, so GGUF row `h·d + 2i + j` is Hugging Face row `h·d + j·d/2 + i`.
pub(crate) fn hf_row_of_gguf_row(r: usize, head_dim: usize) -> usize {
    let (h, within) = (r / head_dim, r % head_dim);
    let (i, j) = (within / 2, within % 2);
    h * head_dim + j * (head_dim / 2) + i
}

/// Reorders whole rows: row `hf_row_of_gguf_row(r)` of the result is row `r` of `rows`
/// (each `row_len` long). Works on quantized bytes because every row of a GGML
/// tensor is a whole number of blocks.
pub(crate) fn unpermute_rows<T: Copy>(rows: &[T], row_len: usize, head_dim: usize) -> Vec<T> {
    let n = rows.len() / row_len.max(1);
    let mut out = rows.to_vec();
    for r in 0..n {
        let dst = hf_row_of_gguf_row(r, head_dim);
        out[dst * row_len..(dst + 1) * row_len]
            .copy_from_slice(&rows[r * row_len..(r + 1) * row_len]);
    }
    out
}

/// Reads tensors of one file, checking shapes, in the form the options ask for.
struct Reader<'a> {
    file: &'a GgufFile,
    r: BufReader<File>,
    opts: GgufLoadOptions,
}

impl Reader<'_> {
    fn err(&self, m: String) -> EngineError {
        EngineError::Weights(format!("{}: {m}", self.file.path().display()))
    }

    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<QTensor> {
        let Some(found) = self.file.tensor_shape(name) else {
            return Err(self.err(format!("missing tensor {name} (shape {shape:?})")));
        };
        if found != shape {
            return Err(self.err(format!(
                "tensor {name}: expected shape {shape:?}, found {found:?}"
            )));
        }
        self.file.read_tensor(&mut self.r, name)
    }

    /// A vector (norm, bias) in f32.
    fn vector(&mut self, name: &str, n: usize) -> Result<Vec<f32>> {
        let q = self.tensor(name, &[n])?;
        Ok(q.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
    }

    fn opt_vector(&mut self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        if self.file.has_tensor(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A matrix `[out, in]`; with `permute_head` its rows are un-permuted for that head width.
    fn matrix(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
        permute_head: Option<usize>,
    ) -> Result<Matrix> {
        let q = self.tensor(name, &[out, inp])?;
        let q = match permute_head {
            None => q,
            Some(hd) => {
                if hd == 0 || out / hd * hd != out || hd / 2 * 2 != hd {
                    return Err(self.err(format!(
                        "tensor {name}: {out} rows do not split into heads of {hd}"
                    )));
                }
                let bytes = q.data()?;
                let row_bytes = bytes.len() / out;
                let fixed = unpermute_rows(&bytes[..], row_bytes, hd);
                let storage = quant_storage(&fixed, q.dtype())?;
                QTensor::new(storage, (out, inp))?
            }
        };
        self.matrix_of(q)
    }

    /// The form a read tensor is kept in: f32/f16/bf16 as dense tensors of that dtype,
    /// block types quantized (or all dequantized to f32 when the options say so).
    fn matrix_of(&self, q: QTensor) -> Result<Matrix> {
        let dense = |dt: DType| -> Result<Matrix> {
            let t = q.dequantize(&Device::Cpu)?;
            Ok(Matrix::Dense(t.to_dtype(dt)?))
        };
        match q.dtype() {
            _ if self.opts.dequantize => dense(DType::F32),
            GgmlDType::F32 => dense(DType::F32),
            GgmlDType::F16 => dense(DType::F16),
            GgmlDType::BF16 => dense(DType::BF16),
            _ => Matrix::quantized(q),
        }
    }
}

/// Reads every weight `config` calls for from `file`.
pub(crate) fn build(
    file: &GgufFile,
    arch: GgufArch,
    config: &ModelConfig,
    opts: GgufLoadOptions,
) -> Result<Weights> {
    let mut rd = Reader {
        file,
        r: file.reader()?,
        opts,
    };
    let h = config.hidden_size;
    let hd = config.head_dim();
    let qd = config.num_attention_heads * hd;
    let kvd = config.num_kv_heads() * hd;
    let inter = config.intermediate_size;
    let vocab = config.vocab_size;
    let permute = arch.permuted_qk().then_some(hd);

    let embed = rd.matrix("token_embd.weight", vocab, h, None)?;
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let p = |s: &str| format!("blk.{i}.{s}");
        let q = rd.matrix(&p("attn_q.weight"), qd, h, permute)?;
        let k = rd.matrix(&p("attn_k.weight"), kvd, h, permute)?;
        let v = rd.matrix(&p("attn_v.weight"), kvd, h, None)?;
        let o = rd.matrix(&p("attn_output.weight"), h, qd, None)?;
        let gate = rd.matrix(&p("ffn_gate.weight"), inter, h, None)?;
        let up = rd.matrix(&p("ffn_up.weight"), inter, h, None)?;
        let down = rd.matrix(&p("ffn_down.weight"), h, inter, None)?;
        let mut bias = |name: &str, needed: bool, n: usize, permute: Option<usize>| {
            let b = if needed {
                Some(rd.vector(&p(name), n)?)
            } else {
                rd.opt_vector(&p(name), n)?
            };
            Ok::<_, EngineError>(b.map(|b| match permute {
                Some(hd) => unpermute_rows(&b, 1, hd),
                None => b,
            }))
        };
        let qkv_b = config.qkv_bias();
        let qb = bias("attn_q.bias", qkv_b, qd, permute)?;
        let kb = bias("attn_k.bias", qkv_b, kvd, permute)?;
        let vb = bias("attn_v.bias", qkv_b, kvd, None)?;
        let ob = bias("attn_output.bias", config.o_bias(), h, None)?;
        let gb = bias("ffn_gate.bias", config.mlp_bias, inter, None)?;
        let ub = bias("ffn_up.bias", config.mlp_bias, inter, None)?;
        let db = bias("ffn_down.bias", config.mlp_bias, h, None)?;
        let qk_norm = if config.qk_norm() {
            Some((
                rd.vector(&p("attn_q_norm.weight"), hd)?,
                rd.vector(&p("attn_k_norm.weight"), hd)?,
            ))
        } else {
            None
        };
        layers.push(Layer {
            input_norm: rd.vector(&p("attn_norm.weight"), h)?,
            post_norm: rd.vector(&p("ffn_norm.weight"), h)?,
            qkv: Linear::from_parts(vec![(q, qb), (k, kb), (v, vb)])?,
            o: Linear::from_parts(vec![(o, ob)])?,
            qk_norm,
            gate_up: Linear::from_parts(vec![(gate, gb), (up, ub)])?,
            down: Linear::from_parts(vec![(down, db)])?,
        });
    }
    let norm = rd.vector("output_norm.weight", h)?;
    let lm_head = if config.tie_word_embeddings {
        // The quantized embedding itself serves as the output layer (shared, not copied).
        Linear::from_parts(vec![(embed.clone(), None)])?
    } else {
        Linear::from_parts(vec![(rd.matrix("output.weight", vocab, h, None)?, None)])?
    };
    Ok(Weights {
        embed,
        layers,
        norm,
        lm_head,
        tied: config.tie_word_embeddings,
    })
}

/// Llama 3's rotary frequency divisors (`rope_freqs.weight`, `head_dim / 2` of them),
/// if the file has them.
pub(crate) fn rope_freq_factors(file: &GgufFile, config: &ModelConfig) -> Result<Option<Vec<f32>>> {
    if !file.has_tensor("rope_freqs.weight") {
        return Ok(None);
    }
    let mut rd = Reader {
        file,
        r: file.reader()?,
        opts: GgufLoadOptions::default(),
    };
    rd.vector("rope_freqs.weight", config.head_dim() / 2)
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The converter's permutation, written as in convert_hf_to_gguf.py:
    /// `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`.
    fn llama_cpp_permute(hf: &[usize], n_head: usize) -> Vec<usize> {
        let d = hf.len() / n_head;
        let mut out = Vec::with_capacity(hf.len());
        for h in 0..n_head {
            for i in 0..d / 2 {
                for j in 0..2 {
                    out.push(hf[h * d + j * (d / 2) + i]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_the_converter() {
        for (n_head, d) in [(1, 4), (3, 8), (9, 64), (2, 128)] {
            let hf: Vec<usize> = (0..n_head * d).collect();
            let gguf = llama_cpp_permute(&hf, n_head);
            assert_ne!(gguf, hf, "the permutation is not the identity");
            assert_eq!(unpermute_rows(&gguf, 1, d), hf);
            // Whole rows of several elements move together.
            let wide: Vec<usize> = gguf.iter().flat_map(|&r| [r * 10, r * 10 + 1]).collect();
            let back = unpermute_rows(&wide, 2, d);
            let want: Vec<usize> = hf.iter().flat_map(|&r| [r * 10, r * 10 + 1]).collect();
            assert_eq!(back, want);
        }
        // The index form stated in the issue: GGUF row h·d + 2i + j is HF row h·d + j·d/2 + i.
        assert_eq!(hf_row_of_gguf_row(64 + 2 * 5 + 1, 64), 64 + 32 + 5);
        assert_eq!(hf_row_of_gguf_row(2 * 7, 64), 7);
    }
}
