//! `/openapi.json` against a live `kvfleet up`: every documented operation is served
//! (none falls through to the 404 fallback), and schemathesis (scripts/test.sh
//! installs it from PyPI) fuzzes every operation with zero server errors.

mod support;

use serde_json::Value;
use std::process::Command;
use support::Cluster;

#[test]
fn every_documented_operation_is_served() {
    let c = Cluster::up(&["--workers", "1"]);
    let doc = c.get("/openapi.json");
    assert_eq!(doc["openapi"], "3.0.3");
    let paths = doc["paths"].as_object().expect("paths");
    // Every route the router serves is documented (and, below, every documented one served).
    let mut served: Vec<&str> = kvfleet_router::http_front::ROUTES
        .iter()
        .map(|r| r.1)
        .collect();
    served.dedup();
    assert_eq!(paths.len(), served.len(), "{:?}", paths.keys());
    for (path, ops) in paths {
        for method in ops.as_object().expect("operations").keys() {
            let url = format!("{}{path}", c.url);
            let resp = match method.as_str() {
                "get" => c.http.get(&url).send(),
                "post" => c.http.post(&url).json(&serde_json::json!({})).send(),
                m => panic!("undocumented method kind {m}"),
            }
            .expect("request");
            let status = resp.status().as_u16();
            let body: Value = serde_json::from_str(&resp.text().expect("text")).unwrap_or_default();
            assert_ne!(
                body["error"]["code"], "not_found",
                "{method} {path} is documented but not served"
            );
            assert!(status < 500, "{method} {path}: {status}");
        }
    }
    let (s, r) = c.post_raw("/v1/nope", "{}");
    assert_eq!((s, r["error"]["code"].as_str()), (404, Some("not_found")));
}

#[test]
fn schemathesis_finds_no_server_errors() {
    // A small completion cap keeps generated requests quick on the tiny model.
    let c = Cluster::up(&["--workers", "1", "--max-completion-tokens", "8"]);
    // schemathesis keeps state under its working directory: keep it out of the tree.
    let scratch = tempfile::tempdir().expect("tempdir");
    let out = Command::new("python3")
        .current_dir(scratch.path())
        .args([
            "-c",
            "import sys; from schemathesis.cli import schemathesis; sys.argv[0] = 'st'; schemathesis()",
            "run",
            &format!("{}/openapi.json", c.url),
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--max-time",
            "45",
            "--seed",
            "1",
            // One worker thread: hypothesis parses source with `ast` while it generates, and
            // with two threads CPython 3.11.7 (this kind's) failed one run with "SystemError:
            // AST constructor recursion depth mismatch" (the counter behind it is not
            // per-thread in 3.11; see CPython gh-106905), an error of the tool, not the server.
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--generation-database",
            "none",
            "--no-color",
        ])
        .output()
        .expect("run python3 (scripts/test.sh installs schemathesis)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let summary = stdout
        .lines()
        .find(|l| l.contains(" generated,"))
        .unwrap_or_default()
        .trim()
        .to_string();
    eprintln!("FIGURE schemathesis: {summary}");
    assert!(
        out.status.success(),
        "schemathesis failed (exit {:?}):\n{stdout}\n{stderr}",
        out.status.code()
    );
    let generated: u64 = summary
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(generated >= 100, "too few cases ran: {summary:?}");
    assert!(!stdout.contains("Server error"), "{stdout}");
    // The cluster still serves after the run (no worker died).
    let h = c.get("/health");
    assert_eq!(h["healthy_workers"], 1, "{h}");
}
