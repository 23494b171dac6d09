//! Hooks through which a control plane (several routers sharing placement and usage
//! records; see `kvfleet-control`) joins the request path. A fleet without hooks —
//! the embedded default — routes on its own index alone.
//!
//! - Placement: a request's fork group (or, for a prompt no worker is known to hold
//!   up to its anchor block, that anchor) may already be placed on a worker by another
//!   router; the request is then pinned there. If not, the worker this router chose
//!   is claimed with one compare-and-set, and the request follows the winner. Siblings
//!   reaching this router while the claim is in flight wait for it
//!   ([`crate::placement_claims`]).
//! - Usage: every finished request is reported once, without text.

use crate::fleet_metrics as m;
use crate::placement_claims::ClaimsInFlight;
use futures::future::BoxFuture;
use kvfleet_core::sync::lock;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// What a placement is keyed by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PlacementRef {
    /// A client-named fork group.
    ForkGroup(String),
    /// A prompt's anchor block hash (`kvfleet_routing::policy::prompt_anchor`: the
    /// block that covers at least half of it), shared by fork siblings, not by
    /// sessions that share only a system prompt.
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
    /// The part of it promoted from a lower tier or a peer, by tier.
    pub promoted: kvfleet_core::kv_events::PromotedTokens,
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

/// A placement as this router knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownPlacement {
    /// The owner.
    pub worker: String,
    /// How long ago this router saw the key placed (`None`: unknown, e.g. found in a
    /// listing at start).
    pub age: Option<Duration>,
}

/// The request facts the hooks need, carried by a dispatched request.
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
    /// Where `key` is placed, from this router's local view (no I/O), if on a worker
    /// this router is connected to.
    fn placement(&self, key: &PlacementRef) -> Option<KnownPlacement>;
    /// The worker `key` is placed on ([`Self::placement`]).
    fn placed_worker(&self, key: &PlacementRef) -> Option<String> {
        self.placement(key).map(|p| p.worker)
    }
    /// Claims `key` for `worker` (create-if-absent); resolves to the owner afterwards,
    /// or `None` if the claim could not be made (the request then goes to `worker`).
    fn claim(&self, key: PlacementRef, worker: String) -> BoxFuture<'static, Option<String>>;
    /// A request finished (successfully or not).
    fn request_done(&self, usage: RequestUsage);
}

/// Whether a control-plane component (etcd, Kafka) is reachable, and since when.
#[derive(Clone, Copy, Debug)]
pub struct ComponentStatus {
    /// Reachable at the last attempt.
    pub up: bool,
    /// When it last changed.
    pub since: Instant,
}

/// A fleet's link to its control plane: the installed hooks and what is known of each
/// component's reachability.
#[derive(Default)]
pub struct ControlLink {
    hooks: RwLock<Option<Arc<dyn ControlHooks>>>,
    /// This router's claims in flight, one per key.
    claims: ClaimsInFlight<PlacementRef>,
    components: Mutex<BTreeMap<&'static str, ComponentStatus>>,
}

impl ControlLink {
    /// No control plane (the embedded default).
    pub fn new() -> Self {
        Self::default()
    }

    /// Installs a control plane's hooks (placement, usage records).
    pub fn set_hooks(&self, hooks: Arc<dyn ControlHooks>) {
        if let Ok(mut h) = self.hooks.write() {
            *h = Some(hooks);
        }
    }

    /// The installed hooks.
    pub fn hooks(&self) -> Option<Arc<dyn ControlHooks>> {
        self.hooks.read().ok().and_then(|h| h.clone())
    }

    /// This router's placement claims in flight.
    pub fn claims(&self) -> &ClaimsInFlight<PlacementRef> {
        &self.claims
    }

    /// Records whether `component` (`etcd`, `kafka`) is reachable; sets
    /// `kvfleet_control_plane_up{component}`.
    pub fn set_up(&self, component: &'static str, up: bool) {
        let mut cp = lock(&self.components);
        let changed = cp.get(component).is_none_or(|s| s.up != up);
        if changed {
            cp.insert(
                component,
                ComponentStatus {
                    up,
                    since: Instant::now(),
                },
            );
            if up {
                tracing::info!(component, "control plane reachable");
            } else {
                tracing::warn!(
                    component,
                    "control plane unreachable: serving on what is known"
                );
            }
        }
        m::control_plane_up(component, up);
    }

    /// Every component reported so far.
    pub fn status(&self) -> BTreeMap<&'static str, ComponentStatus> {
        lock(&self.components).clone()
    }
}
