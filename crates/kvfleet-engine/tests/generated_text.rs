//! What generated text contains: a scripted backend makes the engine sample a fixed
//! sequence of ids, so the test pins exactly how stop tokens and special tokens in the
//! output turn into `text` and `finish`.

use kvfleet_core::tokenizer::{ByteTokenizer, BYTE_IM_END_ID, BYTE_IM_START_ID};
use kvfleet_core::Tokenizer;
use kvfleet_engine::model::{ForwardItem, LogitsRequest};
use kvfleet_engine::{
    Engine, EngineConfig, FinishReason, ModelBackend, ModelConfig, Request, SamplingParams,
};
use std::sync::Arc;

/// A backend whose logits put all mass on `script[n]` for the `n`-th generated token.
struct ScriptedBackend {
    config: ModelConfig,
    prompt_len: usize,
    script: Vec<u32>,
}

impl ModelBackend for ScriptedBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn num_blocks(&self) -> usize {
        64
    }

    fn forward(&mut self, items: &[ForwardItem]) -> kvfleet_engine::Result<Vec<Vec<f32>>> {
        let vocab = self.config.vocab_size;
        let row = |pos: usize| {
            // Logits at position `pos` choose the token at `pos + 1`.
            let generated = (pos + 1).saturating_sub(self.prompt_len);
            let token = self
                .script
                .get(generated)
                .copied()
                .unwrap_or(u32::from(b'.'));
            let mut logits = vec![0.0f32; vocab];
            logits[token as usize] = 10.0;
            logits
        };
        Ok(items
            .iter()
            .map(|item| {
                let end = item.start_pos + item.tokens.len();
                match item.logits {
                    LogitsRequest::None => Vec::new(),
                    LogitsRequest::Last => row(end - 1),
                    LogitsRequest::All => (item.start_pos..end).flat_map(row).collect(),
                }
            })
            .collect())
    }

    fn copy_block(&mut self, _src: u32, _dst: u32) {}

    fn device_name(&self) -> String {
        "scripted".into()
    }
}

fn run(script: Vec<u32>, params: SamplingParams) -> kvfleet_engine::Completion {
    let prompt: Vec<u32> = b"hello".iter().map(|&b| u32::from(b)).collect();
    let backend = ScriptedBackend {
        config: ModelConfig::tiny(),
        prompt_len: prompt.len(),
        script,
    };
    let mut engine = Engine::new(
        EngineConfig {
            model_id: "scripted".into(),
            block_size: 16,
            max_num_seqs: 4,
            max_batched_tokens: 256,
            max_prefill_chunk: 256,
            decode_reserve: Default::default(),
        },
        Box::new(backend),
        Some(Arc::new(ByteTokenizer::new())),
    )
    .unwrap();
    engine.add_request(Request::new(1, prompt, params)).unwrap();
    engine.run_to_completion().unwrap().remove(0)
}

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[test]
fn end_of_turn_stops_with_stop_and_specials_stay_out_of_the_text() {
    let mut script = bytes("Hi");
    script.push(BYTE_IM_START_ID);
    script.extend(bytes("!"));
    script.push(BYTE_IM_END_ID);
    script.extend(bytes("never"));
    let done = run(script, SamplingParams::default());
    assert_eq!(done.finish, FinishReason::Stop);
    assert_eq!(done.text, "Hi!");
    // The special token was generated (and is reported), but it is not content.
    assert_eq!(
        done.tokens,
        [bytes("Hi"), vec![BYTE_IM_START_ID], bytes("!")].concat()
    );
    assert!(ByteTokenizer::new()
        .eos_token_ids()
        .contains(&BYTE_IM_END_ID));
}

#[test]
fn added_tokens_that_are_not_special_stay_in_the_text() {
    let t = ByteTokenizer::new();
    let mut script = t.encode("<tool_call>{}</tool_call>").unwrap();
    script.push(BYTE_IM_END_ID);
    let done = run(script, SamplingParams::default());
    assert_eq!(done.finish, FinishReason::Stop);
    assert_eq!(done.text, "<tool_call>{}</tool_call>");
}

#[test]
fn a_special_token_before_max_tokens_leaves_no_trace() {
    let mut script = bytes("ab");
    script.push(BYTE_IM_START_ID);
    let params = SamplingParams {
        max_tokens: 3,
        ..SamplingParams::default()
    };
    let done = run(script, params);
    assert_eq!(done.finish, FinishReason::Length);
    assert_eq!(done.text, "ab");
}
