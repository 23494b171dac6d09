//! A per-worker circuit breaker: after `failure_threshold` consecutive failures
//! (errors or missed deadlines) a worker is taken out of routing (open); after a
//! cool-down one probe request may go to it (half-open); the probe's success closes
//! the breaker, its failure opens it again.
//!
//! Pure state: the caller passes the clock, so the transitions are tested without
//! sleeping.

use std::time::{Duration, Instant};

/// A breaker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitState {
    /// Routable; counting consecutive failures.
    Closed,
    /// Not routable until the cool-down has passed.
    Open,
    /// One probe request may be routed to the worker.
    HalfOpen,
}

impl CircuitState {
    /// The value of the `kvfleet_worker_circuit_state` gauge (0 closed, 1 open,
    /// 2 half-open).
    pub fn gauge(self) -> f64 {
        match self {
            CircuitState::Closed => 0.0,
            CircuitState::Open => 1.0,
            CircuitState::HalfOpen => 2.0,
        }
    }

    /// Lower-case name (metric labels, JSON).
    pub fn as_str(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }
}

/// Breaker settings.
#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (at least 1).
    pub failure_threshold: u32,
    /// How long an open breaker waits before letting a probe through; also how long a
    /// probe may stay unanswered before another one is allowed.
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 3,
            cooldown: Duration::from_secs(5),
        }
    }
}

/// A state change: `(from, to)`.
pub type Transition = (CircuitState, CircuitState);

/// One worker's breaker.
#[derive(Clone, Debug)]
pub struct CircuitBreaker {
    config: BreakerConfig,
    state: CircuitState,
    consecutive_failures: u32,
    opened_at: Option<Instant>,
    probe_started: Option<Instant>,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        CircuitBreaker {
            config,
            state: CircuitState::Closed,
            consecutive_failures: 0,
            opened_at: None,
            probe_started: None,
        }
    }

    /// The current state.
    pub fn state(&self) -> CircuitState {
        self.state
    }

    /// Consecutive failures counted so far.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// Whether a request may be routed to the worker now: closed, or half-open with no
    /// probe in flight (or a probe that went unanswered for a whole cool-down).
    pub fn routable(&self, now: Instant) -> bool {
        match self.state {
            CircuitState::Closed => true,
            CircuitState::Open => false,
            CircuitState::HalfOpen => self
                .probe_started
                .is_none_or(|t| now.duration_since(t) >= self.config.cooldown),
        }
    }

    /// Moves an open breaker whose cool-down has passed to half-open.
    pub fn poll(&mut self, now: Instant) -> Option<Transition> {
        match (self.state, self.opened_at) {
            (CircuitState::Open, Some(t)) if now.duration_since(t) >= self.config.cooldown => {
                self.probe_started = None;
                self.set(CircuitState::HalfOpen)
            }
            _ => None,
        }
    }

    /// A request was sent to the worker; in half-open it is the probe.
    pub fn request_started(&mut self, now: Instant) {
        if self.state == CircuitState::HalfOpen {
            self.probe_started = Some(now);
        }
    }

    /// The worker answered a request.
    pub fn on_success(&mut self) -> Option<Transition> {
        self.consecutive_failures = 0;
        self.opened_at = None;
        self.probe_started = None;
        self.set(CircuitState::Closed)
    }

    /// The worker failed a request or missed a deadline.
    pub fn on_failure(&mut self, now: Instant) -> Option<Transition> {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let trip = match self.state {
            CircuitState::Closed => {
                self.consecutive_failures >= self.config.failure_threshold.max(1)
            }
            // A failed probe reopens at once.
            CircuitState::HalfOpen => true,
            CircuitState::Open => false,
        };
        if trip {
            self.opened_at = Some(now);
            self.probe_started = None;
            self.set(CircuitState::Open)
        } else {
            None
        }
    }

    fn set(&mut self, to: CircuitState) -> Option<Transition> {
        let from = self.state;
        self.state = to;
        (from != to).then_some((from, to))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(threshold: u32) -> CircuitBreaker {
        CircuitBreaker::new(BreakerConfig {
            failure_threshold: threshold,
            cooldown: Duration::from_secs(5),
        })
    }

    #[test]
    fn opens_after_the_threshold_of_consecutive_failures() {
        let t0 = Instant::now();
        let mut b = breaker(3);
        assert_eq!(b.on_failure(t0), None);
        assert_eq!(b.on_failure(t0), None);
        assert!(b.routable(t0));
        assert_eq!(
            b.on_failure(t0),
            Some((CircuitState::Closed, CircuitState::Open))
        );
        assert!(!b.routable(t0));
        assert_eq!(b.consecutive_failures(), 3);
    }

    #[test]
    fn a_success_resets_the_count() {
        let t0 = Instant::now();
        let mut b = breaker(2);
        b.on_failure(t0);
        assert_eq!(b.on_success(), None);
        assert_eq!(b.on_failure(t0), None);
        assert_eq!(b.state(), CircuitState::Closed);
    }

    #[test]
    fn half_open_after_cooldown_admits_one_probe() {
        let t0 = Instant::now();
        let mut b = breaker(1);
        b.on_failure(t0);
        assert_eq!(b.poll(t0 + Duration::from_secs(4)), None);
        assert!(!b.routable(t0 + Duration::from_secs(4)));
        let t5 = t0 + Duration::from_secs(5);
        assert_eq!(
            b.poll(t5),
            Some((CircuitState::Open, CircuitState::HalfOpen))
        );
        assert!(b.routable(t5));
        b.request_started(t5);
        assert!(
            !b.routable(t5 + Duration::from_secs(1)),
            "one probe at a time"
        );
        assert!(
            b.routable(t5 + Duration::from_secs(5)),
            "an unanswered probe is replaced after a cool-down"
        );
        assert_eq!(
            b.on_success(),
            Some((CircuitState::HalfOpen, CircuitState::Closed))
        );
        assert!(b.routable(t5));
    }

    #[test]
    fn a_failed_probe_reopens() {
        let t0 = Instant::now();
        let mut b = breaker(3);
        for _ in 0..3 {
            b.on_failure(t0);
        }
        let t5 = t0 + Duration::from_secs(5);
        b.poll(t5);
        b.request_started(t5);
        assert_eq!(
            b.on_failure(t5),
            Some((CircuitState::HalfOpen, CircuitState::Open))
        );
        assert_eq!(b.poll(t5 + Duration::from_secs(4)), None);
        assert_eq!(
            b.poll(t5 + Duration::from_secs(5)),
            Some((CircuitState::Open, CircuitState::HalfOpen))
        );
    }
}
