//! End to end: generate a fork fan-out trace, replay it against a real
//! `kvfleet up --workers 4`, and check the measured cached-token ratio against the
//! simulator's prediction for the same setup.

mod support;

#[test]
fn replay_agrees_with_the_simulator() {
    let dir = std::env::temp_dir().join(format!("kvfleet-e2e-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let trace_s = trace.to_str().unwrap();
    support::run_kvfleet(&[
        "bench",
        "gen",
        "--out",
        trace_s,
        "--sessions",
        "4",
        "--system-tokens",
        "2048",
        "--tools-tokens",
        "2048",
        "--history-tokens",
        "2048",
        "--turn-tokens",
        "512",
        "--parent-turns",
        "2",
        "--child-turns",
        "2",
        "--fork-k",
        "3",
        "--output-tokens",
        "4",
        "--session-rate",
        "4",
        "--turn-gap-ms",
        "50",
    ]);
    let cluster = support::Cluster::up(&["--workers", "4"]);
    let replay: serde_json::Value = serde_json::from_str(&support::run_kvfleet(&[
        "bench",
        "replay",
        "--trace",
        trace_s,
        "--target",
        &cluster.url,
        "--tokens-per-id",
        "16",
        "--no-progress",
        "--json",
    ]))
    .unwrap();
    drop(cluster);
    let sim: serde_json::Value = serde_json::from_str(&support::run_kvfleet(&[
        "sim",
        "--trace",
        trace_s,
        "--workers",
        "4",
        "--cache-blocks",
        "2048",
        "--policy",
        "cache-aware",
        "--tokens-per-id",
        "16",
        "--json",
        "--cost-model",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/crates/kvfleet-bench/cost-models/cpu-small.json"
        ),
    ]))
    .unwrap();
    let requests = 4 * (2 + 3 * 2);
    assert_eq!(replay["ok"], requests, "{replay}");
    assert_eq!(replay["failed"], 0, "{replay}");
    let measured = replay["cached_token_ratio"].as_f64().unwrap();
    let predicted = sim["results"][0]["cached_token_ratio"].as_f64().unwrap();
    assert!(measured > 0.0);
    let rel = (measured - predicted).abs() / predicted;
    assert!(
        rel <= 0.10,
        "measured cached ratio {measured:.3} vs simulated {predicted:.3} ({:.1}% apart)",
        rel * 100.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}
