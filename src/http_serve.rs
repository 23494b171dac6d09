//! Serving the router's axum app on a listener: plain HTTP through `axum::serve`, or
//! HTTPS through a rustls acceptor in front of hyper's HTTP/1.1 + HTTP/2 connection
//! builder. Both stop accepting when `shutdown` resolves and wait for open
//! connections to finish their requests.

use anyhow::{Context, Result};
use axum::serve::{ListenerExt, TapIo};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

use crate::tls_args::HANDSHAKE_TIMEOUT;

/// `listener` with TCP_NODELAY set on every connection it accepts, as the TLS path
/// sets it: `axum::serve` leaves Nagle's algorithm on, which holds each small
/// streamed chunk until the client acknowledges the last one.
fn plain_listener(listener: TcpListener) -> TapIo<TcpListener, fn(&mut TcpStream)> {
    fn no_delay(tcp: &mut TcpStream) {
        // Only a closed socket refuses it; its connection then ends on its own.
        let _ = tcp.set_nodelay(true);
    }
    listener.tap_io(no_delay)
}

/// Serves `app` on `listener` until `shutdown` resolves: HTTPS with `tls`, plain HTTP
/// without. A failed or timed-out TLS handshake closes that connection only.
pub async fn serve_http<F>(
    listener: TcpListener,
    app: axum::Router,
    tls: Option<Arc<ServerConfig>>,
    shutdown: F,
) -> Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let Some(tls) = tls else {
        return axum::serve(plain_listener(listener), app)
            .with_graceful_shutdown(shutdown)
            .await
            .context("serving HTTP");
    };
    let acceptor = TlsAcceptor::from(tls);
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.as_mut() => break,
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let builder = builder.clone();
        let app = app.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = TowerToHyperService::new(app);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%peer, error = %e, "HTTPS connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::serve::Listener;

    /// A streamed reply's small chunks (SSE tokens) must leave at once: with Nagle's
    /// algorithm on, a chunk written while the previous one is unacknowledged waits
    /// for the client's delayed ACK (40 ms on Linux), which added about 65 ms to the
    /// first token of every request on a reused connection.
    #[tokio::test]
    async fn plain_http_connections_send_without_nagle_delay() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = plain_listener(listener);
        let client = tokio::spawn(tokio::net::TcpStream::connect(addr));
        let (io, _) = listener.accept().await;
        assert!(
            io.nodelay().unwrap(),
            "TCP_NODELAY is off on an accepted connection"
        );
        drop(client.await.unwrap().unwrap());
    }
}
