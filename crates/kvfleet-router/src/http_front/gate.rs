//! The HTTP front's admission middleware: authenticates the API key, checks the body
//! size, admits inference requests under the tenant's and the router's limits, and
//! hands the handlers the request's tenant.
//!
//! Which paths need what:
//!
//! - `/health`, `/metrics`, `/openapi.json`: open (probes, scrapes, tooling); so is the
//!   `/dashboard` page itself, which holds no data.
//! - `/v1/*`: a configured key (401 `invalid_api_key` otherwise).
//! - `/fleet`, `/dashboard/state`: a key flagged `admin` (401 without a key, 403 with a
//!   non-admin one): both show every tenant's routing.
//!
//! An inference request's body is read in full (bounded in bytes, and within
//! [`Limits::body_timeout`](crate::admission::Limits::body_timeout), else 408) before it
//! asks for a running slot: a client that stalls its upload holds a connection, never a
//! slot that other requests wait for.
//!
//! Without a keys file every request runs as tenant `default` (admin). Refusals on
//! Anthropic's `/v1/messages` have Anthropic's error shape, all others OpenAI's.

use crate::admission::{Admission, Refusal, RunPermit, TenantState};
use crate::openai::error::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// What the handlers learn from admission: the tenant and the per-request limits.
#[derive(Clone, Debug)]
pub struct Admitted {
    /// The request's tenant.
    pub tenant: Arc<TenantState>,
    /// Most prompt tokens a request may carry.
    pub max_prompt_tokens: Option<usize>,
    /// Most tokens a request may generate.
    pub max_completion_tokens: Option<usize>,
}

impl Admitted {
    /// The tenant's cache salt for a request whose own salt is `salt`.
    pub fn cache_salt(&self, salt: Option<&str>) -> String {
        crate::tenants::tenant_cache_salt(&self.tenant.tenant.namespace, salt.unwrap_or_default())
    }

    /// The name usage records carry: the tenant when keys are configured, else the
    /// request's own salt (today's meaning of a tenant).
    pub fn usage_tenant(&self, salt: &str) -> String {
        if self.tenant.tenant.namespace.is_empty() {
            salt.to_string()
        } else {
            self.tenant.tenant.name.clone()
        }
    }

    /// Applies the router's completion cap to `params`: the default when the client
    /// set no `max_tokens`, a 400 when it asked for more.
    pub fn cap_completion(
        &self,
        fields: &kvfleet_core::openai::SamplingFields,
        params: &mut kvfleet_proto::v1::SamplingParams,
    ) -> Result<(), ApiError> {
        let Some(cap) = self.max_completion_tokens else {
            return Ok(());
        };
        let cap = i32::try_from(cap).unwrap_or(i32::MAX);
        if params.max_tokens <= cap {
            return Ok(());
        }
        if fields.max_completion_tokens.or(fields.max_tokens).is_some() {
            return Err(ApiError::invalid_param(
                "max_tokens",
                format!(
                    "max_tokens is {}; this router allows at most {cap}",
                    params.max_tokens
                ),
            ));
        }
        params.max_tokens = cap;
        Ok(())
    }

    /// Checks the (longest) prompt's length and charges the tenant's token bucket
    /// `cost` tokens: prompts plus completion budgets.
    pub fn charge(&self, prompt_tokens: usize, cost: usize) -> Result<(), ApiError> {
        if let Some(max) = self.max_prompt_tokens {
            if prompt_tokens > max {
                return Err(ApiError::context_length(format!(
                    "the prompt has {prompt_tokens} tokens; this router accepts at most {max}"
                )));
            }
        }
        self.tenant
            .charge_tokens(cost as u64)
            .map_err(refusal_error)
    }
}

/// The API key of a request: `Authorization: Bearer <key>`, else `x-api-key`.
fn api_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let mut parts = v.splitn(2, ' ');
        if let (Some(scheme), Some(key)) = (parts.next(), parts.next()) {
            if scheme.eq_ignore_ascii_case("bearer") {
                return Some(key.trim());
            }
        }
    }
    headers.get("x-api-key").and_then(|v| v.to_str().ok())
}

/// A refusal as its OpenAI error.
pub fn refusal_error(r: Refusal) -> ApiError {
    match r {
        Refusal::TenantConcurrency { limit } => ApiError::rate_limited(
            "requests",
            format!("this key's tenant already runs its limit of {limit} concurrent requests"),
            1,
        ),
        Refusal::TenantTokens {
            needed,
            per_minute,
            retry_after_s,
        } => ApiError::rate_limited(
            "tokens",
            format!(
                "rate limit reached: this request needs {needed} tokens (prompt + max_tokens) \
                 and the tenant's limit is {per_minute} tokens per minute"
            ),
            retry_after_s,
        ),
        Refusal::Overloaded { retry_after_s } => ApiError::rate_limited(
            "requests",
            "the router is at its limit of running and queued requests",
            retry_after_s,
        ),
    }
}

/// Inference routes, which take a running slot.
fn is_inference(method: &Method, path: &str) -> bool {
    method == Method::POST
        && matches!(
            path,
            "/v1/chat/completions" | "/v1/completions" | "/v1/messages" | "/v1/forks"
        )
}

/// The middleware (see the module docs).
pub async fn gate(State(adm): State<Arc<Admission>>, req: Request, next: Next) -> Response {
    // Anthropic's clients read Anthropic's error shape; every other path OpenAI's.
    let anthropic = req.uri().path() == "/v1/messages";
    match admit(adm, req, next).await {
        Ok(r) => r,
        Err(e) if anthropic => super::anthropic_error::error_response(&e),
        Err(e) => e.into_response(),
    }
}

async fn admit(adm: Arc<Admission>, mut req: Request, next: Next) -> Result<Response, ApiError> {
    let path = req.uri().path().to_string();
    let admin_path = path == "/fleet" || path == "/dashboard/state";
    let api_path = path == "/v1" || path.starts_with("/v1/");
    if !admin_path && !api_path {
        return Ok(next.run(req).await);
    }
    let key = api_key(req.headers());
    let Some(tenant) = adm.authenticate(key) else {
        let message = match key {
            None => "missing API key: send `Authorization: Bearer <key>`",
            Some(_) => "incorrect API key provided",
        };
        return Err(ApiError::unauthorized(message));
    };
    if admin_path && !tenant.tenant.admin {
        return Err(ApiError::forbidden("this endpoint needs an admin key"));
    }
    let limit = adm.limits.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let inference = is_inference(req.method(), &path);
    if inference {
        req = read_body(req, limit, adm.limits.body_timeout).await?;
    }
    let permit = if inference {
        Some(adm.admit(&tenant).await.map_err(refusal_error)?)
    } else {
        None
    };
    req.extensions_mut().insert(Admitted {
        tenant,
        max_prompt_tokens: adm.limits.max_prompt_tokens,
        max_completion_tokens: adm.limits.max_completion_tokens,
    });
    let response = next.run(req).await;
    // A body over the limit without a Content-Length is cut by the body-limit layer,
    // whose plain-text 413 becomes an OpenAI error here.
    if response.status() == StatusCode::PAYLOAD_TOO_LARGE && !is_json(response.headers()) {
        return Err(ApiError::too_large(limit));
    }
    Ok(match permit {
        Some(p) if is_event_stream(response.headers()) => hold_until_body_ends(response, p),
        // A JSON answer is complete: the request has finished running.
        _ => response,
    })
}

/// Reads `req`'s whole body (at most `limit` bytes, within `deadline`) and puts it
/// back as a buffered body.
async fn read_body(req: Request, limit: usize, deadline: Duration) -> Result<Request, ApiError> {
    let (parts, body) = req.into_parts();
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk
                .map_err(|e| ApiError::invalid(format!("could not read the request body: {e}")))?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::too_large(limit));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    };
    match tokio::time::timeout(deadline, read).await {
        Err(_) => Err(ApiError::body_timeout(deadline)),
        Ok(Err(e)) => Err(e),
        Ok(Ok(buf)) => Ok(Request::from_parts(parts, Body::from(buf))),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    content_type(headers).starts_with("application/json")
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    content_type(headers).starts_with("text/event-stream")
}

fn content_type(headers: &HeaderMap) -> &str {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// Keeps `permit` until the streamed body ends or the client goes away (hyper drops
/// the body then).
fn hold_until_body_ends(response: Response, permit: RunPermit) -> Response {
    let (parts, body) = response.into_parts();
    let stream = body.into_data_stream().map(move |frame| {
        let _held = &permit;
        frame
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn reads_bearer_and_x_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(api_key(&h), None);
        h.insert("x-api-key", HeaderValue::from_static("k2"));
        assert_eq!(api_key(&h), Some("k2"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k1"));
        assert_eq!(api_key(&h), Some("k1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic xyz"));
        assert_eq!(api_key(&h), Some("k2"));
    }
}
