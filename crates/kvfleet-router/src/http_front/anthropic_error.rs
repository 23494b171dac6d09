//! Errors in Anthropic's shape, for `/v1/messages`: its handler and the gate in front
//! of every inference route (which must not depend on the handler) both answer with
//! them.

use crate::openai::error::ApiError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvfleet_core::anthropic::ErrorDetail;

/// Anthropic's error type for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if (400..500).contains(&s) => "invalid_request_error",
        _ => "api_error",
    }
}

/// An error as Anthropic answers it: `{"type": "error", "error": {"type", "message"}}`,
/// same status (and `Retry-After`) as the OpenAI front ends.
pub(super) fn error_response(e: &ApiError) -> Response {
    let body = serde_json::json!({
        "type": "error",
        "error": ErrorDetail { kind: error_type(e.status), message: e.message.clone() },
    });
    let mut r = (e.status, Json(body)).into_response();
    if let Some(s) = e.retry_after {
        r.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, s.into());
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_anthropics_error_types() {
        let r = error_response(&ApiError::unavailable("busy"));
        assert_eq!(r.status(), 503);
        assert_eq!(error_type(StatusCode::UNAUTHORIZED), "authentication_error");
        assert_eq!(error_type(StatusCode::BAD_GATEWAY), "api_error");
    }
}
