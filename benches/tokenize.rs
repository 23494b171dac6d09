//! Prompt preparation on the router: rendering + tokenizing a 32k-token conversation
//! from scratch vs. incrementally (only the new turn), and hashing its blocks.
//!
//! `cargo bench --bench tokenize`

use criterion::{criterion_group, criterion_main, Criterion};
use kvfleet_core::chat::{ChatMessage, ChatTemplate};
use kvfleet_core::incremental_tokenizer::IncrementalTokenizer;
use kvfleet_core::tokenizer::{ByteTokenizer, Tokenizer};

/// A conversation of about `bytes` bytes (= tokens for the byte tokenizer) in turns
/// of ~1 KB, ending with a user message.
fn conversation(bytes: usize) -> Vec<ChatMessage> {
    let mut msgs = vec![ChatMessage::system(
        "You are a meticulous agent. ".repeat(150),
    )];
    let mut i = 0;
    while msgs.iter().map(|m| m.text().len()).sum::<usize>() < bytes {
        msgs.push(ChatMessage::user(format!(
            "step {i}: {}",
            "inspect the logs and report. ".repeat(17)
        )));
        msgs.push(ChatMessage::assistant(format!(
            "result {i}: {}",
            "all checks passed so far. ".repeat(19)
        )));
        i += 1;
    }
    msgs.push(ChatMessage::user("next step?"));
    msgs
}

fn bench_tokenize(c: &mut Criterion) {
    let tok = ByteTokenizer::new();
    let tpl = ChatTemplate::ChatMl;
    let convo = conversation(32_000);
    let n_tokens = tok
        .encode(&tpl.render(&convo, &[], true).unwrap_or_default())
        .map(|v| v.len())
        .unwrap_or(0);
    eprintln!("conversation: {} messages, {n_tokens} tokens", convo.len());
    let mut g = c.benchmark_group("tokenize_32k_conversation");
    g.bench_function("cold", |b| {
        b.iter(|| {
            let text = tpl.render(&convo, &[], true).unwrap_or_default();
            tok.encode(&text).map(|v| v.len()).unwrap_or(0)
        })
    });
    // The previous turn (all but the last exchange) is memoised; each iteration
    // tokenizes the newest turn only.
    let mut previous = convo[..convo.len() - 2].to_vec();
    previous.push(ChatMessage::user("next step?"));
    g.bench_function("incremental", |b| {
        b.iter_batched(
            || {
                let inc = IncrementalTokenizer::new(64 << 20);
                let _ = inc.tokenize("tiny", &tpl, &tok, &previous, &[]);
                inc
            },
            |inc| {
                inc.tokenize("tiny", &tpl, &tok, &convo, &[])
                    .map(|p| p.reused)
                    .unwrap_or(0)
            },
            criterion::BatchSize::LargeInput,
        )
    });
    let ids = tok
        .encode(&tpl.render(&convo, &[], true).unwrap_or_default())
        .unwrap_or_default();
    let seed = kvfleet_core::namespace_seed("tiny", "");
    g.bench_function("hash_blocks", |b| {
        b.iter(|| kvfleet_core::hash_blocks(seed, &ids, 16).len())
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench_tokenize
}
criterion_main!(benches);
