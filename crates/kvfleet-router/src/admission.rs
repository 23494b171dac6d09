//! Admission control of the HTTP front: who a request is (API key → tenant) and
//! whether it may run now (body size, per-tenant concurrency and token rate, a global
//! bound on running and queued requests).
//!
//! Every wait is bounded: a request either gets a running slot within
//! [`Limits::queue_timeout`], or is answered 429 with `Retry-After`. Permits are RAII
//! guards, released on every path (success, error, client disconnect mid-stream).

use crate::tenants::{KeyRing, Tenant, TenantLimits};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Router-wide limits.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest request body, bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Most prompt tokens of one request (400 `context_length_exceeded` beyond); the
    /// model's context length applies anyway.
    pub max_prompt_tokens: Option<usize>,
    /// Most tokens one request may generate: the default `max_tokens`, and the
    /// largest accepted (400 beyond).
    pub max_completion_tokens: Option<usize>,
    /// Requests running at once across all tenants.
    pub max_inflight: usize,
    /// Requests waiting for a running slot; beyond, 429 at once.
    pub max_queued: usize,
    /// Longest wait for a running slot before a 429.
    pub queue_timeout: Duration,
    /// Longest time a client may take to send a request's whole body (408 beyond).
    /// The body is read before admission, so a slow upload holds no running slot.
    pub body_timeout: Duration,
    /// Limits of tenants that do not set their own (and of `default`).
    pub tenant_defaults: TenantLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 << 20,
            max_prompt_tokens: None,
            max_completion_tokens: None,
            max_inflight: 1024,
            max_queued: 4096,
            queue_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            tenant_defaults: TenantLimits::default(),
        }
    }
}

/// Why a request was refused admission.
#[derive(Clone, Debug, PartialEq)]
pub enum Refusal {
    /// The tenant runs its maximum of concurrent requests.
    TenantConcurrency {
        /// The limit.
        limit: usize,
    },
    /// The tenant's token bucket is short; retry after the given seconds.
    TenantTokens {
        /// Tokens the request needs.
        needed: u64,
        /// The per-minute budget.
        per_minute: u64,
        /// Seconds until the bucket holds `needed`.
        retry_after_s: u64,
    },
    /// The router's queue is full, or the wait for a slot timed out.
    Overloaded {
        /// Seconds to wait before retrying.
        retry_after_s: u64,
    },
}

/// A per-tenant token bucket refilled continuously at `per_minute / 60` per second.
#[derive(Debug)]
pub struct TokenBucket {
    per_minute: u64,
    available: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(per_minute: u64, now: Instant) -> Self {
        TokenBucket {
            per_minute,
            available: per_minute as f64,
            last: now,
        }
    }

    /// Takes `cost` tokens at `now`, or says how many whole seconds until it could.
    /// A cost above the whole budget can never pass: it waits a full minute.
    pub fn take(&mut self, cost: u64, now: Instant) -> Result<(), u64> {
        let rate = self.per_minute as f64 / 60.0;
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.available = (self.available + elapsed * rate).min(self.per_minute as f64);
        self.last = now;
        if cost > self.per_minute {
            return Err(60);
        }
        if self.available >= cost as f64 {
            self.available -= cost as f64;
            return Ok(());
        }
        let missing = cost as f64 - self.available;
        Err(((missing / rate).ceil() as u64).max(1))
    }
}

/// A tenant's live admission state.
#[derive(Debug)]
pub struct TenantState {
    /// Who.
    pub tenant: Tenant,
    concurrency: Option<Arc<Semaphore>>,
    bucket: Option<Mutex<TokenBucket>>,
}

impl TenantState {
    fn new(tenant: Tenant, defaults: TenantLimits) -> Self {
        let max_concurrent = tenant.limits.max_concurrent.or(defaults.max_concurrent);
        let per_minute = tenant
            .limits
            .tokens_per_minute
            .or(defaults.tokens_per_minute);
        TenantState {
            tenant,
            concurrency: max_concurrent.map(|n| Arc::new(Semaphore::new(n))),
            bucket: per_minute.map(|n| Mutex::new(TokenBucket::new(n, Instant::now()))),
        }
    }

    /// Charges `cost` tokens (prompt plus `max_tokens`) to the tenant's bucket.
    pub fn charge_tokens(&self, cost: u64) -> Result<(), Refusal> {
        let Some(bucket) = &self.bucket else {
            return Ok(());
        };
        let mut b = bucket.lock().unwrap_or_else(|p| p.into_inner());
        let per_minute = b.per_minute;
        b.take(cost, Instant::now())
            .map_err(|retry_after_s| Refusal::TenantTokens {
                needed: cost,
                per_minute,
                retry_after_s,
            })
    }
}

/// Held while a request runs; dropping it frees the tenant's and the router's slot.
#[derive(Debug)]
pub struct RunPermit {
    _tenant: Option<OwnedSemaphorePermit>,
    _global: OwnedSemaphorePermit,
}

/// The admission gate of one router.
#[derive(Debug)]
pub struct Admission {
    /// The limits.
    pub limits: Limits,
    keys: Option<KeyRing>,
    tenants: HashMap<String, Arc<TenantState>>,
    default_tenant: Arc<TenantState>,
    global: Arc<Semaphore>,
    queued: AtomicUsize,
}

/// Decrements the queue count when a waiter leaves (admitted, timed out or cancelled).
struct QueueSlot<'a>(&'a AtomicUsize);

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    /// A gate with `limits`; with `keys`, every API request must carry a key.
    pub fn new(limits: Limits, keys: Option<KeyRing>) -> Self {
        let defaults = limits.tenant_defaults;
        let tenants = keys
            .iter()
            .flat_map(|k| k.tenants())
            .map(|t| {
                (
                    t.name.clone(),
                    Arc::new(TenantState::new(t.clone(), defaults)),
                )
            })
            .collect();
        Admission {
            global: Arc::new(Semaphore::new(limits.max_inflight.max(1))),
            default_tenant: Arc::new(TenantState::new(
                Tenant::default_tenant(TenantLimits::default()),
                defaults,
            )),
            tenants,
            keys,
            queued: AtomicUsize::new(0),
            limits,
        }
    }

    /// The tenant of requests when no keys file is configured.
    pub fn default_tenant(&self) -> Arc<TenantState> {
        self.default_tenant.clone()
    }

    /// Whether requests must authenticate.
    pub fn auth_enabled(&self) -> bool {
        self.keys.is_some()
    }

    /// The tenant of a request carrying `key` (`Ok(None)`: the key is unknown). Without
    /// a keys file every request is the default tenant.
    pub fn authenticate(&self, key: Option<&str>) -> Option<Arc<TenantState>> {
        match &self.keys {
            None => Some(self.default_tenant.clone()),
            Some(ring) => {
                let t = ring.lookup(key?)?;
                self.tenants.get(&t.name).cloned()
            }
        }
    }

    /// Admits one request of `tenant` to run: a tenant slot at once (or 429), then a
    /// router slot within the queue bound and timeout (or 429).
    pub async fn admit(&self, tenant: &TenantState) -> Result<RunPermit, Refusal> {
        let tenant_permit = match &tenant.concurrency {
            None => None,
            Some(s) => Some(s.clone().try_acquire_owned().map_err(|_| {
                Refusal::TenantConcurrency {
                    limit: tenant
                        .tenant
                        .limits
                        .max_concurrent
                        .or(self.limits.tenant_defaults.max_concurrent)
                        .unwrap_or(0),
                }
            })?),
        };
        let retry_after_s = self.limits.queue_timeout.as_secs().max(1);
        let global = match self.global.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if self.queued.fetch_add(1, Ordering::AcqRel) >= self.limits.max_queued {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    return Err(Refusal::Overloaded { retry_after_s });
                }
                let _slot = QueueSlot(&self.queued);
                match tokio::time::timeout(
                    self.limits.queue_timeout,
                    self.global.clone().acquire_owned(),
                )
                .await
                {
                    Ok(Ok(p)) => p,
                    _ => return Err(Refusal::Overloaded { retry_after_s }),
                }
            }
        };
        Ok(RunPermit {
            _tenant: tenant_permit,
            _global: global,
        })
    }

    /// Requests waiting for a running slot now.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::hash_key;

    #[test]
    fn bucket_refills_and_names_the_wait() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(600, t0); // 10 tokens per second
        assert_eq!(b.take(500, t0), Ok(()));
        // 100 left; 300 more need 20 s of refill.
        assert_eq!(b.take(300, t0), Err(20));
        assert_eq!(b.take(300, t0 + Duration::from_secs(20)), Ok(()));
        assert_eq!(b.take(601, t0 + Duration::from_secs(600)), Err(60));
        // Refill is capped at the budget.
        assert_eq!(b.take(600, t0 + Duration::from_secs(600)), Ok(()));
        assert_eq!(b.take(1, t0 + Duration::from_secs(600)), Err(1));
    }

    fn gate(limits: Limits) -> Admission {
        let keys = KeyRing::parse(&format!(
            "{} tenant=a max_concurrent=1\n{} tenant=b",
            hash_key("ka"),
            hash_key("kb")
        ))
        .unwrap();
        Admission::new(limits, Some(keys))
    }

    #[test]
    fn authenticates_by_key() {
        let g = gate(Limits::default());
        assert!(g.auth_enabled());
        assert_eq!(g.authenticate(Some("ka")).unwrap().tenant.name, "a");
        assert!(g.authenticate(Some("kz")).is_none());
        assert!(g.authenticate(None).is_none());
        let open = Admission::new(Limits::default(), None);
        assert_eq!(open.authenticate(None).unwrap().tenant.name, "default");
    }

    #[tokio::test]
    async fn tenant_concurrency_is_enforced_and_released() {
        let g = gate(Limits::default());
        let a = g.authenticate(Some("ka")).unwrap();
        let p = g.admit(&a).await.unwrap();
        assert_eq!(
            g.admit(&a).await.unwrap_err(),
            Refusal::TenantConcurrency { limit: 1 }
        );
        // Another tenant is not affected.
        let b = g.authenticate(Some("kb")).unwrap();
        let _pb = g.admit(&b).await.unwrap();
        drop(p);
        assert!(g.admit(&a).await.is_ok());
    }

    #[tokio::test]
    async fn full_queue_answers_at_once_and_waits_are_bounded() {
        let g = gate(Limits {
            max_inflight: 1,
            max_queued: 1,
            queue_timeout: Duration::from_millis(50),
            ..Limits::default()
        });
        let b = g.authenticate(Some("kb")).unwrap();
        let held = g.admit(&b).await.unwrap();
        // One waiter fits the queue; it times out (bounded wait).
        let waiter = g.admit(&b);
        let second = g.admit(&b);
        let (w, s) = tokio::join!(waiter, second);
        let refusals = [w.unwrap_err(), s.unwrap_err()];
        assert!(refusals
            .iter()
            .all(|r| matches!(r, Refusal::Overloaded { retry_after_s: 1 })));
        assert_eq!(g.queued(), 0);
        drop(held);
        assert!(g.admit(&b).await.is_ok());
    }
}
