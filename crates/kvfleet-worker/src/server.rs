//! Running a worker: `serve` on a listener until a shutdown signal (what
//! `kvfleet worker --grpc ADDR` does), or `spawn_worker` on a loopback port in the
//! background (what the embedded cluster does for each of its workers).

use crate::config::WorkerConfig;
use crate::engine_health::EngineHealth;
use crate::error::WorkerError;
use crate::service::WorkerService;
use kvfleet_proto::v1::InfoResponse;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Server, ServerTlsConfig};

/// Loads the model, starts the engine and serves the worker API on `listener` until
/// `shutdown` resolves. Shutdown is graceful: the listener stops accepting, live
/// `KvEvents` streams end with UNAVAILABLE, running `Generate` streams finish, and the
/// engine thread is stopped before this returns.
pub async fn serve<F>(
    config: WorkerConfig,
    listener: TcpListener,
    shutdown: F,
) -> Result<(), WorkerError>
where
    F: Future<Output = ()>,
{
    let service = WorkerService::start(config).await?;
    serve_service(service, listener, shutdown).await
}

/// Serves an already started [`WorkerService`] (see [`serve`]).
pub async fn serve_service<F>(
    service: WorkerService,
    listener: TcpListener,
    shutdown: F,
) -> Result<(), WorkerError>
where
    F: Future<Output = ()>,
{
    serve_service_tls(service, listener, None, shutdown).await
}

/// Like [`serve_service`], over TLS when `tls` is given (with client-certificate
/// checks when it names a client CA: mutual TLS).
pub async fn serve_service_tls<F>(
    service: WorkerService,
    listener: TcpListener,
    tls: Option<ServerTlsConfig>,
    shutdown: F,
) -> Result<(), WorkerError>
where
    F: Future<Output = ()>,
{
    let closer = service.event_stream_closer();
    let stopped = service.engine_stopped();
    let worker_id = service.info().worker_id.clone();
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut builder = Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let result = builder
        .add_service(service.into_server())
        .serve_with_incoming_shutdown(incoming, async move {
            shutdown.await;
            tracing::info!(worker = %worker_id, "worker shutting down");
            closer.close();
        })
        .await;
    if result.is_ok() {
        // The server (and with it the last handle to the engine) is gone.
        stopped.await;
    }
    result.map_err(WorkerError::from)
}

/// Starts a worker on `127.0.0.1` with a port the OS picks, serving in a background
/// task; returns once the engine is ready. Dropping the handle shuts the worker down
/// gracefully in the background; [`WorkerHandle::shutdown`] also waits for it.
pub async fn spawn_worker(config: WorkerConfig) -> Result<WorkerHandle, WorkerError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    spawn_worker_on(config, listener).await
}

/// Like [`spawn_worker`], on a listener the caller bound.
pub async fn spawn_worker_on(
    config: WorkerConfig,
    listener: TcpListener,
) -> Result<WorkerHandle, WorkerError> {
    let addr = listener.local_addr()?;
    let service = WorkerService::start(config).await?;
    let info = service.info().clone();
    let health = service.health();
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(serve_service(service, listener, async move {
        // A send or a dropped handle: either way, shut down.
        let _ = shutdown_rx.await;
    }));
    Ok(WorkerHandle {
        addr,
        info,
        health,
        shutdown: Some(shutdown_tx),
        task: Some(task),
    })
}

/// A worker serving in the background (see [`spawn_worker`]).
pub struct WorkerHandle {
    addr: SocketAddr,
    info: InfoResponse,
    health: EngineHealth,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), WorkerError>>>,
}

impl WorkerHandle {
    /// The address the worker listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The worker's URL for a gRPC client (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The worker's id.
    pub fn worker_id(&self) -> &str {
        &self.info.worker_id
    }

    /// The worker's static facts (what `Info` answers).
    pub fn info(&self) -> &InfoResponse {
        &self.info
    }

    /// Whether the worker's engine thread still serves, or how it ended.
    pub fn health(&self) -> &EngineHealth {
        &self.health
    }

    /// Shuts the worker down gracefully and waits until it has stopped.
    pub async fn shutdown(mut self) -> Result<(), WorkerError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.task.take() {
            Some(task) => task
                .await
                .map_err(|e| WorkerError::Task(format!("worker server task: {e}")))?,
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle")
            .field("worker_id", &self.info.worker_id)
            .field("addr", &self.addr)
            .finish()
    }
}
