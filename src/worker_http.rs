//! A worker's HTTP side (`kvfleet worker --metrics ADDR`): `/metrics` (Prometheus, the
//! `kvfleet_worker_*` series) and `/health`, which follows the engine thread: 200 `ok`
//! while it serves, 503 with the reason once it has failed (so the kubelet's probes
//! fail even in the moments before the process exits).

use anyhow::{Context, Result};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use kvfleet_worker::{EngineHealth, EngineStatus};
use serde_json::json;

/// The worker's `/metrics` and `/health` app.
pub fn app(health: EngineHealth) -> Router {
    Router::new()
        .route("/metrics", get(kvfleet_router::http_front::metrics))
        .route("/health", get(move || health_of(health.clone())))
}

/// `GET /health`: 200 `ok` while the engine serves; 503
/// `{"status":"engine_failed","error":…,"failed_ms_ago":…}` once it has failed (and
/// `{"status":"stopped"}` while a graceful shutdown ends).
async fn health_of(health: EngineHealth) -> Response {
    match health.status() {
        EngineStatus::Running => "ok".into_response(),
        EngineStatus::Stopped => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "stopped"})),
        )
            .into_response(),
        EngineStatus::Failed { reason, at } => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "status": "engine_failed",
                "error": reason,
                "failed_ms_ago": at.elapsed().as_millis() as u64,
            })),
        )
            .into_response(),
    }
}

/// Serves [`app`] on `addr` in the background; returns the bound address and the
/// server task.
pub async fn serve(
    addr: &str,
    health: EngineHealth,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding --metrics {addr}"))?;
    let bound = listener.local_addr()?;
    let app = app(health);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("metrics server stopped: {e}");
        }
    });
    Ok((bound, task))
}
