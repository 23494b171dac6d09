//! The official `anthropic` Python client against `kvfleet up` serving the real default model
//! (scripts/test.sh installs both).

mod support;

use std::process::Command;
use support::Cluster;

#[test]
fn the_official_anthropic_client_works() {
    // Small pools (128 blocks, 2,048 tokens per worker), so that the script's traffic
    // evicts every unpinned block while its pinned prefix stays.
    let c = Cluster::up(&[
        "--workers",
        "2",
        "--model",
        "smollm2-135m",
        "--num-blocks",
        "128",
    ]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/anthropic_client.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(&c.url)
        .arg("SmolLM2-135M-Instruct.Q4_1")
        .output()
        .expect("run python3 (scripts/test.sh installs the anthropic package)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "anthropic client failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("anthropic client: ok"), "{stdout}");
}
