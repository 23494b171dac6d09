//! The worker's error type: what can stop a worker from starting or serving.
//! (Per-request failures are gRPC statuses, not `WorkerError`s.)

use kvfleet_engine::EngineError;
use thiserror::Error;

/// Why a worker could not start, or stopped serving.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// The configuration is unusable (zero-sized ring, empty worker id, ...).
    #[error("worker configuration: {0}")]
    Config(String),
    /// The model could not be loaded or the engine could not be built.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    /// Binding or inspecting the listening socket, or spawning the engine thread.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The engine thread or the server task ended unexpectedly.
    #[error("worker task: {0}")]
    Task(String),
}
