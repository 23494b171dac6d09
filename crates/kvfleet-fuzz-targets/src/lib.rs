//! The bodies of the fuzz targets in `fuzz/` (run with cargo-fuzz), kept here so that
//! the regular test suite replays each target's seed corpus through the same code
//! (`tests/fuzz_corpus.rs`) without cargo-fuzz or a nightly toolchain.
//!
//! Every function takes arbitrary bytes. Errors on bad input are expected; a panic
//! (including a failed invariant check below) is a finding.

use kvfleet_core::chat::ChatTemplate;
use kvfleet_core::incremental_tokenizer::IncrementalTokenizer;
use kvfleet_core::openai::ChatCompletionRequest;
use kvfleet_core::tokenizer::{ByteTokenizer, Tokenizer};
use kvfleet_core::BlockHash;
use kvfleet_proto::kv_events::from_wire as router_event;
use kvfleet_proto::v1 as pb;
use kvfleet_routing::{PrefixIndex, WorkerIdx};
use prost::Message;
use std::sync::OnceLock;

/// A fuzz target's body.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus
/// directories).
pub const TARGETS: &[(&str, Target)] = &[
    ("chat_request", chat_request),
    ("messages_request", messages_request),
    ("trace_line", trace_line),
    ("proto_decode", proto_decode),
    ("event_apply", event_apply),
    ("gguf_header", gguf_header),
];

/// Request JSON → chat request → rendered with the chat template → token ids, through
/// the router's incremental tokenizer (whose conversation memo persists across inputs,
/// as in the server). Checks that the incremental ids equal a fresh tokenization of the
/// rendered prompt.
pub fn chat_request(data: &[u8]) {
    static MEMO: OnceLock<IncrementalTokenizer> = OnceLock::new();
    let Ok(req) = serde_json::from_slice::<ChatCompletionRequest>(data) else {
        return;
    };
    // The `tiny` preset's prompt side, as the router loads it: byte tokenizer, ChatML.
    let (tokenizer, template) = (ByteTokenizer::new(), ChatTemplate::ChatMl);
    let tools = req.tools.unwrap_or_default();
    let Ok(full) = template.render(&req.messages, &tools, true) else {
        return;
    };
    let memo = MEMO.get_or_init(|| IncrementalTokenizer::new(16 << 20));
    let Ok(prompt) = memo.tokenize(&req.model, &template, &tokenizer, &req.messages, &tools) else {
        return;
    };
    if let Ok(direct) = tokenizer.encode(&full) {
        assert_eq!(prompt.ids, direct, "incremental tokenization diverged");
    }
    assert!(prompt.reused <= prompt.ids.len());
    assert!(prompt.history_len <= prompt.ids.len());
}

/// Request JSON → Anthropic Messages request → chat messages → rendered and tokenized,
/// then each `cache_control` breakpoint's token position. Checks that a breakpoint's
/// prefix lies within the prompt and that later breakpoints never end earlier, and
/// that the usage split adds up to the prompt.
pub fn messages_request(data: &[u8]) {
    use kvfleet_core::anthropic::{
        breakpoint_tokens, Conversation, MessagesRequest, MessagesUsage,
    };
    let Ok(req) = serde_json::from_slice::<MessagesRequest>(data) else {
        return;
    };
    let _ = req.sampling();
    let Ok(conv) = Conversation::from_request(&req) else {
        return;
    };
    let (tokenizer, template) = (ByteTokenizer::new(), ChatTemplate::ChatMl);
    let Ok(text) = template.render(&conv.messages, &conv.tools, true) else {
        return;
    };
    let Ok(ids) = tokenizer.encode(&text) else {
        return;
    };
    let mut last = 0;
    for point in &conv.breakpoints {
        let Ok(end) = breakpoint_tokens(&req, point.at, &template, &tokenizer, &ids) else {
            continue;
        };
        assert!(end <= ids.len(), "a breakpoint past the prompt");
        // Tool breakpoints cover the system prompt too; from the system on, the
        // prefixes grow in order.
        if !matches!(point.at, kvfleet_core::anthropic::Breakpoint::Tool(_)) {
            assert!(end >= last, "breakpoints out of order: {end} after {last}");
            last = end;
        }
        for cached in [0, end / 2, end, ids.len()] {
            let u = MessagesUsage::split(ids.len(), cached, Some(end), 16, 0);
            let sum = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens;
            assert_eq!(sum, ids.len(), "usage does not add up: {u:?}");
        }
    }
}

/// Bytes as a JSONL trace (the `kvfleet-bench` trace reader); a trace that reads must
/// write and read back to the same records.
pub fn trace_line(data: &[u8]) {
    let Ok(trace) = kvfleet_bench::trace::Trace::read(data) else {
        return;
    };
    let mut out = Vec::new();
    if trace.write(&mut out).is_ok() {
        let again = kvfleet_bench::trace::Trace::read(out.as_slice());
        assert!(
            again.is_ok(),
            "a written trace does not read back: {again:?}"
        );
    }
}

/// Bytes as each worker-protocol message; what decodes must re-encode and decode to
/// an equal message.
pub fn proto_decode(data: &[u8]) {
    fn round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(data: &[u8]) {
        if let Ok(m) = M::decode(data) {
            let again = M::decode(m.encode_to_vec().as_slice());
            assert_eq!(
                again.as_ref().ok(),
                Some(&m),
                "re-encoding changed the message"
            );
        }
    }
    round_trip::<pb::KvEventBatch>(data);
    round_trip::<pb::GenerateRequest>(data);
    round_trip::<pb::GenerateResponse>(data);
    round_trip::<pb::CacheDumpResponse>(data);
    round_trip::<pb::LoadResponse>(data);
    round_trip::<pb::ForkRequest>(data);
}

/// Bytes as a `KvEventBatch` applied to the router's prefix index (two workers, the
/// first byte picks which): after every event the index's own views of the worker
/// agree, a gap leaves it untouched, and a rebuild from its own dump changes nothing.
pub fn event_apply(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Ok(batch) = pb::KvEventBatch::decode(rest) else {
        return;
    };
    let mut index = PrefixIndex::new();
    let worker = WorkerIdx((pick % 2) as u32);
    for e in &batch.events {
        let before_seq = index.last_seq(worker);
        let before = index.worker_block_count(worker);
        match index.apply(worker, &router_event(e)) {
            Ok(()) => assert!(index.last_seq(worker) >= before_seq),
            Err(_) => {
                assert_eq!(index.last_seq(worker), before_seq, "a gap moved the seq");
                assert_eq!(
                    index.worker_block_count(worker),
                    before,
                    "a gap changed blocks"
                );
            }
        }
        let blocks = index.worker_blocks(worker);
        assert_eq!(blocks.len(), index.worker_block_count(worker));
        for b in &blocks {
            assert!(
                index.holds(worker, b.hash),
                "listed block {} not held",
                b.hash
            );
        }
    }
    let dump = index.worker_blocks(worker);
    let seq = index.last_seq(worker);
    let count = index.worker_block_count(worker);
    index.rebuild_worker(worker, &dump, seq);
    assert_eq!(
        index.worker_block_count(worker),
        count,
        "rebuild from own dump"
    );
    let chain: Vec<BlockHash> = dump.iter().map(|b| b.hash).collect();
    let m = index.find_matches(&chain);
    assert!(m.deepest() <= chain.len());
}

/// Bytes as a GGUF file: the engine's bounded header scan, then candle's parser; a
/// header that parses must describe tensors that all read from the bytes (the scan
/// checked their types, rows and data ranges), and nothing may panic or allocate
/// beyond what the input's length allows.
pub fn gguf_header(data: &[u8]) {
    let mut cur = std::io::Cursor::new(data);
    let Ok(content) = kvfleet_engine::gguf::read_content(&mut cur, data.len() as u64, "input")
    else {
        return;
    };
    for name in content.tensor_infos.keys() {
        let t = content.tensor(&mut cur, name, &candle_core::Device::Cpu);
        assert!(
            t.is_ok(),
            "tensor {name} of a scanned header does not read: {t:?}"
        );
    }
}
