//! The official `openai` Python client against `kvfleet up` serving the real default model
//! (scripts/test.sh installs both), and structured outputs (tests/openai_structured.py)
//! from the real model and from the seeded one.

mod support;

use std::process::Command;
use support::Cluster;

#[test]
fn the_official_openai_client_works() {
    let c = Cluster::up(&["--workers", "2", "--model", "smollm2-135m"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&c.url)
        .arg("SmolLM2-135M-Instruct.Q4_1")
        .output()
        .expect("run python3 (scripts/test.sh installs the openai package)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("openai client: ok"), "{stdout}");
}

/// Runs tests/openai_structured.py against a cluster serving `model` (`samples`
/// json_schema completions at temperature 1, each parsed and validated by `jsonschema`).
fn structured_outputs(args: &[&str], model: &str, samples: &str, extra: &[&str]) {
    let c = Cluster::up(args);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_structured.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&c.url)
        .arg(model)
        .arg(samples)
        .args(extra)
        .output()
        .expect("run python3 (scripts/test.sh installs openai and jsonschema)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "structured outputs failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("openai structured: ok"), "{stdout}");
}

#[test]
fn structured_outputs_from_the_real_model_follow_their_schema() {
    structured_outputs(
        &["--workers", "2", "--model", "smollm2-135m"],
        "SmolLM2-135M-Instruct.Q4_1",
        "100",
        &[],
    );
}

#[test]
fn structured_outputs_from_random_weights_follow_their_schema() {
    // The seeded model's weights are random: only the constraint makes its output valid.
    structured_outputs(&["--workers", "1"], "tiny", "100", &["--random-weights"]);
}
