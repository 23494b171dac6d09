//! [`WatchStream`]: the receiving end of a watch, fed by a background task that
//! resumes the underlying stream after errors. Dropping it stops the task.

use crate::error::Result;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A stream of watch items; the task feeding it stops when it is dropped.
pub struct WatchStream<T> {
    rx: mpsc::Receiver<Result<T>>,
    task: Option<JoinHandle<()>>,
}

impl<T> WatchStream<T> {
    /// A stream over `rx`, owning the `task` that feeds it.
    pub fn new(rx: mpsc::Receiver<Result<T>>, task: Option<JoinHandle<()>>) -> Self {
        WatchStream { rx, task }
    }

    /// The next item; `None` once the stream is closed. An `Err` item is fatal for the
    /// watch (for example a compacted revision): the stream ends after it.
    pub async fn next(&mut self) -> Option<Result<T>> {
        self.rx.recv().await
    }
}

impl<T> Drop for WatchStream<T> {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}
