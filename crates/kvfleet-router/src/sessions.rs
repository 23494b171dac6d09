//! Per-session memory of the router: when a session started, how many turns it has
//! had, how well its last turn hit the cache, and a fingerprint of that turn for the
//! cache-break diagnostics ([`crate::prefix_breaks`]).
//!
//! A session is named by the client (`x-kvfleet-session`, or the OpenAI `user` field)
//! within its tenant: the store is keyed by (tenant, session id), so two tenants that
//! pick the same id never see each other's turns, timings or cache figures.
//! The store is bounded: past `capacity` sessions, the least recently seen is
//! forgotten, and a fingerprint holds at most `max_tokens` ids, so memory stays
//! within `capacity × max_tokens × 4` bytes.

use crate::prefix_breaks::{diagnose, PrefixBreak, TurnFingerprint};
use kvfleet_core::sync::lock;
use std::collections::HashMap;
use std::sync::Mutex;

/// What the router remembers of one session.
#[derive(Clone, Debug, Default)]
pub struct SessionState {
    /// When the session's first request arrived (router clock, ms).
    pub first_seen_ms: u64,
    /// Requests seen so far.
    pub turns: u64,
    /// The last turn's (cached, prompt) tokens, once known.
    pub last_cached: Option<(usize, usize)>,
    /// The last turn's fingerprint.
    pub last_turn: Option<TurnFingerprint>,
    /// The store's clock when the session was last seen (for eviction).
    pub last_used: u64,
}

/// What a new turn learns from its session's history.
#[derive(Clone, Debug, Default)]
pub struct TurnContext {
    /// The session as it was before this turn (`turns` is the count before it).
    pub before: SessionState,
    /// A break against the previous turn, if the new one diverged before its end.
    pub prefix_break: Option<PrefixBreak>,
}

/// A session's name in the store: (tenant, client-chosen session id).
type SessionKey = (String, String);

fn key(tenant: &str, id: &str) -> SessionKey {
    (tenant.to_string(), id.to_string())
}

/// Bounded session memory.
pub struct SessionStore {
    sessions: HashMap<SessionKey, SessionState>,
    capacity: usize,
    max_tokens: usize,
    tick: u64,
}

impl SessionStore {
    /// A store for at most `capacity` sessions, each fingerprint at most `max_tokens`.
    pub fn new(capacity: usize, max_tokens: usize) -> Self {
        SessionStore {
            sessions: HashMap::new(),
            capacity: capacity.max(1),
            max_tokens,
            tick: 0,
        }
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Whether no session is remembered.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Tenant `tenant`'s session `id`, if remembered.
    pub fn get(&self, tenant: &str, id: &str) -> Option<&SessionState> {
        self.sessions.get(&key(tenant, id))
    }

    /// Records a new turn of tenant `tenant`'s session `id`: diagnoses it against the
    /// previous turn, then makes it the previous turn. Returns what the turn needs to know.
    pub fn begin_turn(
        &mut self,
        tenant: &str,
        id: &str,
        now_ms: u64,
        mut turn: TurnFingerprint,
    ) -> TurnContext {
        self.tick += 1;
        let k = key(tenant, id);
        if !self.sessions.contains_key(&k) && self.sessions.len() >= self.capacity {
            self.evict_oldest();
        }
        let tick = self.tick;
        let state = self.sessions.entry(k).or_insert_with(|| SessionState {
            first_seen_ms: now_ms,
            ..SessionState::default()
        });
        let before = SessionState {
            last_turn: None,
            ..state.clone()
        };
        let prefix_break = state
            .last_turn
            .as_ref()
            .and_then(|prev| diagnose(prev, &turn));
        turn.tokens.truncate(self.max_tokens);
        state.last_turn = Some(turn);
        state.turns += 1;
        state.last_used = tick;
        TurnContext {
            before,
            prefix_break,
        }
    }

    /// Records how many of the turn's prompt tokens were cached.
    pub fn record_cached(&mut self, tenant: &str, id: &str, cached: usize, prompt: usize) {
        if let Some(s) = self.sessions.get_mut(&key(tenant, id)) {
            s.last_cached = Some((cached, prompt));
        }
    }

    fn evict_oldest(&mut self) {
        if let Some(oldest) = self
            .sessions
            .iter()
            .min_by_key(|(_, s)| s.last_used)
            .map(|(k, _)| k.clone())
        {
            self.sessions.remove(&oldest);
        }
    }
}

/// The session memory as request handlers share it: a [`SessionStore`] behind one
/// lock, taken for each call (no guard is handed out).
pub struct Sessions(Mutex<SessionStore>);

impl Sessions {
    /// Memory for at most `capacity` sessions, each fingerprint at most `max_tokens`.
    pub fn new(capacity: usize, max_tokens: usize) -> Self {
        Sessions(Mutex::new(SessionStore::new(capacity, max_tokens)))
    }

    /// A copy of tenant `tenant`'s session `id`, if remembered.
    pub fn get(&self, tenant: &str, id: &str) -> Option<SessionState> {
        lock(&self.0).get(tenant, id).cloned()
    }

    /// [`SessionStore::begin_turn`].
    pub fn begin_turn(
        &self,
        tenant: &str,
        id: &str,
        now_ms: u64,
        turn: TurnFingerprint,
    ) -> TurnContext {
        lock(&self.0).begin_turn(tenant, id, now_ms, turn)
    }

    /// [`SessionStore::record_cached`].
    pub fn record_cached(&self, tenant: &str, id: &str, cached: usize, prompt: usize) {
        lock(&self.0).record_cached(tenant, id, cached, prompt);
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    /// Whether no session is remembered.
    pub fn is_empty(&self) -> bool {
        lock(&self.0).is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::chat::ChatMessage;

    fn turn(system: &str, tokens: &[u32]) -> TurnFingerprint {
        TurnFingerprint::new(
            "m".into(),
            &[ChatMessage::system(system), ChatMessage::user("u")],
            &[],
            tokens.to_vec(),
        )
    }

    #[test]
    fn turns_count_and_breaks_are_found_against_the_previous_turn() {
        let mut s = SessionStore::new(8, 1 << 20);
        let t0 = s.begin_turn("t", "a", 1000, turn("s", &[1, 2, 3]));
        assert_eq!((t0.before.turns, t0.prefix_break.is_none()), (0, true));
        s.record_cached("t", "a", 0, 3);
        let t1 = s.begin_turn("t", "a", 5000, turn("s", &[1, 2, 3, 4]));
        assert_eq!(t1.before.turns, 1);
        assert_eq!(t1.before.first_seen_ms, 1000);
        assert_eq!(t1.before.last_cached, Some((0, 3)));
        assert!(t1.prefix_break.is_none());
        let t2 = s.begin_turn("t", "a", 6000, turn("changed", &[1, 9, 3, 4, 5]));
        let br = t2.prefix_break.unwrap();
        assert_eq!((br.token, br.message), (1, Some(0)));
    }

    #[test]
    fn tenants_with_the_same_session_id_are_separate_sessions() {
        let mut s = SessionStore::new(8, 1 << 20);
        s.begin_turn("alpha", "shared", 1000, turn("s", &[1, 2, 3]));
        s.record_cached("alpha", "shared", 2, 3);
        s.begin_turn("alpha", "shared", 2000, turn("s", &[1, 2, 3, 4]));
        let beta = s.begin_turn("beta", "shared", 9000, turn("other", &[7, 8]));
        assert_eq!(beta.before.turns, 0);
        assert_eq!(beta.before.first_seen_ms, 9000);
        assert_eq!(beta.before.last_cached, None);
        assert!(beta.prefix_break.is_none());
        assert_eq!(s.get("alpha", "shared").map(|a| a.turns), Some(2));
    }

    #[test]
    fn capacity_evicts_the_least_recently_seen() {
        let mut s = SessionStore::new(2, 16);
        s.begin_turn("t", "a", 0, turn("s", &[1]));
        s.begin_turn("t", "b", 0, turn("s", &[1]));
        s.begin_turn("t", "a", 0, turn("s", &[1]));
        s.begin_turn("t", "c", 0, turn("s", &[1]));
        assert_eq!(s.len(), 2);
        assert!(
            s.get("t", "a").is_some() && s.get("t", "b").is_none() && s.get("t", "c").is_some()
        );
    }

    #[test]
    fn fingerprints_are_bounded() {
        let mut s = SessionStore::new(2, 4);
        s.begin_turn("t", "a", 0, turn("s", &[1, 2, 3, 4, 5, 6]));
        assert_eq!(
            s.get("t", "a")
                .unwrap()
                .last_turn
                .as_ref()
                .unwrap()
                .tokens
                .len(),
            4
        );
    }
}
