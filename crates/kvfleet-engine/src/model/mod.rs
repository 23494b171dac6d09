//! The Llama-family decoder (Llama 3, Mistral, Qwen2, Qwen3) running over the paged
//! KV cache.
//!
//! Per layer: RMSNorm → fused q/k/v projection (+bias) → [Qwen3: per-head RMSNorm of q
//! and k] → RoPE → K/V written to their cache slots → causal GQA attention read through
//! the block tables → o_proj → residual → RMSNorm → SwiGLU MLP → residual; then the
//! final RMSNorm and `lm_head`, only for rows whose logits are wanted.
//!
//! All tokens of all sequences in a step go through each projection as one matrix
//! product: that is what makes continuous batching pay off on a CPU. Q4_0, Q4_1 and
//! Q8_0 weights are repacked ([`packed_quant`]) and multiplied by kernels whose sums for
//! a row do not depend on the other rows of the step ([`quant_dot`]), and attention
//! keeps the same property, so a prompt's logits are the same bits cold or cached.

pub(crate) mod attention;
pub(crate) mod ops;
pub(crate) mod packed_quant;
mod quant_dot;
pub(crate) mod rope;
mod seeded;
pub(crate) mod weights;

use std::cell::RefCell;
use std::ops::Range;
use std::path::Path;

use attention::{paged_attention, reference_attention, AttnBuffers, AttnGeom, AttnQuery, PagedKv};
use ops::{add_assign, rms_norm_rows, rms_norm_rows_in_place, silu_mul_rows};
use rope::{Rope, RopeTables};
use weights::{Layer, SafetensorsSource, Weights};

use crate::error::{EngineError, Result};
use crate::gguf::{self, GgufFile, GgufLoadOptions};
use crate::kv_cache::KvCache;
use crate::model_config::ModelConfig;

/// Which logits a [`ForwardItem`] wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRequest {
    /// None: a prefill chunk that is not the prompt's last.
    None,
    /// Only the last token's: the usual case, to sample the next token.
    Last,
    /// Every token's (scoring, prompt logprobs, tests).
    All,
}

/// One sequence's share of an engine step.
#[derive(Debug, Clone, Copy)]
pub struct ForwardItem<'a> {
    /// New tokens of this sequence to run now (a prefill chunk or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions below it are already in the KV cache.
    pub start_pos: usize,
    /// The sequence's blocks, covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [u32],
    /// Which logits to return.
    pub logits: LogitsRequest,
}

/// A Llama-family model with its weights in memory on the CPU: dense (f32, f16 or
/// bf16, as stored) or GGML-quantized (from a GGUF file).
#[derive(Debug, Clone)]
pub struct LlamaModel {
    config: ModelConfig,
    weights: Weights,
    rope: Rope,
    geom: AttnGeom,
}

/// Buffers a step reuses from the last one on the same thread, so the per-layer loop
/// allocates only what the matrix products return.
#[derive(Default)]
struct StepBuffers {
    /// RMSNorm output, the input of a projection.
    normed: Vec<f32>,
    /// SwiGLU activations.
    act: Vec<f32>,
    /// Attention output rows.
    attn: Vec<f32>,
    attn_bufs: AttnBuffers,
}

thread_local! {
    static STEP_BUFFERS: RefCell<StepBuffers> = RefCell::new(StepBuffers::default());
}

/// The weight files of a model directory: those named by the shard index when there is
/// one (Mistral repositories also hold a `consolidated.safetensors` with other names,
/// which must not be read), else every `*.safetensors` file, sorted.
fn safetensors_files(dir: &Path) -> Result<Vec<String>> {
    let io = |path: &Path, source| EngineError::Io {
        path: path.display().to_string(),
        source,
    };
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| io(&index_path, e))?;
        let index: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::Weights(format!("{}: {e}", index_path.display())))?;
        if let Some(map) = index.get("weight_map").and_then(|m| m.as_object()) {
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            if !names.is_empty() {
                return Ok(names);
            }
        }
    }
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            names.push(name);
        }
    }
    names.sort();
    if names.is_empty() {
        return Err(EngineError::Weights(format!(
            "no *.safetensors files in {}",
            dir.display()
        )));
    }
    Ok(names)
}

/// Where one item's rows sit in the step's batch.
struct Plan<'a> {
    item: &'a ForwardItem<'a>,
    /// Rows of the batch holding its tokens.
    rows: Range<usize>,
    /// Its rows that need logits (a suffix of `rows`).
    logit_rows: Range<usize>,
}

impl LlamaModel {
    /// A model with deterministic weights: the same `config` and `seed` give
    /// bit-identical weights on every machine.
    pub fn seeded(config: ModelConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let weights = Weights::build(&config, &mut seeded::SeededSource { seed })?;
        Ok(Self::assemble(config, weights))
    }

    /// Loads a Hugging Face model directory: `config.json` and the `*.safetensors` files
    /// (sharded checkpoints included: the shards named by `model.safetensors.index.json`
    /// when there is one, else every `*.safetensors` file). The files are memory-mapped
    /// while the weights are copied out; f16 and bf16 matrices stay in their dtype
    /// (norms and biases become f32).
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_json_file(dir.join("config.json"))?;
        let io = |path: &Path, source| EngineError::Io {
            path: path.display().to_string(),
            source,
        };
        let names = safetensors_files(dir)?;
        let mut maps = Vec::with_capacity(names.len());
        for name in names {
            let path = dir.join(&name);
            let file = std::fs::File::open(&path).map_err(|e| io(&path, e))?;
            // SAFETY: the mapping is read-only and dropped before this function returns;
            // a model file truncated by another process meanwhile is outside what any
            // loader can defend against (the same holds for candle's and vLLM's).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io(&path, e))?;
            maps.push((name, map));
        }
        let mut src = SafetensorsSource::new(dir, &maps)?;
        let weights = Weights::build(&config, &mut src)?;
        Ok(Self::assemble(config, weights))
    }

    /// Loads a GGUF model (a `.gguf` file, or a directory holding exactly one):
    /// configuration from the metadata, weights kept in their GGML types (or all
    /// dequantized to f32 with [`GgufLoadOptions::dequantize`]). Returns the opened
    /// file too, whose metadata holds the tokenizer and chat template.
    pub fn load_gguf(path: &Path, opts: GgufLoadOptions) -> Result<(Self, GgufFile)> {
        let file = GgufFile::open(path)?;
        let model = Self::from_gguf(&file, opts)?;
        Ok((model, file))
    }

    /// Builds the model held by an opened GGUF file (see [`LlamaModel::load_gguf`]).
    pub fn from_gguf(file: &GgufFile, opts: GgufLoadOptions) -> Result<Self> {
        let arch = gguf::config::arch_of(file)?;
        let config = gguf::config::model_config(file, arch)?;
        let weights = gguf::weights::build(file, arch, &config, opts)?;
        let factors = gguf::weights::rope_freq_factors(file, &config)?;
        let mut model = Self::assemble(config, weights);
        if let Some(f) = factors {
            model.rope.divide_frequencies(&f);
        }
        Ok(model)
    }

    fn assemble(config: ModelConfig, weights: Weights) -> Self {
        let geom = AttnGeom {
            n_heads: config.num_attention_heads,
            n_kv_heads: config.num_kv_heads(),
            head_dim: config.head_dim(),
            scale: 1.0 / (config.head_dim() as f32).sqrt(),
            window: config.sliding_window(),
        };
        Self {
            rope: Rope::new(&config),
            geom,
            config,
            weights,
        }
    }

    /// Writes this model as a Hugging Face directory: `config.json` and
    /// `model.safetensors` (f32). Creates `dir` if needed.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let io = |path: &Path, source| EngineError::Io {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let config_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&self.config)
            .map_err(|e| EngineError::Config(format!("cannot serialize config: {e}")))?;
        std::fs::write(&config_path, text).map_err(|e| io(&config_path, e))?;
        weights::write_safetensors(
            &dir.join("model.safetensors"),
            &self.weights.named_tensors()?,
        )
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The weights, for backends that copy them to their own memory.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn weights(&self) -> &Weights {
        &self.weights
    }

    /// RoPE inverse frequencies (rope scaling applied), `head_dim / 2` of them.
    // Read by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn rope_inv_freq(&self) -> &[f32] {
        self.rope.inv_freq()
    }

    /// A zeroed KV cache shaped for this model.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> KvCache {
        KvCache::new(
            self.config.num_hidden_layers,
            num_blocks,
            block_size,
            self.geom.n_kv_heads,
            self.geom.head_dim,
        )
    }

    /// One engine step: all items batched. Writes K/V of every new token into its slot,
    /// then each new token attends causally to positions `0..=` its own position, reading
    /// K/V through the block table. Returns, per item, logits rows flattened
    /// (`rows * vocab`): empty for [`LogitsRequest::None`], one row for
    /// [`LogitsRequest::Last`], `tokens.len()` rows for [`LogitsRequest::All`].
    ///
    /// Items must not write to the same slots. Errors (bad token id, short block table,
    /// block id out of range, position past `max_position_embeddings`, cache of another
    /// shape) are detected before anything is written.
    pub fn forward(&self, items: &[ForwardItem<'_>], kv: &mut KvCache) -> Result<Vec<Vec<f32>>> {
        STEP_BUFFERS.with(|b| match b.try_borrow_mut() {
            Ok(mut bufs) => self.forward_with(items, kv, &mut bufs),
            // Only reachable re-entrantly; fresh buffers keep that correct.
            Err(_) => self.forward_with(items, kv, &mut StepBuffers::default()),
        })
    }

    fn forward_with(
        &self,
        items: &[ForwardItem<'_>],
        kv: &mut KvCache,
        bufs: &mut StepBuffers,
    ) -> Result<Vec<Vec<f32>>> {
        self.check_cache(kv)?;
        let mut plans = Vec::with_capacity(items.len());
        let mut n = 0;
        for (i, item) in items.iter().enumerate() {
            self.check_item(i, item, kv)?;
            let t = item.tokens.len();
            let logit_rows = match item.logits {
                LogitsRequest::None => n + t..n + t,
                LogitsRequest::Last => n + t - 1..n + t,
                LogitsRequest::All => n..n + t,
            };
            plans.push(Plan {
                item,
                rows: n..n + t,
                logit_rows,
            });
            n += t;
        }
        if n == 0 {
            return Ok(vec![Vec::new(); items.len()]);
        }
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let tokens: Vec<u32> = plans
            .iter()
            .flat_map(|p| p.item.tokens.iter().copied())
            .collect();
        let positions = plans
            .iter()
            .flat_map(|p| p.item.start_pos..p.item.start_pos + p.item.tokens.len());
        let rope = self.rope.tables(positions);
        let mut x = self.weights.embed_rows(&tokens)?;
        let n_layers = self.weights.layers.len();
        let bs = kv.block_size();
        let (qd, kvd) = (self.geom.q_dim(), self.geom.kv_dim());
        // Every layer attends with all rows but the last, which needs only rows that
        // produce logits.
        let queries_for = |last: bool| -> Vec<AttnQuery<'_>> {
            plans
                .iter()
                .map(|p| {
                    let rows = if last {
                        p.logit_rows.clone()
                    } else {
                        p.rows.clone()
                    };
                    AttnQuery {
                        table: p.item.block_table,
                        first_pos: p.item.start_pos + (rows.start - p.rows.start),
                        rows,
                    }
                })
                .collect()
        };
        let all_queries = queries_for(false);
        let last_queries = queries_for(true);
        for (li, layer) in self.weights.layers.iter().enumerate() {
            let qkv = self.qkv_rows(layer, &x, n, &rope, &mut bufs.normed)?;
            let stride = qkv.len() / n;
            // Keys and values of every new token go to their slots first: a token's
            // attention reads its own and its predecessors' through the same path.
            // (Under the layer's write lock only while the slots are written: a block
            // reader on another thread may copy this layer during the attention.)
            kv.with_layer_mut(li, |lkv| {
                for p in &plans {
                    for (t, row) in p.rows.clone().enumerate() {
                        let pos = p.item.start_pos + t;
                        let slot = p.item.block_table[pos / bs] as usize * bs + pos % bs;
                        let src = &qkv[row * stride..(row + 1) * stride];
                        lkv.k[slot * kvd..(slot + 1) * kvd].copy_from_slice(&src[qd..qd + kvd]);
                        lkv.v[slot * kvd..(slot + 1) * kvd]
                            .copy_from_slice(&src[qd + kvd..qd + 2 * kvd]);
                    }
                }
            });
            let last = li + 1 == n_layers;
            let queries = if last { &last_queries } else { &all_queries };
            let m: usize = queries.iter().map(|q| q.rows.len()).sum();
            bufs.attn.clear();
            bufs.attn.resize(m * qd, 0.0);
            kv.with_layer(li, |lkv| {
                let paged = PagedKv {
                    k: &lkv.k,
                    v: &lkv.v,
                    block_size: bs,
                };
                paged_attention(
                    &self.geom,
                    &qkv,
                    stride,
                    queries,
                    paged,
                    &mut bufs.attn_bufs,
                    &mut bufs.attn,
                );
            });
            if last && m < n {
                let mut kept = Vec::with_capacity(m * h);
                for q in queries {
                    kept.extend_from_slice(&x[q.rows.start * h..q.rows.end * h]);
                }
                x = kept;
            }
            self.finish_layer(
                layer,
                &mut x,
                &bufs.attn,
                m,
                &mut bufs.normed,
                &mut bufs.act,
            )?;
        }
        // `x` now holds exactly the logit rows, in item order.
        let m = x.len() / h;
        let logits = self.logits(&x, m, &mut bufs.normed)?;
        let vocab = cfg.vocab_size;
        let mut out = Vec::with_capacity(items.len());
        let mut r = 0;
        for p in &plans {
            let k = p.logit_rows.len();
            out.push(logits[r * vocab..(r + k) * vocab].to_vec());
            r += k;
        }
        Ok(out)
    }

    /// Plain reference: contiguous (unpaged) full causal attention over `tokens` from
    /// position 0, written independently of the paged path (no block tables, f64
    /// softmax). Logits for every position.
    pub fn forward_reference(&self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let cfg = &self.config;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {t} is outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
        if tokens.len() > cfg.max_position_embeddings {
            return Err(EngineError::InvalidRequest(format!(
                "{} tokens exceed max_position_embeddings {}",
                tokens.len(),
                cfg.max_position_embeddings
            )));
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let (qd, kvd) = (self.geom.q_dim(), self.geom.kv_dim());
        let rope = self.rope.tables(0..n);
        let mut x = self.weights.embed_rows(tokens)?;
        let (mut normed, mut act) = (Vec::new(), Vec::new());
        for layer in &self.weights.layers {
            let qkv = self.qkv_rows(layer, &x, n, &rope, &mut normed)?;
            let stride = qkv.len() / n;
            let (mut q, mut k, mut v) = (
                Vec::with_capacity(n * qd),
                Vec::with_capacity(n * kvd),
                Vec::with_capacity(n * kvd),
            );
            for row in qkv.chunks_exact(stride) {
                q.extend_from_slice(&row[..qd]);
                k.extend_from_slice(&row[qd..qd + kvd]);
                v.extend_from_slice(&row[qd + kvd..qd + 2 * kvd]);
            }
            let attn = reference_attention(&self.geom, &q, &k, &v, n);
            self.finish_layer(layer, &mut x, &attn, n, &mut normed, &mut act)?;
        }
        let logits = self.logits(&x, n, &mut normed)?;
        Ok(logits
            .chunks_exact(cfg.vocab_size)
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// RMSNorm, fused q/k/v projection, optional q/k norm and RoPE for `n` rows of `x`.
    /// Returns rows `[q | k | v]`.
    fn qkv_rows(
        &self,
        layer: &Layer,
        x: &[f32],
        n: usize,
        rope: &RopeTables,
        normed: &mut Vec<f32>,
    ) -> Result<Vec<f32>> {
        let eps = self.config.rms_norm_eps as f32;
        normed.resize(x.len(), 0.0);
        rms_norm_rows(x, &layer.input_norm, eps, &mut normed[..x.len()]);
        let mut qkv = layer.qkv.forward(&normed[..x.len()], n)?;
        let stride = layer.qkv.out_dim();
        let (qd, kvd) = (self.geom.q_dim(), self.geom.kv_dim());
        for (r, row) in qkv.chunks_exact_mut(stride).enumerate() {
            let (q, rest) = row.split_at_mut(qd);
            let k = &mut rest[..kvd];
            if let Some((qn, kn)) = &layer.qk_norm {
                rms_norm_rows_in_place(q, qn, eps);
                rms_norm_rows_in_place(k, kn, eps);
            }
            rope.apply(r, q, self.geom.n_heads);
            rope.apply(r, k, self.geom.n_kv_heads);
        }
        Ok(qkv)
    }

    /// o_proj + residual, then the MLP block + residual, for `m` rows.
    fn finish_layer(
        &self,
        layer: &Layer,
        x: &mut [f32],
        attn: &[f32],
        m: usize,
        normed: &mut Vec<f32>,
        act: &mut Vec<f32>,
    ) -> Result<()> {
        if m == 0 {
            return Ok(());
        }
        let eps = self.config.rms_norm_eps as f32;
        let o = layer.o.forward(attn, m)?;
        add_assign(x, &o);
        normed.resize(x.len(), 0.0);
        rms_norm_rows(x, &layer.post_norm, eps, &mut normed[..x.len()]);
        let gu = layer.gate_up.forward(&normed[..x.len()], m)?;
        let inter = self.config.intermediate_size;
        act.resize(m * inter, 0.0);
        silu_mul_rows(&gu, inter, &mut act[..m * inter]);
        let d = layer.down.forward(&act[..m * inter], m)?;
        add_assign(x, &d);
        Ok(())
    }

    /// Final norm and `lm_head` for `m` rows.
    fn logits(&self, x: &[f32], m: usize, normed: &mut Vec<f32>) -> Result<Vec<f32>> {
        if m == 0 {
            return Ok(Vec::new());
        }
        normed.resize(x.len(), 0.0);
        rms_norm_rows(
            x,
            &self.weights.norm,
            self.config.rms_norm_eps as f32,
            &mut normed[..x.len()],
        );
        self.weights.lm_head.forward(&normed[..x.len()], m)
    }

    fn check_cache(&self, kv: &KvCache) -> Result<()> {
        if kv.num_layers() != self.config.num_hidden_layers
            || kv.n_kv_heads() != self.geom.n_kv_heads
            || kv.head_dim() != self.geom.head_dim
        {
            return Err(EngineError::InvalidRequest(format!(
                "KV cache shaped for {} layers x {} KV heads x {} dims, model needs {} x {} x {}",
                kv.num_layers(),
                kv.n_kv_heads(),
                kv.head_dim(),
                self.config.num_hidden_layers,
                self.geom.n_kv_heads,
                self.geom.head_dim
            )));
        }
        Ok(())
    }

    fn check_item(&self, i: usize, item: &ForwardItem<'_>, kv: &KvCache) -> Result<()> {
        self.check_item_for(i, item, kv.block_size(), kv.num_blocks())
    }

    /// Checks item `i` of a step against this model and a cache of `num_blocks` blocks of
    /// `block_size` tokens: what every backend checks before it writes anything.
    pub(crate) fn check_item_for(
        &self,
        i: usize,
        item: &ForwardItem<'_>,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<()> {
        let bad = |m: String| {
            Err(EngineError::InvalidRequest(format!(
                "forward item {i}: {m}"
            )))
        };
        let t = item.tokens.len();
        if t == 0 {
            if item.logits == LogitsRequest::Last {
                return bad("logits of the last token requested but there are no tokens".into());
            }
            return Ok(());
        }
        let vocab = self.config.vocab_size;
        if let Some(&tok) = item.tokens.iter().find(|&&tok| tok as usize >= vocab) {
            return bad(format!(
                "token id {tok} is outside the vocabulary of {vocab}"
            ));
        }
        let end = item.start_pos + t;
        if end > self.config.max_position_embeddings {
            return bad(format!(
                "positions up to {end} exceed max_position_embeddings {}",
                self.config.max_position_embeddings
            ));
        }
        let needed = end.div_ceil(block_size);
        if item.block_table.len() < needed {
            return bad(format!(
                "block table of {} blocks cannot hold {end} positions (block size {block_size})",
                item.block_table.len(),
            ));
        }
        if let Some(&b) = item.block_table[..needed]
            .iter()
            .find(|&&b| b as usize >= num_blocks)
        {
            return bad(format!(
                "block id {b} outside a cache of {num_blocks} blocks"
            ));
        }
        Ok(())
    }
}
