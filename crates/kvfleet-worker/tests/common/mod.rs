//! What the worker's gRPC tests share: a worker on loopback with its client, and
//! deterministic prompts.

#![allow(dead_code)]

use kvfleet_core::{hash_blocks, namespace_seed};
use kvfleet_proto::v1::worker_client::WorkerClient;
use kvfleet_worker::{spawn_worker, WorkerConfig, WorkerHandle};
use tonic::transport::Channel;

/// Tokens per block in these tests.
pub const BS: usize = 16;

/// A `tiny` worker with 256 blocks of [`BS`] (adjusted by `tweak`), and a client.
pub async fn worker(
    id: &str,
    tweak: impl FnOnce(&mut WorkerConfig),
) -> (WorkerHandle, WorkerClient<Channel>) {
    let mut config = WorkerConfig::new(id, "tiny");
    config.num_blocks = 256;
    config.block_size = BS;
    tweak(&mut config);
    let handle = spawn_worker(config).await.expect("worker starts");
    let client = WorkerClient::connect(handle.endpoint())
        .await
        .expect("client connects");
    (handle, client)
}

/// A prompt of `n` token ids below the tiny model's vocabulary (320), varied by `seed`.
pub fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed.wrapping_mul(97) + i * 7 + i / 5) % 300 + 1)
        .collect()
}

/// The chained block hashes of `tokens` (model `tiny`, no salt), as sent on the wire.
pub fn hashes(tokens: &[u32]) -> Vec<u64> {
    hash_blocks(namespace_seed("tiny", ""), tokens, BS)
        .into_iter()
        .map(|h| h.0)
        .collect()
}
