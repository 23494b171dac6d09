//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`
//! with the HTTP status clients expect.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

/// An error answered to an API client.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// Machine-readable code, if any.
    pub code: Option<&'static str>,
    /// Seconds the client should wait before retrying (`Retry-After`), for 429s.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400: the request is malformed or invalid.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// 404: the model does not exist here.
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 400: the prompt does not fit the model.
    pub fn context_length(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            param: Some("messages".into()),
            ..Self::invalid(message)
        }
    }

    /// 503: no worker can take the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("no_worker_available"),
            retry_after: None,
        }
    }

    /// 500: something failed inside the fleet.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 401: no API key, or one that is not configured.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 403: a valid key that may not use this resource.
    pub fn forbidden(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::FORBIDDEN,
            message: message.into(),
            kind: "permission_error",
            param: None,
            code: Some("insufficient_permissions"),
            retry_after: None,
        }
    }

    /// 413: the request body exceeds the router's limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body exceeds the limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }

    /// 408: the client did not send its whole body within the router's deadline.
    pub fn body_timeout(limit: std::time::Duration) -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!("the request body did not arrive within {limit:?}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
            retry_after: None,
        }
    }

    /// 429: a rate or concurrency limit; `kind` is OpenAI's `requests` or `tokens`.
    pub fn rate_limited(
        kind: &'static str,
        message: impl Into<String>,
        retry_after_s: u64,
    ) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind,
            param: None,
            code: Some("rate_limit_exceeded"),
            retry_after: Some(retry_after_s),
        }
    }

    /// 502: the worker serving the request failed or stalled after it started (it
    /// cannot be retried elsewhere: tokens may already have been produced).
    pub fn worker_failed(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("worker_failed"),
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::to_value(ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .unwrap_or_default()
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'static str>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}
