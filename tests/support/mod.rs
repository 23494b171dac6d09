//! Starting `kvfleet up` as a real process and talking to it over HTTP.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `kvfleet up`, killed when dropped.
pub struct Cluster {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    pub http: reqwest::blocking::Client,
}

/// The seeded `tiny` model unless `args` name one: most tests need speed and byte-level
/// token counts, not the real default model (tests/e2e_real_model.rs asks for that).
pub fn model_args(args: &[&str]) -> &'static [&'static str] {
    if args.contains(&"--model") {
        &[]
    } else {
        &["--model", "tiny"]
    }
}

impl Cluster {
    /// Starts `kvfleet up` with `args` on a free port and waits until it is healthy
    /// (with `--model tiny` unless `args` name a model).
    pub fn up(args: &[&str]) -> Cluster {
        let mut all = args.to_vec();
        all.extend_from_slice(model_args(args));
        Cluster::up_exact(&all)
    }

    /// Starts `kvfleet up` with exactly `args` (no model added: with none named, it
    /// serves its own default).
    pub fn up_exact(args: &[&str]) -> Cluster {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
            .arg("up")
            .args(["--http", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvfleet up");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the startup line");
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .expect("client");
        let cluster = Cluster { child, url, http };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = cluster.http.get(format!("{}/health", cluster.url)).send() {
                if r.status().is_success() {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "cluster never became healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// POSTs JSON to `path` with extra headers; returns (status, worker header, body).
    pub fn post(
        &self,
        path: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> (u16, Option<String>, serde_json::Value) {
        post_json(&self.http, &format!("{}{}", self.url, path), body, headers)
    }

    /// POSTs JSON with extra headers; returns (status, response headers, body).
    pub fn post_with_headers(
        &self,
        path: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
        let mut req = self.http.post(format!("{}{}", self.url, path)).json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().expect("request");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().expect("body");
        let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        (status, headers, json)
    }

    /// POSTs raw bytes.
    pub fn post_raw(&self, path: &str, body: &str) -> (u16, serde_json::Value) {
        let resp = self
            .http
            .post(format!("{}{}", self.url, path))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }

    /// GETs JSON.
    pub fn get(&self, path: &str) -> serde_json::Value {
        self.http
            .get(format!("{}{}", self.url, path))
            .send()
            .expect("request")
            .json()
            .expect("json")
    }

    /// GETs text.
    pub fn get_text(&self, path: &str) -> String {
        self.http
            .get(format!("{}{}", self.url, path))
            .send()
            .expect("request")
            .text()
            .expect("text")
    }

    /// Stops the router and its workers now (dropping does it too).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sum of prompt tokens actually computed by all workers, from `/fleet`.
    pub fn fleet_prompt_tokens_computed(&self) -> u64 {
        let f = self.get("/fleet");
        f["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .map(|w| w["load"]["prompt_tokens_computed"].as_u64().unwrap_or(0))
            .sum()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A chat request body.
pub fn chat(messages: serde_json::Value, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// POSTs JSON to `url` with extra headers; returns (status, `x-kvfleet-worker`, body:
/// its JSON, or the text as a JSON string when it is not JSON).
pub fn post_json(
    http: &reqwest::blocking::Client,
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, serde_json::Value) {
    let mut req = http.post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().expect("request");
    let status = resp.status().as_u16();
    let worker = resp
        .headers()
        .get("x-kvfleet-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let text = resp.text().expect("body");
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, worker, json)
}

/// Deterministic filler text of about `n` bytes (the tiny model's tokens are bytes).
pub fn filler(seed: u32, n: usize) -> String {
    let words = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
    ];
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(7);
    let mut s = String::new();
    while s.len() < n {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        s.push_str(words[(x % 10) as usize]);
        s.push(' ');
    }
    s.truncate(n);
    s
}

/// A `kvfleet` process a test started, killed when dropped.
pub struct Proc {
    /// The process.
    pub child: Child,
    /// The address it printed on its first line (without the scheme).
    pub addr: String,
    /// That first line.
    pub line: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvfleet ARGS…` (logging warnings only) and returns it with the address it
/// printed after `scheme` (`grpc://`, `http://`) on its first line. `up`, `worker` and
/// `router` get `--model tiny` unless `args` name a model.
pub fn start(args: &[&str], scheme: &str) -> Proc {
    let serves = matches!(args.first(), Some(&("up" | "worker" | "router")));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(args)
        .args(if serves { model_args(args) } else { &[] })
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn kvfleet");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("startup line");
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix(scheme))
        .unwrap_or_else(|| panic!("no {scheme} address in {line:?}"))
        .to_string();
    Proc { child, addr, line }
}

/// A `kvfleet worker` named `id` on a free loopback port (model `tiny`).
pub fn start_worker(id: &str) -> Proc {
    start(
        &["worker", "--grpc", "127.0.0.1:0", "--worker-id", id],
        "grpc://",
    )
}

/// A blocking HTTP client with a 60 s deadline per request.
pub fn http_client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// Runs a `kvfleet` subcommand to completion and returns its stdout; panics with its
/// stderr if it fails.
pub fn run_kvfleet(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(args)
        .output()
        .expect("run kvfleet");
    assert!(
        out.status.success(),
        "kvfleet {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}
