//! End to end: generate a fork fan-out trace, replay it against a real
//! `kvfleet up --workers 4`, and check the measured cached-token ratio against the
//! simulator's prediction for the same setup.

mod support;

/// [`generated_trace`] of `sessions` conversations of `turns` turns (no forks; a
/// 2,048-token system prompt, 1,024 each of tools and history, 768-token turns,
/// 64-token answers), `gap_ms` apart within a session, `rate` sessions a second.
fn conversation_trace(
    name: &str,
    sessions: u32,
    turns: u32,
    gap_ms: u32,
    rate: u32,
) -> (std::path::PathBuf, String) {
    let (sessions, turns, gap_ms, rate) = (
        sessions.to_string(),
        turns.to_string(),
        gap_ms.to_string(),
        rate.to_string(),
    );
    generated_trace(
        name,
        &[
            "--sessions",
            &sessions,
            "--fork-k",
            "0",
            "--parent-turns",
            &turns,
            "--system-tokens",
            "2048",
            "--tools-tokens",
            "1024",
            "--history-tokens",
            "1024",
            "--turn-tokens",
            "768",
            "--output-tokens",
            "64",
            "--turn-gap-ms",
            &gap_ms,
            "--session-rate",
            &rate,
        ],
    )
}

/// A fresh directory named for `name` and this process, with the trace `kvfleet bench
/// gen` writes there from `gen_args` (its `--out` added): the directory, to remove at
/// the end, and the trace's path.
fn generated_trace(name: &str, gen_args: &[&str]) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("kvfleet-e2e-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl").to_str().unwrap().to_string();
    let mut args = vec!["bench", "gen", "--out", &trace];
    args.extend_from_slice(gen_args);
    support::run_kvfleet(&args);
    (dir, trace)
}

#[test]
fn replay_agrees_with_the_simulator() {
    let (dir, trace) = generated_trace(
        "bench",
        &[
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
        ],
    );
    let trace_s = trace.as_str();
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
    // A request ends no sooner than its first token.
    for q in ["p50", "p99"] {
        let ttft = replay["ttft_ms"][q].as_f64().unwrap();
        let latency = replay["latency_ms"][q].as_f64().unwrap();
        assert!(latency >= ttft && ttft > 0.0, "{q}: {replay}");
    }
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

#[test]
fn sim_with_host_and_disk_tiers_raises_the_hit_ratio() {
    // A conversation trace whose live sessions outgrow 2 × 40 device blocks.
    let (dir, trace) = conversation_trace("tiers", 40, 8, 20000, 2);
    let trace_s = trace.as_str();
    let sim = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "sim",
            "--trace",
            trace_s,
            "--workers",
            "2",
            "--cache-blocks",
            "40",
            "--policy",
            "cache-aware",
            "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&support::run_kvfleet(&args)).unwrap()
    };
    let flat = sim(&[]);
    let tiered = sim(&["--host-blocks", "160", "--disk-blocks", "640"]);
    let (f, t) = (&flat["results"][0], &tiered["results"][0]);
    assert_eq!(f["total_blocks"], t["total_blocks"]);
    assert_eq!(f["host_hit_blocks"], 0, "{f}");
    let hits = |r: &serde_json::Value| r["hit_blocks"].as_u64().unwrap();
    assert!(
        hits(t) > hits(f),
        "tiers: {} hits, none: {}",
        hits(t),
        hits(f)
    );
    assert!(t["host_hit_blocks"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["tier_scoring"], "load-time");
    // The pooled bound with tiers covers 2 × (40 + 800) blocks.
    assert_eq!(tiered["bounds"]["pooled_tiered_blocks"], 1680);
    assert!(
        tiered["bounds"]["pooled_tiered"].as_f64().unwrap()
            > tiered["bounds"]["pooled"].as_f64().unwrap()
    );
    // A bad scoring mode is refused by name.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(["sim", "--trace", trace_s, "--tier-scoring", "fastest"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("load-time, discount, device-only"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sims_idle_guard_takes_the_waits_out_of_sglangs_rule_and_the_hits_they_bought() {
    // Conversations on 4 workers whose turns queue behind each other on their holder.
    let (dir, trace) = conversation_trace("guard", 24, 6, 1000, 4);
    let trace_s = trace.as_str();
    let sim = |sglang: &str| -> serde_json::Value {
        let out: serde_json::Value = serde_json::from_str(&support::run_kvfleet(&[
            "sim",
            "--trace",
            trace_s,
            "--workers",
            "4",
            "--cache-blocks",
            "80",
            "--policy",
            "sglang-spill",
            "--sglang-config",
            sglang,
            "--json",
        ]))
        .unwrap();
        out["results"][0].clone()
    };
    let (rule, guarded) = (sim("{}"), sim(r#"{"idle_guard": true}"#));
    let waits = |r: &serde_json::Value| r["avoidable_waits"].as_u64().unwrap();
    let hits = |r: &serde_json::Value| r["hit_ratio"].as_f64().unwrap();
    assert!(waits(&rule) > 0, "{rule}");
    assert_eq!(waits(&guarded), 0, "{guarded}");
    assert!(hits(&guarded) < hits(&rule), "{guarded} vs {rule}");
    // A misspelt field is refused by name, before anything runs.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(["sim", "--trace", trace_s, "--sglang-config"])
        .arg(r#"{"idle_gaurd": true}"#)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown field `idle_gaurd`"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
