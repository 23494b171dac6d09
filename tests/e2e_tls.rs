//! TLS end to end, with certificates generated here (a CA, a server certificate for
//! 127.0.0.1/localhost, a client certificate, and a second CA nobody trusts):
//! HTTPS on `kvfleet up`'s HTTP front, mutual TLS between a `kvfleet router` process
//! and a `kvfleet worker` process, and unreadable certificate files refused at start.

mod support;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use serde_json::json;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{chat, start};

/// A CA: its certificate (to sign with and to trust) and key.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().expect("CA key");
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key).expect("self-sign CA");
    Ca { cert, key }
}

/// A leaf certificate signed by `ca`; returns (certificate PEM, key PEM).
fn leaf(ca: &Ca, name: &str, sans: &[&str], usage: ExtendedKeyUsagePurpose) -> (String, String) {
    let key = KeyPair::generate().expect("leaf key");
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut p = CertificateParams::new(sans).expect("leaf params");
    p.distinguished_name.push(DnType::CommonName, name);
    p.extended_key_usages = vec![usage];
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let cert = p.signed_by(&key, &ca.cert, &ca.key).expect("sign leaf");
    (cert.pem(), key.serialize_pem())
}

/// Every certificate and key file the tests use, in a temporary directory.
struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    rogue_client_cert: PathBuf,
    rogue_client_key: PathBuf,
    ca_pem: String,
    other_ca_pem: String,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let trusted = ca("kvfleet test CA");
        let other = ca("untrusted CA");
        let server = leaf(
            &trusted,
            "kvfleet server",
            &["127.0.0.1", "localhost"],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let client = leaf(
            &trusted,
            "kvfleet router",
            &["router.kvfleet.test"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let rogue = leaf(
            &other,
            "rogue router",
            &["router.kvfleet.test"],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).expect("write PEM");
            p
        };
        Pki {
            ca: write("ca.pem", &trusted.cert.pem()),
            other_ca: write("other-ca.pem", &other.cert.pem()),
            server_cert: write("server.pem", &server.0),
            server_key: write("server.key", &server.1),
            client_cert: write("client.pem", &client.0),
            client_key: write("client.key", &client.1),
            rogue_client_cert: write("rogue.pem", &rogue.0),
            rogue_client_key: write("rogue.key", &rogue.1),
            ca_pem: trusted.cert.pem(),
            other_ca_pem: other.cert.pem(),
            _dir: dir,
        }
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// An HTTPS client trusting only `ca_pem`.
fn https_client(ca_pem: &str) -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes()).expect("CA"))
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// (status, x-kvfleet-worker, body) of a 4-token chat completion.
fn complete(
    http: &reqwest::blocking::Client,
    url: &str,
) -> reqwest::Result<(u16, Option<String>, serde_json::Value)> {
    let body = chat(
        json!([{"role": "user", "content": "Say hello over TLS."}]),
        4,
    );
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()?;
    let status = r.status().as_u16();
    let worker = r
        .headers()
        .get("x-kvfleet-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    Ok((status, worker, r.json()?))
}

fn assert_completion(resp: (u16, Option<String>, serde_json::Value), worker: Option<&str>) {
    let (status, served_by, body) = resp;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    assert!(
        body["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0,
        "{body}"
    );
    let served_by = served_by.expect("x-kvfleet-worker header");
    if let Some(w) = worker {
        assert_eq!(served_by, w);
    }
}

#[test]
fn https_front_serves_trusting_clients_and_survives_failed_handshakes() {
    let pki = Pki::new();
    let up = start(
        &[
            "up",
            "--http",
            "127.0.0.1:0",
            "--workers",
            "1",
            "--tls-cert",
            s(&pki.server_cert),
            "--tls-key",
            s(&pki.server_key),
        ],
        "https://",
    );
    let url = format!("https://{}", up.addr);
    let trusting = https_client(&pki.ca_pem);
    assert_completion(complete(&trusting, &url).expect("HTTPS request"), None);
    // By name as well as by IP: the certificate carries both.
    let port = up.addr.rsplit(':').next().expect("port");
    let by_name = format!("https://localhost:{port}");
    assert_completion(complete(&trusting, &by_name).expect("HTTPS by name"), None);

    // A client that trusts another CA refuses the server's certificate.
    let distrusting = https_client(&pki.other_ca_pem);
    let err = complete(&distrusting, &url).expect_err("untrusted server certificate");
    eprintln!("client trusting another CA: {err:?}");

    // Plain HTTP to the TLS port: the server answers no HTTP, and closes.
    let mut tcp = std::net::TcpStream::connect(&up.addr).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("write");
    let mut got = Vec::new();
    let read = tcp.read_to_end(&mut got);
    eprintln!(
        "plain HTTP to the TLS port: {read:?}, {} bytes back: {got:02x?}",
        got.len()
    );
    // Closed (EOF, or a reset if bytes were left unread); a timeout means it hung.
    match &read {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server did not close the connection: {e}"),
    }
    assert!(!got.starts_with(b"HTTP/"), "no HTTP answer");

    // A client that stalls mid-handshake does not block others either.
    let _stalled = std::net::TcpStream::connect(&up.addr).expect("connect");

    // The server keeps serving after all of that.
    assert_completion(
        complete(&trusting, &url).expect("HTTPS after failures"),
        None,
    );
    let health = trusting
        .get(format!("{url}/health"))
        .send()
        .expect("health");
    assert_eq!(health.status().as_u16(), 200);
}

/// Runs `kvfleet ARGS…` expecting it to fail; returns its stderr. Panics if it is
/// still running after `limit`.
fn run_failing(args: &[&str], limit: Duration) -> String {
    let serves = matches!(args.first(), Some(&("up" | "worker" | "router")));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
        .args(args)
        .args(if serves {
            support::model_args(args)
        } else {
            &[]
        })
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvfleet");
    let t = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvfleet {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    eprintln!(
        "kvfleet {} exited in {:?}: {}",
        args[0],
        t.elapsed(),
        err.trim()
    );
    assert!(!status.success(), "kvfleet {args:?} should fail: {err}");
    err
}

#[test]
fn mutual_tls_admits_only_routers_with_a_client_certificate_from_the_ca() {
    let pki = Pki::new();
    let worker = start(
        &[
            "worker",
            "--grpc",
            "127.0.0.1:0",
            "--worker-id",
            "w-tls",
            "--tls-cert",
            s(&pki.server_cert),
            "--tls-key",
            s(&pki.server_key),
            "--tls-client-ca",
            s(&pki.ca),
        ],
        "grpcs://",
    );
    let endpoint = format!("https://{}", worker.addr);

    let router = start(
        &[
            "router",
            "--http",
            "127.0.0.1:0",
            "--workers",
            &endpoint,
            "--worker-tls-ca",
            s(&pki.ca),
            "--worker-tls-cert",
            s(&pki.client_cert),
            "--worker-tls-key",
            s(&pki.client_key),
        ],
        "http://",
    );
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    let url = format!("http://{}", router.addr);
    assert_completion(complete(&http, &url).expect("request"), Some("w-tls"));

    // The router's connect timeout is 2 s and its unary deadline 10 s: a refused
    // router must be told within those, not hang.
    let limit = Duration::from_secs(20);
    let base = ["router", "--http", "127.0.0.1:0", "--workers", &endpoint];
    // No client certificate: the worker requires one.
    let err = run_failing(
        &[&base[..], &["--worker-tls-ca", s(&pki.ca)]].concat(),
        limit,
    );
    assert!(err.contains("adding worker"), "{err}");
    // A client certificate from a CA the worker does not trust.
    let err = run_failing(
        &[
            &base[..],
            &[
                "--worker-tls-ca",
                s(&pki.ca),
                "--worker-tls-cert",
                s(&pki.rogue_client_cert),
                "--worker-tls-key",
                s(&pki.rogue_client_key),
            ],
        ]
        .concat(),
        limit,
    );
    assert!(err.contains("adding worker"), "{err}");
    // The router does not trust the worker's certificate.
    let err = run_failing(
        &[
            &base[..],
            &[
                "--worker-tls-ca",
                s(&pki.other_ca),
                "--worker-tls-cert",
                s(&pki.client_cert),
                "--worker-tls-key",
                s(&pki.client_key),
            ],
        ]
        .concat(),
        limit,
    );
    assert!(err.contains("adding worker"), "{err}");
    // Plaintext to a TLS worker.
    let plain = format!("http://{}", worker.addr);
    let err = run_failing(
        &["router", "--http", "127.0.0.1:0", "--workers", &plain],
        limit,
    );
    assert!(err.contains("adding worker"), "{err}");

    // The worker still serves the router that holds the right certificate.
    assert_completion(complete(&http, &url).expect("request"), Some("w-tls"));
}

#[test]
fn unreadable_certificate_files_stop_the_process_at_start() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-cert.pem");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "this is not PEM\n").expect("write");
    let limit = Duration::from_secs(20);

    let err = run_failing(
        &[
            "up",
            "--http",
            "127.0.0.1:0",
            "--tls-cert",
            s(&missing),
            "--tls-key",
            s(&pki.server_key),
        ],
        limit,
    );
    assert!(err.contains("no-such-cert.pem"), "{err}");

    let err = run_failing(
        &[
            "up",
            "--http",
            "127.0.0.1:0",
            "--tls-cert",
            s(&pki.server_cert),
            "--tls-key",
            s(&garbage),
        ],
        limit,
    );
    assert!(
        err.contains("garbage.pem") && err.contains("private key"),
        "{err}"
    );

    let err = run_failing(
        &[
            "worker",
            "--grpc",
            "127.0.0.1:0",
            "--tls-cert",
            s(&pki.server_cert),
            "--tls-key",
            s(&pki.server_key),
            "--tls-client-ca",
            s(&garbage),
        ],
        limit,
    );
    assert!(
        err.contains("garbage.pem") && err.contains("certificate"),
        "{err}"
    );

    let err = run_failing(
        &[
            "router",
            "--http",
            "127.0.0.1:0",
            "--workers",
            "127.0.0.1:1",
            "--worker-tls-ca",
            s(&missing),
        ],
        limit,
    );
    assert!(err.contains("no-such-cert.pem"), "{err}");
}
