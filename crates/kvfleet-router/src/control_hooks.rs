//! Hooks through which a control plane (several routers sharing placement and usage
//! records; see `kvfleet-control`) joins the request path. A fleet without hooks —
//! the embedded default — routes on its own index alone.
//!
//! - Placement: a request's fork group (or, for a prompt no worker is known to hold,
//!   its prefix root) may already be placed on a worker by another router; the
//!   request is then pinned there. If not, the worker this router chose is claimed
//!   with one compare-and-set, and the request follows the winner.
//! - Usage: every finished request is reported once, without text.

use crate::dispatch::Dispatched;
use crate::fleet::Fleet;
use crate::openai::types::Usage;
use futures::future::BoxFuture;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a placement is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PlacementRef {
    /// A client-named fork group.
    ForkGroup(String),
    /// The first block hash of a prompt.
    PrefixRoot(u64),
}

/// One finished request, as reported to [`ControlHooks::request_done`].
#[derive(Clone, Debug, PartialEq)]
pub struct RequestUsage {
    /// Tenant (the request's cache salt).
    pub tenant: String,
    /// Model id.
    pub model: String,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from cache.
    pub cached_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Serving worker.
    pub worker: String,
    /// Time to first token (from arrival), if a token came.
    pub ttft: Option<Duration>,
    /// Fork group.
    pub fork_group: Option<String>,
    /// Session (`x-kvfleet-session` or the `user` field).
    pub session_id: Option<String>,
    /// The prompt's block hashes.
    pub block_hashes: Vec<u64>,
    /// Tokens per block.
    pub block_size: u32,
    /// Arrival, Unix milliseconds.
    pub timestamp_ms: u64,
}

/// The request facts the hooks need, carried by a [`Dispatched`] request.
#[derive(Clone, Debug, Default)]
pub struct RequestFacts {
    /// Cache salt (tenant).
    pub cache_salt: String,
    /// Fork group.
    pub fork_group: Option<String>,
    /// Session.
    pub session: Option<String>,
    /// Block hashes (filled only when hooks are installed).
    pub block_hashes: Vec<u64>,
}

/// A control plane's part in routing.
pub trait ControlHooks: Send + Sync {
    /// The worker `key` is placed on, from this router's local view (no I/O).
    fn placed_worker(&self, key: &PlacementRef) -> Option<String>;
    /// Claims `key` for `worker` (create-if-absent); resolves to the owner afterwards,
    /// or `None` if the claim could not be made (the request then goes to `worker`).
    fn claim(&self, key: PlacementRef, worker: String) -> BoxFuture<'static, Option<String>>;
    /// A request finished (successfully or not).
    fn request_done(&self, usage: RequestUsage);
}

impl Fleet {
    /// Reports a finished request to the control plane, if one is installed.
    pub fn report_usage<T>(&self, d: &Dispatched<T>, usage: &Usage, ttft: Option<Duration>) {
        let Some(hooks) = self.control_hooks() else {
            return;
        };
        let arrived = SystemTime::now()
            .checked_sub(d.started.elapsed())
            .unwrap_or_else(SystemTime::now);
        hooks.request_done(RequestUsage {
            tenant: d.facts.cache_salt.clone(),
            model: self.model().map(|m| m.0).unwrap_or_default(),
            prompt_tokens: usage.prompt_tokens as u64,
            cached_tokens: usage.prompt_tokens_details.cached_tokens as u64,
            output_tokens: usage.completion_tokens as u64,
            worker: d.worker.clone(),
            ttft,
            fork_group: d.facts.fork_group.clone(),
            session_id: d.facts.session.clone(),
            block_hashes: d.facts.block_hashes.clone(),
            block_size: self.config.router.block_size as u32,
            timestamp_ms: arrived
                .duration_since(UNIX_EPOCH)
                .map(|t| t.as_millis() as u64)
                .unwrap_or(0),
        });
    }
}
