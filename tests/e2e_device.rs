//! `--device`: asking for CUDA on a machine without the driver, NVRTC, cuBLAS or a GPU
//! ends the process with a clear message and a non-zero status, never a panic.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `kvfleet ARGS…` to its end (killed after 60 s); returns (exit code, stderr).
fn run(args: &[&str]) -> (Option<i32>, String) {
    // The seeded model: these cases are about the device, not the weights.
    let model: &[&str] = if matches!(args.first(), Some(&("up" | "worker"))) {
        &["--model", "tiny"]
    } else {
        &[]
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(args)
        .args(model)
        // A panic would print its backtrace; the test checks that none happens.
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvfleet");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvfleet {args:?} still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read stderr");
    (status.code(), err)
}

fn cuda_usable() -> bool {
    // On a GPU machine the commands would start serving instead of failing.
    std::path::Path::new("/dev/nvidia0").exists()
}

#[test]
fn up_on_a_missing_cuda_device_fails_with_a_message() {
    if cuda_usable() {
        eprintln!("this machine has a GPU: the GPU suite covers --device cuda:0");
        return;
    }
    let (code, err) = run(&["up", "--http", "127.0.0.1:0", "--device", "cuda:0"]);
    assert_eq!(code, Some(1), "stderr: {err}");
    assert!(err.contains("error:"), "stderr: {err}");
    assert!(err.contains("cuda:0 requested but"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
    assert!(!err.contains("stack backtrace"), "stderr: {err}");
}

#[test]
fn worker_on_a_missing_cuda_device_fails_with_a_message() {
    if cuda_usable() {
        return;
    }
    let (code, err) = run(&["worker", "--grpc", "127.0.0.1:0", "--device", "cuda:1"]);
    assert_eq!(code, Some(1), "stderr: {err}");
    assert!(err.contains("cuda:1 requested but"), "stderr: {err}");
    assert!(!err.contains("panicked"), "stderr: {err}");
}

#[test]
fn an_unknown_device_is_a_usage_error() {
    let (code, err) = run(&["up", "--http", "127.0.0.1:0", "--device", "gpu0"]);
    assert_eq!(code, Some(2), "stderr: {err}");
    assert!(err.contains("expected cpu or cuda:N"), "stderr: {err}");
}
