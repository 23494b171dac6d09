//! Fleet-facing endpoints: models, health, Prometheus metrics and the JSON fleet state.

use crate::fleet::Fleet;
use crate::fleet_metrics;
use crate::openai::error::ApiError;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvfleet_core::openai::{ModelCard, ModelList};
use std::sync::Arc;

/// `GET /v1/models`.
pub async fn models(State(fleet): State<Arc<Fleet>>) -> Json<ModelList> {
    let data = fleet
        .model()
        .map(|(id, ctx)| ModelCard {
            id,
            object: "model",
            created: 0,
            owned_by: "kvfleet",
            max_model_len: ctx,
        })
        .into_iter()
        .collect();
    Json(ModelList {
        object: "list",
        data,
    })
}

/// `GET /health`: 200 while at least one worker can be routed to, 503 otherwise or
/// once a graceful shutdown has started (`"status": "draining"`). With a control plane,
/// `membership` (etcd) and `events` (Kafka) say whether it is reachable; `stale` means
/// the router serves on what it last knew.
pub async fn health(State(fleet): State<Arc<Fleet>>) -> Response {
    let healthy = fleet.workers.healthy_count();
    let draining = fleet.is_draining();
    let status = match (draining, healthy > 0) {
        (true, _) => "draining",
        (false, true) => "ok",
        (false, false) => "no_workers",
    };
    let mut body = serde_json::json!({
        "status": status,
        "healthy_workers": healthy,
        "workers": fleet.workers.statuses().len(),
    });
    for (component, s) in fleet.control_plane_status() {
        let key = match component {
            "etcd" => "membership",
            "kafka" => "events",
            other => other,
        };
        body[key] = serde_json::json!({
            "status": if s.up { "live" } else { "stale" },
            "since_s": s.since.elapsed().as_secs_f64(),
        });
    }
    let code = if status == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text exposition.
pub async fn metrics() -> Response {
    match fleet_metrics::prometheus_handle() {
        Some(h) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            h.render(),
        )
            .into_response(),
        None => ApiError::internal("metrics recorder unavailable").into_response(),
    }
}

/// `GET /fleet`: workers, their load and counters, the index, recent decisions.
pub async fn fleet_state(State(fleet): State<Arc<Fleet>>) -> Json<serde_json::Value> {
    fleet.workers.refresh_loads().await;
    let snapshot = fleet.routing.snapshot();
    let (colocated, fork_requests) = fleet.decisions.fork_colocation();
    Json(serde_json::json!({
        "model": fleet.model().map(|m| m.0),
        "workers": fleet.workers.statuses(),
        "router": snapshot,
        "fork_groups": { "colocated": colocated, "requests": fork_requests },
        "recent_decisions": fleet.decisions.recent(),
    }))
}

/// Anything else: an OpenAI-style 404.
pub async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "no such endpoint".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
        retry_after: None,
    }
}
