//! Per-session memory of the router: when a session started, how many turns it has
//! had, how well its last turn hit the cache, and a fingerprint of that turn for the
//! cache-break diagnostics ([`crate::prefix_breaks`]).
//!
//! A session is named by the client (`x-kvfleet-session`, or the OpenAI `user` field).
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

/// Bounded session memory.
pub struct SessionStore {
    sessions: HashMap<String, SessionState>,
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

    /// A session's state, if remembered.
    pub fn get(&self, id: &str) -> Option<&SessionState> {
        self.sessions.get(id)
    }

    /// Records a new turn of session `id`: diagnoses it against the previous turn,
    /// then makes it the previous turn. Returns what the turn needs to know.
    pub fn begin_turn(&mut self, id: &str, now_ms: u64, mut turn: TurnFingerprint) -> TurnContext {
        self.tick += 1;
        if !self.sessions.contains_key(id) && self.sessions.len() >= self.capacity {
            self.evict_oldest();
        }
        let tick = self.tick;
        let state = self
            .sessions
            .entry(id.to_string())
            .or_insert_with(|| SessionState {
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
    pub fn record_cached(&mut self, id: &str, cached: usize, prompt: usize) {
        if let Some(s) = self.sessions.get_mut(id) {
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

    /// A copy of session `id`'s state, if remembered.
    pub fn get(&self, id: &str) -> Option<SessionState> {
        lock(&self.0).get(id).cloned()
    }

    /// [`SessionStore::begin_turn`].
    pub fn begin_turn(&self, id: &str, now_ms: u64, turn: TurnFingerprint) -> TurnContext {
        lock(&self.0).begin_turn(id, now_ms, turn)
    }

    /// [`SessionStore::record_cached`].
    pub fn record_cached(&self, id: &str, cached: usize, prompt: usize) {
        lock(&self.0).record_cached(id, cached, prompt);
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
        let t0 = s.begin_turn("a", 1000, turn("s", &[1, 2, 3]));
        assert_eq!((t0.before.turns, t0.prefix_break.is_none()), (0, true));
        s.record_cached("a", 0, 3);
        let t1 = s.begin_turn("a", 5000, turn("s", &[1, 2, 3, 4]));
        assert_eq!(t1.before.turns, 1);
        assert_eq!(t1.before.first_seen_ms, 1000);
        assert_eq!(t1.before.last_cached, Some((0, 3)));
        assert!(t1.prefix_break.is_none());
        let t2 = s.begin_turn("a", 6000, turn("changed", &[1, 9, 3, 4, 5]));
        let br = t2.prefix_break.unwrap();
        assert_eq!((br.token, br.message), (1, Some(0)));
    }

    #[test]
    fn capacity_evicts_the_least_recently_seen() {
        let mut s = SessionStore::new(2, 16);
        s.begin_turn("a", 0, turn("s", &[1]));
        s.begin_turn("b", 0, turn("s", &[1]));
        s.begin_turn("a", 0, turn("s", &[1]));
        s.begin_turn("c", 0, turn("s", &[1]));
        assert_eq!(s.len(), 2);
        assert!(s.get("a").is_some() && s.get("b").is_none() && s.get("c").is_some());
    }

    #[test]
    fn fingerprints_are_bounded() {
        let mut s = SessionStore::new(2, 4);
        s.begin_turn("a", 0, turn("s", &[1, 2, 3, 4, 5, 6]));
        assert_eq!(
            s.get("a").unwrap().last_turn.as_ref().unwrap().tokens.len(),
            4
        );
    }
}
