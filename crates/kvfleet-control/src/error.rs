//! The control plane's error type.

use std::future::Future;
use std::time::Duration;

/// Why a control-plane call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// A network call took longer than its deadline.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// The call.
        what: &'static str,
        /// Its deadline.
        after: Duration,
    },
    /// etcd answered with an error or could not be reached.
    #[error("etcd: {0}")]
    Etcd(String),
    /// Kafka answered with an error or could not be reached.
    #[error("kafka: {0}")]
    Kafka(String),
    /// A stored value or message could not be decoded.
    #[error("cannot decode {what}: {message}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// The decoder's message.
        message: String,
    },
    /// The lease is gone (expired or revoked): the registration no longer exists.
    #[error("lease {0} is gone (expired or revoked)")]
    LeaseLost(i64),
    /// The watched revision was compacted away: list again and watch from there.
    #[error("revision {0} was compacted; list again and watch from the listed revision")]
    Compacted(i64),
    /// The implementation was shut down.
    #[error("the control plane connection is closed")]
    Closed,
    /// An argument was invalid.
    #[error("invalid argument: {0}")]
    Invalid(String),
}

/// Result of a control-plane call.
pub type Result<T> = std::result::Result<T, ControlError>;

/// Runs `fut` with a deadline, turning expiry into [`ControlError::Timeout`].
pub async fn timeout<T>(
    after: Duration,
    what: &'static str,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(after, fut).await {
        Ok(r) => r,
        Err(_) => Err(ControlError::Timeout { what, after }),
    }
}
