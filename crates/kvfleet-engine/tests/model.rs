//! The Llama-family model over the paged KV cache: paged forward against the plain
//! reference, prefix-cache equivalence, architecture variants, checkpoint loading.

use std::collections::HashMap;
use std::path::Path;

use kvfleet_engine::kv_cache::KvCache;
use kvfleet_engine::model::{ForwardItem, LlamaModel, LogitsRequest};
use kvfleet_engine::model_config::ModelConfig;
use kvfleet_engine::EngineError;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

const BS: usize = 16;

/// Deterministic pseudo-random tokens.
fn prompt(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// A permutation of `0..n`: block tables with non-contiguous, non-monotonic ids.
fn shuffled_blocks(n: usize, seed: u64) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..n as u32).collect();
    let mut s = seed | 1;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ids.swap(i, (s % (i as u64 + 1)) as usize);
    }
    ids
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn qwen3_tiny() -> ModelConfig {
    ModelConfig {
        model_type: "qwen3".into(),
        tie_word_embeddings: false,
        rope_scaling: None,
        rope_theta: 1_000_000.0,
        // head_dim set explicitly and not hidden/heads, as in real Qwen3 configs.
        head_dim: Some(32),
        ..ModelConfig::tiny()
    }
}

fn variants() -> Vec<(&'static str, ModelConfig)> {
    vec![
        ("llama-gqa", ModelConfig::tiny()),
        (
            "llama-mha",
            ModelConfig {
                num_key_value_heads: None,
                ..ModelConfig::tiny()
            },
        ),
        ("qwen3", qwen3_tiny()),
        (
            "qwen2",
            ModelConfig {
                model_type: "qwen2".into(),
                rope_scaling: None,
                num_key_value_heads: Some(1),
                ..ModelConfig::tiny()
            },
        ),
        (
            "mistral-window",
            ModelConfig {
                model_type: "mistral".into(),
                rope_scaling: None,
                sliding_window: Some(40),
                ..ModelConfig::tiny()
            },
        ),
    ]
}

/// Runs `tokens` through the paged path in chunks of `chunk`, all logits.
fn run_chunked(
    model: &LlamaModel,
    tokens: &[u32],
    chunk: usize,
    table: &[u32],
    kv: &mut KvCache,
) -> Vec<f32> {
    let mut all = Vec::new();
    for start in (0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        let out = model
            .forward(
                &[ForwardItem {
                    tokens: &tokens[start..end],
                    start_pos: start,
                    block_table: table,
                    logits: LogitsRequest::All,
                }],
                kv,
            )
            .unwrap();
        all.extend_from_slice(&out[0]);
    }
    all
}

#[test]
fn paged_forward_matches_reference_for_every_chunking() {
    for (name, config) in variants() {
        let model = LlamaModel::seeded(config.clone(), 7).unwrap();
        // 300 tokens: 19 blocks, the last partial; one chunk spans two query tiles.
        let tokens = prompt(300, 1, config.vocab_size);
        let reference: Vec<f32> = model.forward_reference(&tokens).unwrap().concat();
        let num_blocks = 40;
        let table = shuffled_blocks(num_blocks, 99);
        for chunk in [300, 7, 1, 64] {
            let mut kv = model.new_kv_cache(num_blocks, BS);
            let paged = run_chunked(&model, &tokens, chunk, &table, &mut kv);
            let d = max_diff(&paged, &reference);
            assert!(d <= 1e-4, "{name}, chunks of {chunk}: max diff {d}");
        }
    }
}

#[test]
fn logits_are_not_trivially_flat() {
    // The seeded model must produce varied logits, or the numerics tests prove little.
    let model = LlamaModel::seeded(ModelConfig::tiny(), 7).unwrap();
    let logits = model.forward_reference(&prompt(20, 3, 320)).unwrap();
    let last = &logits[19];
    let max = last.iter().cloned().fold(f32::MIN, f32::max);
    let min = last.iter().cloned().fold(f32::MAX, f32::min);
    assert!(max - min > 2.0, "logit range {min}..{max}");
}

/// Logits of the last token of `tokens` with the first `cached_blocks` blocks computed
/// in an earlier step.
fn last_logits_with_cached_prefix(
    model: &LlamaModel,
    tokens: &[u32],
    cached_blocks: usize,
    table: &[u32],
) -> Vec<f32> {
    let mut kv = model.new_kv_cache(table.len(), BS);
    let split = cached_blocks * BS;
    if split > 0 {
        let out = model
            .forward(
                &[ForwardItem {
                    tokens: &tokens[..split],
                    start_pos: 0,
                    block_table: table,
                    logits: LogitsRequest::None,
                }],
                &mut kv,
            )
            .unwrap();
        assert!(out[0].is_empty());
    }
    model
        .forward(
            &[ForwardItem {
                tokens: &tokens[split..],
                start_pos: split,
                block_table: table,
                logits: LogitsRequest::Last,
            }],
            &mut kv,
        )
        .unwrap()
        .remove(0)
}

#[test]
fn cached_prefix_gives_the_same_logits_as_cold() {
    for (name, config) in variants() {
        let model = LlamaModel::seeded(config.clone(), 11).unwrap();
        let tokens = prompt(150, 5, config.vocab_size); // 9 full blocks + 6
        let table = shuffled_blocks(12, 3);
        let cold = last_logits_with_cached_prefix(&model, &tokens, 0, &table);
        assert_eq!(cold.len(), config.vocab_size);
        for k in [1, 4, 8, 9] {
            let warm = last_logits_with_cached_prefix(&model, &tokens, k, &table);
            let d = max_diff(&cold, &warm);
            assert!(d <= 1e-5, "{name}: {k} cached blocks: max diff {d}");
        }
    }
}

#[test]
fn batched_items_match_separate_runs() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 5).unwrap();
    let a = prompt(70, 1, 320);
    let b = prompt(33, 2, 320);
    let c = prompt(20, 3, 320);
    let tables = [vec![9u32, 2, 14, 0, 5], vec![1, 13, 7], vec![4, 11]];
    // Separately: each sequence alone in a fresh cache.
    let alone: Vec<Vec<f32>> = [&a, &b, &c]
        .iter()
        .zip(&tables)
        .map(|(t, table)| {
            let mut kv = model.new_kv_cache(16, BS);
            model
                .forward(
                    &[ForwardItem {
                        tokens: t,
                        start_pos: 0,
                        block_table: table,
                        logits: LogitsRequest::Last,
                    }],
                    &mut kv,
                )
                .unwrap()
                .remove(0)
        })
        .collect();
    // Together: c's prefix was cached earlier, so the step mixes two prefills and a
    // short tail (decode-sized) in one batch.
    let mut kv = model.new_kv_cache(16, BS);
    model
        .forward(
            &[ForwardItem {
                tokens: &c[..17],
                start_pos: 0,
                block_table: &tables[2],
                logits: LogitsRequest::None,
            }],
            &mut kv,
        )
        .unwrap();
    let together = model
        .forward(
            &[
                ForwardItem {
                    tokens: &a,
                    start_pos: 0,
                    block_table: &tables[0],
                    logits: LogitsRequest::Last,
                },
                ForwardItem {
                    tokens: &b,
                    start_pos: 0,
                    block_table: &tables[1],
                    logits: LogitsRequest::Last,
                },
                ForwardItem {
                    tokens: &c[17..],
                    start_pos: 17,
                    block_table: &tables[2],
                    logits: LogitsRequest::Last,
                },
            ],
            &mut kv,
        )
        .unwrap();
    for (i, (x, y)) in alone.iter().zip(&together).enumerate() {
        let d = max_diff(x, y);
        assert!(d <= 1e-5, "item {i}: max diff {d}");
    }
}

#[test]
fn batched_decode_matches_reference() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 5).unwrap();
    let n_seq = 6;
    let prompts: Vec<Vec<u32>> = (0..n_seq)
        .map(|i| prompt(20 + 9 * i, i as u64, 320))
        .collect();
    let mut kv = model.new_kv_cache(64, BS);
    let all_blocks = shuffled_blocks(64, 17);
    let tables: Vec<&[u32]> = all_blocks.chunks(10).take(n_seq).collect();
    let items: Vec<ForwardItem> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| ForwardItem {
            tokens: &p[..p.len() - 1],
            start_pos: 0,
            block_table: t,
            logits: LogitsRequest::None,
        })
        .collect();
    model.forward(&items, &mut kv).unwrap();
    let items: Vec<ForwardItem> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| ForwardItem {
            tokens: &p[p.len() - 1..],
            start_pos: p.len() - 1,
            block_table: t,
            logits: LogitsRequest::Last,
        })
        .collect();
    let out = model.forward(&items, &mut kv).unwrap();
    for (p, logits) in prompts.iter().zip(&out) {
        let reference = model.forward_reference(p).unwrap().pop().unwrap();
        let d = max_diff(logits, &reference);
        assert!(d <= 1e-4, "max diff {d}");
    }
}

#[test]
fn forked_block_copy_continues_identically() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 8).unwrap();
    let tokens = prompt(40, 4, 320); // 2 full blocks + 8 in block 3
    let mut kv = model.new_kv_cache(8, BS);
    let parent = [6u32, 1, 3];
    model
        .forward(
            &[ForwardItem {
                tokens: &tokens,
                start_pos: 0,
                block_table: &parent,
                logits: LogitsRequest::None,
            }],
            &mut kv,
        )
        .unwrap();
    // Fork: share the full blocks, copy the partial one.
    kv.copy_block(3, 5);
    let child = [6u32, 1, 5];
    let (x, y) = (7u32, 250u32);
    let out = model
        .forward(
            &[
                ForwardItem {
                    tokens: &[x],
                    start_pos: 40,
                    block_table: &parent,
                    logits: LogitsRequest::Last,
                },
                ForwardItem {
                    tokens: &[y],
                    start_pos: 40,
                    block_table: &child,
                    logits: LogitsRequest::Last,
                },
            ],
            &mut kv,
        )
        .unwrap();
    for (next, logits) in [x, y].iter().zip(&out) {
        let mut full = tokens.clone();
        full.push(*next);
        let reference = model.forward_reference(&full).unwrap().pop().unwrap();
        assert!(max_diff(logits, &reference) <= 1e-4);
    }
}

#[test]
fn seeded_models_are_deterministic() {
    let tokens = prompt(30, 9, 320);
    let a = LlamaModel::seeded(ModelConfig::tiny(), 1).unwrap();
    let b = LlamaModel::seeded(ModelConfig::tiny(), 1).unwrap();
    let c = LlamaModel::seeded(ModelConfig::tiny(), 2).unwrap();
    let la = a.forward_reference(&tokens).unwrap();
    assert_eq!(la, b.forward_reference(&tokens).unwrap());
    assert_ne!(la, c.forward_reference(&tokens).unwrap());
}

#[test]
fn bad_items_are_rejected_before_any_write() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 1).unwrap();
    let mut kv = model.new_kv_cache(4, BS);
    let tokens = prompt(20, 1, 320);
    let cases: Vec<(ForwardItem, &str)> = vec![
        (
            ForwardItem {
                tokens: &tokens,
                start_pos: 0,
                block_table: &[0],
                logits: LogitsRequest::Last,
            },
            "cannot hold",
        ),
        (
            ForwardItem {
                tokens: &tokens,
                start_pos: 0,
                block_table: &[0, 4],
                logits: LogitsRequest::Last,
            },
            "block id 4",
        ),
        (
            ForwardItem {
                tokens: &[1, 320],
                start_pos: 0,
                block_table: &[0],
                logits: LogitsRequest::Last,
            },
            "token id 320",
        ),
        (
            ForwardItem {
                tokens: &[1],
                start_pos: 8192,
                block_table: &[0],
                logits: LogitsRequest::Last,
            },
            "max_position_embeddings",
        ),
    ];
    for (item, expect) in cases {
        let e = model.forward(&[item], &mut kv).unwrap_err();
        assert!(matches!(e, EngineError::InvalidRequest(_)), "{e}");
        assert!(e.to_string().contains(expect), "{e}");
    }
    let wrong = KvCache::new(3, 4, BS, 2, 16);
    let mut wrong = wrong;
    assert!(model
        .forward(
            &[ForwardItem {
                tokens: &tokens[..1],
                start_pos: 0,
                block_table: &[0],
                logits: LogitsRequest::Last,
            }],
            &mut wrong,
        )
        .is_err());
}

#[test]
fn empty_and_logit_free_items() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 1).unwrap();
    let mut kv = model.new_kv_cache(4, BS);
    assert!(model.forward(&[], &mut kv).unwrap().is_empty());
    let out = model
        .forward(
            &[ForwardItem {
                tokens: &[],
                start_pos: 0,
                block_table: &[],
                logits: LogitsRequest::All,
            }],
            &mut kv,
        )
        .unwrap();
    assert_eq!(out, vec![Vec::<f32>::new()]);
}

// ---- checkpoints ----

fn read_tensors(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::F32);
            let data = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, view.shape().to_vec(), data)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Writes tensors as bf16 (`to_bf16`) or f16 into `path`.
fn write_half(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], bf16: bool) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| {
            d.iter()
                .flat_map(|&x| {
                    if bf16 {
                        half::bf16::from_f32(x).to_le_bytes()
                    } else {
                        half::f16::from_f32(x).to_le_bytes()
                    }
                })
                .collect()
        })
        .collect();
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F16 };
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

fn write_f32(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| d.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, path).unwrap();
}

fn assert_same_logits(a: &LlamaModel, b: &LlamaModel) {
    let tokens = prompt(40, 21, a.config().vocab_size);
    let la = a.forward_reference(&tokens).unwrap();
    let lb = b.forward_reference(&tokens).unwrap();
    assert_eq!(la, lb);
    // And through the paged path.
    let table: Vec<u32> = (0..3).rev().collect();
    let mut ka = a.new_kv_cache(3, BS);
    let mut kb = b.new_kv_cache(3, BS);
    assert_eq!(
        run_chunked(a, &tokens, 40, &table, &mut ka),
        run_chunked(b, &tokens, 40, &table, &mut kb)
    );
}

#[test]
fn llama_checkpoint_round_trips_through_save_and_load() {
    let dir = tempfile::tempdir().unwrap();
    let model = LlamaModel::seeded(ModelConfig::tiny(), 3).unwrap();
    model.save(dir.path()).unwrap();
    let names: HashMap<String, Vec<usize>> = read_tensors(&dir.path().join("model.safetensors"))
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect();
    assert_eq!(names["model.embed_tokens.weight"], vec![320, 64]);
    assert_eq!(
        names["model.layers.0.self_attn.q_proj.weight"],
        vec![64, 64]
    );
    assert_eq!(
        names["model.layers.1.self_attn.k_proj.weight"],
        vec![32, 64]
    );
    assert_eq!(names["model.layers.1.mlp.down_proj.weight"], vec![64, 176]);
    assert!(
        !names.contains_key("lm_head.weight"),
        "tied embeddings are not saved twice"
    );
    let loaded = LlamaModel::load(dir.path()).unwrap();
    assert_eq!(loaded.config(), model.config());
    assert_same_logits(&model, &loaded);
}

#[test]
fn qwen3_bf16_sharded_checkpoint_loads() {
    let config = qwen3_tiny();
    let model = LlamaModel::seeded(config.clone(), 4).unwrap();
    let f32_dir = tempfile::tempdir().unwrap();
    model.save(f32_dir.path()).unwrap();
    let tensors = read_tensors(&f32_dir.path().join("model.safetensors"));
    let names: Vec<&str> = tensors.iter().map(|t| t.0.as_str()).collect();
    for must in [
        "lm_head.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
    ] {
        assert!(names.contains(&must), "{must} not in {names:?}");
    }
    // Hand-write a two-shard bf16 checkpoint in HF layout (with an index file, as HF does).
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    write_half(
        &dir.path().join("model-00001-of-00002.safetensors"),
        first,
        true,
    );
    write_half(
        &dir.path().join("model-00002-of-00002.safetensors"),
        second,
        true,
    );
    let weight_map: serde_json::Map<String, serde_json::Value> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let file = if i < first.len() {
                "model-00001-of-00002.safetensors"
            } else {
                "model-00002-of-00002.safetensors"
            };
            (t.0.clone(), file.into())
        })
        .collect();
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    // Mistral-style repositories also ship a consolidated file under other names; the
    // index keeps it out (its duplicate tensor names would be rejected otherwise).
    write_half(&dir.path().join("consolidated.safetensors"), &tensors, true);
    std::fs::copy(
        f32_dir.path().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let loaded = LlamaModel::load(dir.path()).unwrap();
    assert_eq!(loaded.config().model_type, "qwen3");
    assert!(!loaded.config().tie_word_embeddings);
    // Seeded weights are bf16-representable, so bf16 storage loses nothing.
    assert_same_logits(&model, &loaded);
    // Without the index every file is read, and a tensor stored twice is an error.
    std::fs::remove_file(dir.path().join("model.safetensors.index.json")).unwrap();
    let e = LlamaModel::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("appears in both"), "{e}");
}

#[test]
fn f16_checkpoint_loads_close() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 6).unwrap();
    let src = tempfile::tempdir().unwrap();
    model.save(src.path()).unwrap();
    let tensors = read_tensors(&src.path().join("model.safetensors"));
    let dir = tempfile::tempdir().unwrap();
    write_half(&dir.path().join("model.safetensors"), &tensors, false);
    std::fs::copy(
        src.path().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let loaded = LlamaModel::load(dir.path()).unwrap();
    let tokens = prompt(20, 2, 320);
    let a = model.forward_reference(&tokens).unwrap().concat();
    let b = loaded.forward_reference(&tokens).unwrap().concat();
    assert!(max_diff(&a, &b) < 0.05);
}

#[test]
fn qwen3_layout_is_detected_from_weights() {
    // A "llama" config over a checkpoint that carries q_norm/k_norm still uses them.
    let config = qwen3_tiny();
    let model = LlamaModel::seeded(config.clone(), 4).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save(dir.path()).unwrap();
    let mut llama = config.clone();
    llama.model_type = "llama".into();
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&llama).unwrap(),
    )
    .unwrap();
    let loaded = LlamaModel::load(dir.path()).unwrap();
    let tokens = prompt(20, 2, 320);
    assert_eq!(
        model.forward_reference(&tokens).unwrap(),
        loaded.forward_reference(&tokens).unwrap()
    );
}

#[test]
fn missing_or_misshapen_tensors_are_named() {
    let model = LlamaModel::seeded(ModelConfig::tiny(), 3).unwrap();
    let src = tempfile::tempdir().unwrap();
    model.save(src.path()).unwrap();
    let tensors = read_tensors(&src.path().join("model.safetensors"));

    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.path().join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let missing: Vec<_> = tensors
        .iter()
        .filter(|t| t.0 != "model.layers.1.mlp.up_proj.weight")
        .cloned()
        .collect();
    write_f32(&dir.path().join("model.safetensors"), &missing);
    let e = LlamaModel::load(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("missing tensor model.layers.1.mlp.up_proj.weight"),
        "{e}"
    );

    let mut bad = tensors.clone();
    for t in bad.iter_mut() {
        if t.0 == "model.layers.0.self_attn.k_proj.weight" {
            t.1 = vec![64, 32];
        }
    }
    write_f32(&dir.path().join("model.safetensors"), &bad);
    let e = LlamaModel::load(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.0.self_attn.k_proj.weight")
            && e.contains("expected shape [32, 64], found [64, 32]"),
        "{e}"
    );

    // Untied config without lm_head.
    let mut cfg = ModelConfig::tiny();
    cfg.tie_word_embeddings = false;
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    write_f32(&dir.path().join("model.safetensors"), &tensors);
    let e = LlamaModel::load(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("lm_head.weight") && e.contains("tie_word_embeddings"),
        "{e}"
    );

    let empty = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.path().join("config.json"),
        empty.path().join("config.json"),
    )
    .unwrap();
    let e = LlamaModel::load(empty.path()).unwrap_err().to_string();
    assert!(e.contains("no *.safetensors"), "{e}");
}
