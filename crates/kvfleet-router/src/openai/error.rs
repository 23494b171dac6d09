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
        (self.status, Json(self.body())).into_response()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}
