//! Pulling a prompt's prefix blocks from the peer worker that holds them
//! (`FetchBlocks`), instead of recomputing them: the worker side of a router's pull
//! hint. Every call has a deadline; a peer that is unreachable, refuses, or dies
//! mid-transfer yields the complete blocks received so far (a leading run of the
//! chain), and the request recomputes the rest. Nothing here can lose the request.

use kvfleet_core::BlockHash;
use kvfleet_engine::KvBlockPayload;
use kvfleet_proto::v1 as pb;
use kvfleet_proto::v1::worker_client::WorkerClient;
use metrics::counter;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Status, Streaming};
use xxhash_rust::xxh3::xxh3_64;

/// Connecting to a peer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The whole pull, whatever its size: past it the request recomputes the rest.
const PULL_TIMEOUT: Duration = Duration::from_secs(10);
/// From asking a peer to its first block (connecting included). A live holder serves
/// from its ready blocks off its engine thread, so it answers in milliseconds; one
/// that has not answered by now is hung, and the request, not yet acknowledged to
/// its router, would otherwise wait for it to the end of [`PULL_TIMEOUT`] and miss
/// its first-token deadline on a healthy worker.
const PULL_START_TIMEOUT: Duration = Duration::from_millis(500);
/// Peers whose channel is kept (a fleet rarely has more; past it the cache restarts).
const MAX_PEERS: usize = 256;
/// Most blocks one pull asks for.
pub const MAX_PULL_BLOCKS: usize = 4096;

/// Clients of the peers this worker pulled from, reused across requests.
pub struct PeerPuller {
    worker: String,
    tls: Option<ClientTlsConfig>,
    clients: Mutex<HashMap<String, WorkerClient<Channel>>>,
    /// Blocks and bytes received whole since start (the metrics' totals, kept here
    /// too so that `Load` can report them).
    pulled_blocks: AtomicU64,
    pulled_bytes: AtomicU64,
}

/// What a pull brought back.
pub struct Pulled {
    /// Complete, checksummed blocks: a leading run of the hashes asked for.
    pub blocks: Vec<KvBlockPayload>,
    /// Why it stopped short, if it did.
    pub error: Option<String>,
}

impl PeerPuller {
    /// A puller for worker `worker` (its metrics label), with the TLS client config
    /// used for `https://` peers.
    pub fn new(worker: &str, tls: Option<ClientTlsConfig>) -> Arc<Self> {
        // Exposed from the start, so that a fleet that has not pulled yet reads 0 on the
        // dashboards (pulls are on by default; a failure count is what an SRE watches).
        for name in [
            "kvfleet_worker_peer_pull_blocks_total",
            "kvfleet_worker_peer_pull_bytes_total",
            "kvfleet_worker_peer_pull_failures_total",
        ] {
            counter!(name, "worker" => worker.to_string()).increment(0);
        }
        Arc::new(Self {
            worker: worker.to_string(),
            tls,
            clients: Mutex::new(HashMap::new()),
            pulled_blocks: AtomicU64::new(0),
            pulled_bytes: AtomicU64::new(0),
        })
    }

    /// Blocks and bytes received whole and verified from peers since start.
    pub fn pulled(&self) -> (u64, u64) {
        (
            self.pulled_blocks.load(Ordering::Relaxed),
            self.pulled_bytes.load(Ordering::Relaxed),
        )
    }

    /// Pulls `hashes` (a chain) from `endpoint`, expecting blocks of `format` and
    /// `bytes` each.
    pub async fn pull(&self, endpoint: &str, hashes: &[u64], format: &str, bytes: u64) -> Pulled {
        let w = self.worker.clone();
        let res = tokio::time::timeout(
            PULL_TIMEOUT,
            self.pull_inner(endpoint, hashes, format, bytes),
        )
        .await;
        let (blocks, error) = match res {
            Ok(p) => (p.blocks, p.error),
            Err(_) => (Vec::new(), Some(format!("pull from {endpoint} timed out"))),
        };
        let n = blocks.len() as u64;
        let bytes_in: u64 = blocks.iter().map(|b| b.bytes.len() as u64).sum();
        self.pulled_blocks.fetch_add(n, Ordering::Relaxed);
        self.pulled_bytes.fetch_add(bytes_in, Ordering::Relaxed);
        counter!("kvfleet_worker_peer_pull_blocks_total", "worker" => w.clone()).increment(n);
        counter!("kvfleet_worker_peer_pull_bytes_total", "worker" => w.clone()).increment(bytes_in);
        if let Some(e) = &error {
            counter!("kvfleet_worker_peer_pull_failures_total", "worker" => w).increment(1);
            tracing::warn!(worker = %self.worker, peer = %endpoint, got = blocks.len(), want = hashes.len(), "peer pull stopped short: {e}");
        }
        Pulled { blocks, error }
    }

    async fn pull_inner(&self, endpoint: &str, hashes: &[u64], format: &str, bytes: u64) -> Pulled {
        let mut blocks = Vec::new();
        let started = tokio::time::timeout(
            PULL_START_TIMEOUT,
            self.start_fetch(endpoint, hashes, format, bytes),
        )
        .await;
        let (mut stream, mut next) = match started {
            Ok(Ok(s)) => s,
            Ok(Err(error)) => {
                return Pulled {
                    blocks,
                    error: Some(error),
                }
            }
            Err(_) => {
                // Hung (stopped, or its runtime wedged): its channel is not reused.
                self.forget(endpoint);
                return Pulled {
                    blocks,
                    error: Some(format!(
                        "peer {endpoint} sent nothing within {PULL_START_TIMEOUT:?}"
                    )),
                };
            }
        };
        loop {
            match next {
                Ok(Some(b)) => {
                    let i = blocks.len();
                    let ok = hashes.get(i) == Some(&b.hash)
                        && b.data.len() as u64 == bytes
                        && xxh3_64(&b.data) == b.checksum;
                    if !ok {
                        return Pulled {
                            blocks,
                            error: Some(format!(
                                "block {i} from the peer is not the one asked for, or damaged"
                            )),
                        };
                    }
                    blocks.push(KvBlockPayload {
                        hash: BlockHash(b.hash),
                        parent: b.parent_hash.map(BlockHash),
                        bytes: Arc::from(b.data),
                    });
                }
                Ok(None) => {
                    return Pulled {
                        blocks,
                        error: None,
                    }
                }
                Err(s) => {
                    // The peer died or the link broke mid-transfer: keep what is whole.
                    self.forget(endpoint);
                    return Pulled {
                        blocks,
                        error: Some(format!("transfer broke: {}", s.message())),
                    };
                }
            }
            next = stream.message().await;
        }
    }

    /// Connects (or reuses the channel), asks for the blocks and waits for the first
    /// answer: the stream and that answer.
    async fn start_fetch(
        &self,
        endpoint: &str,
        hashes: &[u64],
        format: &str,
        bytes: u64,
    ) -> Result<
        (
            Streaming<pb::KvBlockData>,
            Result<Option<pb::KvBlockData>, Status>,
        ),
        String,
    > {
        let mut client = self.client(endpoint).await?;
        let req = pb::FetchBlocksRequest {
            block_hashes: hashes.to_vec(),
            block_format: format.to_string(),
            block_bytes: bytes,
        };
        let mut stream = match client.fetch_blocks(req).await {
            Ok(s) => s.into_inner(),
            Err(s) => {
                self.forget(endpoint);
                return Err(format!("FetchBlocks: {}", s.message()));
            }
        };
        let first = stream.message().await;
        Ok((stream, first))
    }

    async fn client(&self, endpoint: &str) -> Result<WorkerClient<Channel>, String> {
        if let Some(c) = kvfleet_core::sync::lock(&self.clients).get(endpoint) {
            return Ok(c.clone());
        }
        let uri = if endpoint.contains("://") {
            endpoint.to_string()
        } else if self.tls.is_some() {
            format!("https://{endpoint}")
        } else {
            format!("http://{endpoint}")
        };
        let mut ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| format!("bad peer endpoint {uri}: {e}"))?;
        if uri.starts_with("https://") {
            let Some(tls) = &self.tls else {
                return Err(format!(
                    "peer {uri} needs TLS and this worker has no --worker-tls-ca"
                ));
            };
            ep = ep
                .tls_config(tls.clone())
                .map_err(|e| format!("peer TLS: {e}"))?;
        }
        let ep = ep.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true);
        let channel = tokio::time::timeout(CONNECT_TIMEOUT, ep.connect())
            .await
            .map_err(|_| format!("connecting to peer {uri} timed out"))?
            .map_err(|e| format!("cannot connect to peer {uri}: {e}"))?;
        let client = WorkerClient::new(channel).max_decoding_message_size(64 << 20);
        let mut map = kvfleet_core::sync::lock(&self.clients);
        if map.len() >= MAX_PEERS {
            map.clear();
        }
        map.insert(endpoint.to_string(), client.clone());
        Ok(client)
    }

    fn forget(&self, endpoint: &str) {
        kvfleet_core::sync::lock(&self.clients).remove(endpoint);
    }
}
