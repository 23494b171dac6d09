//! kvfleet-proto: the gRPC messages and services of kvfleet, generated at build time
//! from `proto/kvfleet/v1/*.proto` (protox + tonic-prost-build; no system `protoc`).
//!
//! Everything lives under [`v1`]: the messages (`GenerateRequest`, `KvEventBatch`, …),
//! the client (`v1::worker_client::WorkerClient`) and the server trait and wrapper
//! (`v1::worker_server::{Worker, WorkerServer}`). [`kv_events`] converts the wire KV
//! events into `kvfleet-core`'s.

pub mod kv_events;

/// Package `kvfleet.v1`: the worker API (see `proto/kvfleet/v1/worker.proto`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("kvfleet.v1");
}
