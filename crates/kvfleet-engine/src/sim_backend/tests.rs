use super::*;
use crate::engine::{Engine, EngineConfig, Request};
use crate::kv_events::RecordingSink;
use crate::sampling::SamplingParams;
use kvfleet_core::kv_events::{KvEventKind, Medium};
use std::sync::Arc;

const BS: usize = 16;

fn engine(sink: &RecordingSink) -> Engine {
    let backend =
        SimBackend::new(ModelConfig::tiny(), 64, CostModel::h200_llama8b()).without_sleeping();
    let mut e = Engine::new(
        EngineConfig {
            model_id: "tiny".into(),
            block_size: BS,
            max_num_seqs: 8,
            max_batched_tokens: 512,
            max_prefill_chunk: 512,
            decode_reserve: Default::default(),
        },
        Box::new(backend),
        None,
    )
    .unwrap();
    e.set_event_sink(Arc::new(sink.clone()));
    e
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    }
}

#[test]
fn serves_stores_full_blocks_and_reuses_them() {
    let sink = RecordingSink::new();
    let mut e = engine(&sink);
    // Three full blocks and a partial one.
    let prompt: Vec<u32> = (0..3 * BS as u32 + 5).map(|i| 32 + i % 90).collect();
    e.add_request(Request::new(1, prompt.clone(), params(6)))
        .unwrap();
    let first = e.run_to_completion().unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].tokens.len(), 6, "max_tokens ends the generation");
    assert_eq!(first[0].cached_tokens, 0);
    // Deterministic output: lowercase bytes chosen by position.
    let want: Vec<u32> = (0..6)
        .map(|i| u32::from(b'a') + ((prompt.len() + i) % 26) as u32)
        .collect();
    assert_eq!(first[0].tokens, want);

    let hashes = kvfleet_core::hash_blocks(e.namespace_seed(""), &prompt, BS);
    assert_eq!(hashes.len(), 3);
    let stored: Vec<_> = sink
        .events()
        .into_iter()
        .filter_map(|ev| match ev.kind {
            KvEventKind::Stored {
                block_hashes,
                medium: Medium::Device,
                ..
            } => Some(block_hashes),
            _ => None,
        })
        .flatten()
        .collect();
    for h in &hashes {
        assert!(stored.contains(h), "prompt block {h:?} stored");
    }

    e.add_request(Request::new(2, prompt, params(2))).unwrap();
    let again = e.run_to_completion().unwrap();
    assert_eq!(again[0].cached_tokens, 3 * BS, "the full blocks are reused");
}

#[test]
fn step_time_follows_the_cost_model() {
    let cost = CostModel::h200_llama8b();
    let b = SimBackend::new(ModelConfig::tiny(), 8, cost.clone());
    let ms = |shape| b.step_time(shape).as_secs_f64() * 1000.0;
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
    // A whole prompt of 800 tokens in one step: the simulator's prefill time.
    let prefill = StepShape {
        prefill_tokens: 800,
        prompts_finished: 1,
        decode_rows: 0,
    };
    assert!(close(ms(prefill), cost.prefill_ms(800)));
    // Decode only: the simulator's step at that batch.
    let decode = StepShape {
        decode_rows: 5,
        ..StepShape::default()
    };
    assert!(close(ms(decode), cost.decode_step_ms(5)));
    // A middle chunk of a prompt costs its tokens only.
    let chunk = StepShape {
        prefill_tokens: 80,
        ..StepShape::default()
    };
    assert!(close(ms(chunk), 80.0 * 1000.0 / cost.prefill_tokens_per_s));
    assert_eq!(b.step_time(StepShape::default()), Duration::ZERO);
}

#[test]
fn copies_out_are_refused() {
    let mut b = SimBackend::new(ModelConfig::tiny(), 8, CostModel::h200_llama8b());
    let e = b.read_block(0).unwrap_err();
    assert!(e.to_string().contains("sim"), "{e}");
}
