//! Whether the engine thread still runs: what a worker's `/health` answers and what
//! tells `kvfleet worker` to leave membership and exit once its engine has died (a
//! worker whose engine is gone must not keep its lease and its gRPC port, or routers
//! keep sending to it and Kubernetes never restarts it).
//!
//! The engine thread is the only writer (through [`HealthReporter`]); everyone else
//! holds a cheap [`EngineHealth`] clone and only reads.

use std::time::Instant;
use tokio::sync::watch;

/// The engine thread's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineStatus {
    /// Serving.
    Running,
    /// Stopped because the worker shut down (every handle to it was dropped).
    Stopped,
    /// Ended by a failure (a panic, or the thread ending any other way while handles
    /// to it remained): its requests were failed with UNAVAILABLE.
    Failed {
        /// What failed.
        reason: String,
        /// When the engine thread noticed.
        at: Instant,
    },
}

/// A read-only view of the engine thread's state; clones share it.
#[derive(Clone, Debug)]
pub struct EngineHealth {
    rx: watch::Receiver<EngineStatus>,
}

impl EngineHealth {
    /// The current state.
    pub fn status(&self) -> EngineStatus {
        self.rx.borrow().clone()
    }

    /// Whether the engine thread is serving.
    pub fn is_running(&self) -> bool {
        *self.rx.borrow() == EngineStatus::Running
    }

    /// Resolves with the reason and time once the engine has failed; never, if it
    /// stops normally.
    pub async fn failed(&self) -> (String, Instant) {
        let mut rx = self.rx.clone();
        loop {
            if let EngineStatus::Failed { reason, at } = &*rx.borrow_and_update() {
                return (reason.clone(), *at);
            }
            if rx.changed().await.is_err() {
                // The reporter is gone and its last word was not a failure.
                if let EngineStatus::Failed { reason, at } = &*rx.borrow() {
                    return (reason.clone(), *at);
                }
                return std::future::pending().await;
            }
        }
    }
}

/// The engine thread's end of [`EngineHealth`]. Dropped while still `Running` (the
/// thread unwound past every handler), it reports a failure.
pub(crate) struct HealthReporter {
    tx: watch::Sender<EngineStatus>,
}

impl HealthReporter {
    /// A reporter in state `Running` and the view it feeds.
    pub(crate) fn new() -> (Self, EngineHealth) {
        let (tx, rx) = watch::channel(EngineStatus::Running);
        (HealthReporter { tx }, EngineHealth { rx })
    }

    /// The engine has failed with `reason`.
    pub(crate) fn failed(&self, reason: String) {
        self.tx.send_replace(EngineStatus::Failed {
            reason,
            at: Instant::now(),
        });
    }

    /// The engine stopped because the worker is shutting down.
    pub(crate) fn stopped(&self) {
        self.tx.send_if_modified(|s| {
            let running = *s == EngineStatus::Running;
            if running {
                *s = EngineStatus::Stopped;
            }
            running
        });
    }
}

impl Drop for HealthReporter {
    fn drop(&mut self) {
        if *self.tx.borrow() == EngineStatus::Running {
            self.failed("the engine thread ended unexpectedly".into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failure_is_seen_by_every_view() {
        let (reporter, health) = HealthReporter::new();
        let other = health.clone();
        assert!(health.is_running());
        let waiter = tokio::spawn(async move { other.failed().await.0 });
        reporter.failed("boom".into());
        assert_eq!(waiter.await.expect("join"), "boom");
        assert!(!health.is_running());
    }

    #[tokio::test]
    async fn a_reporter_dropped_while_running_reports_a_failure() {
        let (reporter, health) = HealthReporter::new();
        drop(reporter);
        assert!(matches!(health.status(), EngineStatus::Failed { .. }));
        let (reason, _) = health.failed().await;
        assert!(reason.contains("unexpectedly"), "{reason}");
    }

    #[tokio::test]
    async fn a_normal_stop_is_not_a_failure() {
        let (reporter, health) = HealthReporter::new();
        reporter.stopped();
        drop(reporter);
        assert_eq!(health.status(), EngineStatus::Stopped);
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(50), health.failed()).await;
        assert!(
            waited.is_err(),
            "failed() must not resolve after a normal stop"
        );
    }
}
