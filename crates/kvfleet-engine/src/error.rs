//! The engine's error type.

use thiserror::Error;

/// Everything that can go wrong inside the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The request itself is unacceptable (empty prompt, over the context length...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A model directory or configuration could not be understood.
    #[error("model configuration: {0}")]
    Config(String),
    /// Reading model files failed.
    #[error("i/o on {path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Model weights are missing, misshapen or of an unsupported type.
    #[error("model weights: {0}")]
    Weights(String),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The compute device is missing, unusable or failed (CUDA libraries, GPU, kernels).
    #[error("device: {0}")]
    Device(String),
    /// The KV cache cannot hold even one request of this size.
    #[error("out of KV blocks: {0}")]
    OutOfBlocks(String),
}

/// Result alias for the engine.
pub type Result<T> = std::result::Result<T, EngineError>;
