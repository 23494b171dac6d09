//! Structured outputs in the engine: token tries from both tokenizer paths (a Hugging
//! Face `tokenizer.json` and a GGUF file's vocabulary), constrained sequences batched
//! with unconstrained ones, forks, and grammars llguidance rejects.

use kvfleet_core::structured_output::{GrammarCompiler, OutputGrammar};
use kvfleet_core::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};
use kvfleet_engine::{
    load_model, CpuBackend, Engine, EngineConfig, EngineError, FinishReason, ForkChild,
    ForkRequest, LlamaModel, ModelConfig, Request, SamplingParams,
};
use std::sync::Arc;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/smollm2_gguf_tokenizer.json"
);

/// Bounded in every field, so even random weights finish well within max_tokens.
fn person() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Tokyo"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
        },
        "required": ["name", "age", "city", "tags"],
        "additionalProperties": false
    })
}

/// Checks `text` against [`person`] by hand (the engine crate has no schema validator).
fn assert_person(text: &str) {
    let v: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 4, "{text}");
    assert!(
        v["name"].as_str().is_some_and(|s| s.chars().count() <= 6),
        "{text}"
    );
    assert!(v["age"].as_u64().is_some_and(|a| a <= 120), "{text}");
    assert!(
        matches!(v["city"].as_str(), Some("Paris" | "Tokyo")),
        "{text}"
    );
    let tags = v["tags"].as_array().expect("tags");
    assert!(
        tags.len() <= 3 && tags.iter().all(|t| t.is_boolean()),
        "{text}"
    );
}

fn sampled(seed: u64, grammar: Option<OutputGrammar>) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: 200,
        grammar,
        ..SamplingParams::default()
    }
}

fn tiny_engine() -> Engine {
    let model = Arc::new(LlamaModel::seeded(ModelConfig::tiny(), 3).expect("model"));
    Engine::new(
        EngineConfig::default(),
        Box::new(CpuBackend::new(model, 512, 16)),
        Some(Arc::new(ByteTokenizer::new())),
    )
    .expect("engine")
}

fn prompt(text: &str) -> Vec<u32> {
    ByteTokenizer::new().encode(text).unwrap()
}

#[test]
fn random_weights_write_valid_json_and_free_neighbours_are_unchanged() {
    let schema = OutputGrammar::JsonSchema(person().to_string());
    let free_ids = [100u64, 101, 102];
    // The unconstrained requests alone...
    let mut alone = tiny_engine();
    for id in free_ids {
        alone
            .add_request(Request::new(id, prompt("Hello there"), sampled(id, None)))
            .unwrap();
    }
    let alone = alone.run_to_completion().unwrap();
    // ...and batched with constrained ones.
    let mut e = tiny_engine();
    for id in 0..12u64 {
        let p = sampled(id, Some(schema.clone()));
        e.add_request(Request::new(id, prompt("A person as JSON:"), p))
            .unwrap();
    }
    for id in free_ids {
        e.add_request(Request::new(id, prompt("Hello there"), sampled(id, None)))
            .unwrap();
    }
    let done = e.run_to_completion().unwrap();
    let mut distinct = std::collections::HashSet::new();
    for c in done.iter().filter(|c| c.id < 100) {
        assert_eq!(c.finish, FinishReason::Stop, "{c:?}");
        assert_person(&c.text);
        distinct.insert(c.text.clone());
    }
    assert!(distinct.len() > 6, "sampling still varies: {distinct:?}");
    let free: Vec<_> = done.into_iter().filter(|c| c.id >= 100).collect();
    assert_eq!(free, alone);
    e.check_invariants().unwrap();
}

#[test]
fn json_object_and_lark_grammars_are_followed() {
    let mut e = tiny_engine();
    let lark = OutputGrammar::Lark("start: (\"yes\" | \"no\") \".\"".into());
    for id in 0..8u64 {
        e.add_request(Request::new(
            id,
            prompt("Answer:"),
            sampled(id, Some(lark.clone())),
        ))
        .unwrap();
    }
    for c in e.run_to_completion().unwrap() {
        assert!(c.text == "yes." || c.text == "no.", "{c:?}");
        assert_eq!(c.finish, FinishReason::Stop);
    }
    // Greedy decoding is masked the same way.
    let mut e = tiny_engine();
    let p = SamplingParams {
        max_tokens: 400,
        grammar: Some(OutputGrammar::JsonSchema(person().to_string())),
        ..SamplingParams::default()
    };
    e.add_request(Request::new(1, prompt("JSON:"), p)).unwrap();
    assert_person(&e.run_to_completion().unwrap()[0].text);
}

#[test]
fn fork_children_keep_their_own_grammars() {
    let mut e = tiny_engine();
    let schema = OutputGrammar::JsonSchema(person().to_string());
    e.add_fork(ForkRequest {
        id: 10,
        prefix: prompt("shared prefix of the conversation, long enough for a block"),
        cache_salt: String::new(),
        children: vec![
            ForkChild {
                id: 11,
                suffix: prompt(" a"),
                params: sampled(11, Some(schema.clone())),
            },
            ForkChild {
                id: 12,
                suffix: prompt(" b"),
                params: sampled(12, Some(OutputGrammar::Lark("start: \"ok\"".into()))),
            },
            ForkChild {
                id: 13,
                suffix: prompt(" c"),
                params: SamplingParams {
                    max_tokens: 5,
                    ignore_eos: true,
                    ..sampled(13, None)
                },
            },
        ],
    })
    .unwrap();
    let done = e.run_to_completion().unwrap();
    let by_id = |id| done.iter().find(|c| c.id == id).unwrap();
    assert_person(&by_id(11).text);
    assert_eq!(by_id(12).text, "ok");
    assert_eq!(by_id(13).tokens.len(), 5);
}

#[test]
fn grammars_llguidance_rejects_are_invalid_requests() {
    let mut e = tiny_engine();
    let bad = OutputGrammar::JsonSchema(r#"{"type": "strnig"}"#.into());
    match e.add_request(Request::new(1, prompt("x"), sampled(1, Some(bad)))) {
        Err(EngineError::InvalidRequest(m)) => assert!(m.contains("strnig"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Without a tokenizer there is no vocabulary to constrain.
    let model = Arc::new(LlamaModel::seeded(ModelConfig::tiny(), 3).unwrap());
    let mut bare = Engine::new(
        EngineConfig::default(),
        Box::new(CpuBackend::new(model, 64, 16)),
        None,
    )
    .unwrap();
    let r = bare.add_request(Request::new(
        1,
        vec![1, 2],
        sampled(1, Some(OutputGrammar::JsonObject)),
    ));
    assert!(matches!(r, Err(EngineError::InvalidRequest(m)) if m.contains("tokenizer")));
    assert!(!e.has_unfinished() && !bare.has_unfinished());
}

/// Every token's bytes, as the trie sees them, spell what the tokenizer decodes it to;
/// special tokens are marked.
fn assert_spells_its_tokens(t: &dyn Tokenizer) -> Vec<Vec<u8>> {
    let words = t.token_bytes().expect("token bytes");
    assert_eq!(words.len(), t.vocab_size());
    let mut checked = 0;
    for (id, w) in words.iter().enumerate() {
        let id = id as u32;
        if t.is_special(id) {
            assert_eq!(w.first(), Some(&0xFF), "special {id}");
            continue;
        }
        if let Ok(s) = std::str::from_utf8(w) {
            assert_eq!(t.decode(&[id]).unwrap(), s, "token {id}");
            checked += 1;
        }
    }
    assert!(
        checked > words.len() * 9 / 10,
        "{checked} of {}",
        words.len()
    );
    words
}

#[test]
fn tries_from_the_hf_and_gguf_tokenizers_agree_and_constrain() {
    let hf = HfTokenizer::from_file(FIXTURE).expect("fixture tokenizer");
    let from_json = assert_spells_its_tokens(&hf);
    let path = kvfleet_engine::model_cache::default_model_file().unwrap_or_else(|e| panic!("{e}"));
    let real = load_model(&path.to_string_lossy()).unwrap_or_else(|e| {
        panic!(
            "the real-model tests need {} ({e}); fetch it with `bash scripts/fetch-model.sh`",
            path.display()
        )
    });
    let from_gguf = assert_spells_its_tokens(real.tokenizer.as_ref());
    assert_eq!(from_json, from_gguf);
    let vocab = real.model.config().vocab_size;
    let c = GrammarCompiler::new(real.tokenizer.as_ref(), vocab).expect("trie");
    assert_eq!(Some(c.eos()), real.tokenizer.token_id("<|im_end|>"));
    // The real model, sampled at temperature 1, writes the schema.
    let mut e = Engine::new(
        EngineConfig::default(),
        Box::new(CpuBackend::new(real.model.clone(), 512, 16)),
        Some(real.tokenizer.clone()),
    )
    .unwrap();
    let p = real
        .tokenizer
        .encode("<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n")
        .unwrap();
    let schema = OutputGrammar::JsonSchema(person().to_string());
    for id in 0..4u64 {
        e.add_request(Request::new(
            id,
            p.clone(),
            sampled(id, Some(schema.clone())),
        ))
        .unwrap();
    }
    for c in e.run_to_completion().unwrap() {
        assert_eq!(c.finish, FinishReason::Stop, "{c:?}");
        assert_person(&c.text);
    }
}
