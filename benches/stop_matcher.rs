//! Stop-string matching on the engine thread: the cost of one streamed token as the
//! number of stop strings grows, with the Aho–Corasick matcher (`StopMatcher`) and,
//! for comparison, the per-string search it replaced (O(Σ|stop|) per token).
//!
//! `cargo bench --bench stop_matcher` (or, without a release build of the tree,
//! `cargo bench --profile dev --bench stop_matcher`: dependencies are built at opt-level 2).
//!
//! Measured (2-core shared build machine, `--profile dev`), 1,024 tokens including
//! building the matcher: Aho–Corasick 0.42 / 0.57 / 0.65 / 1.57 ms for 1 / 4 / 64 /
//! 1,024 stop strings (the last includes building a 12k-node automaton once), against
//! 0.84 / 2.9 / 52 / 856 ms for the per-string search.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvfleet_engine::stop_matcher::StopMatcher;

/// `n` distinct stop strings of 12 bytes that never occur in the text but share its
/// first bytes, so partial matches happen all the time.
fn stops(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("the {i:08}")).collect()
}

/// 4 KiB of text in deltas of about one token (4 bytes).
fn deltas() -> Vec<String> {
    let text = "the quick brown fox jumps over the lazy dog; ".repeat(92);
    text.as_bytes()
        .chunks(4)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect()
}

/// The matcher `StopMatcher` replaced: every stop string searched after each delta.
fn per_string_search(stops: &[String], deltas: &[String]) -> usize {
    let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut text = String::new();
    let mut emitted = 0usize;
    for d in deltas {
        let from = emitted.saturating_sub(max_len);
        text.push_str(d);
        if stops.iter().any(|s| text[from..].contains(s.as_str())) {
            break;
        }
        let mut safe = text.len();
        for s in stops {
            for k in (1..s.len()).rev() {
                if text.ends_with(&s[..k]) {
                    safe = safe.min(text.len() - k);
                    break;
                }
            }
        }
        emitted = emitted.max(safe);
    }
    emitted
}

fn bench_stop_matcher(c: &mut Criterion) {
    let deltas = deltas();
    let mut g = c.benchmark_group("stop_matcher_per_token");
    g.throughput(Throughput::Elements(deltas.len() as u64));
    for n in [1usize, 4, 64, 1024] {
        let stops = stops(n);
        g.bench_with_input(BenchmarkId::new("aho_corasick", n), &stops, |b, stops| {
            b.iter(|| {
                let mut m = StopMatcher::new(stops);
                let mut out = 0;
                for d in &deltas {
                    out += m.push(d).emit.len();
                }
                out
            })
        });
        g.bench_with_input(BenchmarkId::new("per_string", n), &stops, |b, stops| {
            b.iter(|| per_string_search(stops, &deltas))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_stop_matcher);
criterion_main!(benches);
