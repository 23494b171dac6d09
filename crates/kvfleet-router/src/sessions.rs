//! Per-session memory of the router: when a session started, how many turns it has
//! had, how well its last turn hit the cache, and a fingerprint of that turn for the
//! cache-break diagnostics ([`crate::prefix_breaks`]).
//!
//! A session is named by the client (`x-kvfleet-session`, or the OpenAI `user` field)
//! within its tenant: the store is keyed by (tenant, session id), so two tenants that
//! pick the same id never see each other's turns, timings or cache figures.
//!
//! The store is bounded in bytes: each session is charged its key, its state and its
//! fingerprint (at most `max_tokens` ids), and past the bound the least recently seen
//! session is forgotten, in O(1) ([`kvfleet_core::byte_lru`]).

use crate::prefix_breaks::{diagnose, PrefixBreak, TurnFingerprint};
use kvfleet_core::byte_lru::ByteLru;
use kvfleet_core::sync::lock;
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

/// Bytes a session costs beyond its key and fingerprint: its state and the store's
/// node and slot.
const SESSION_OVERHEAD_BYTES: usize = std::mem::size_of::<SessionState>() + 128;

/// What session `key` in `state` is charged against the bound.
fn session_bytes(key: &SessionKey, state: &SessionState) -> usize {
    SESSION_OVERHEAD_BYTES
        + key.0.len()
        + key.1.len()
        + state
            .last_turn
            .as_ref()
            .map_or(0, TurnFingerprint::heap_bytes)
}

/// Bounded session memory.
pub struct SessionStore {
    sessions: ByteLru<SessionKey, SessionState>,
    max_tokens: usize,
}

impl SessionStore {
    /// A store holding at most `max_bytes` of sessions, each fingerprint at most
    /// `max_tokens` ids.
    pub fn new(max_bytes: usize, max_tokens: usize) -> Self {
        SessionStore {
            sessions: ByteLru::new(max_bytes),
            max_tokens,
        }
    }

    /// Bytes the sessions are charged (at most the bound).
    pub fn bytes(&self) -> usize {
        self.sessions.bytes()
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
        self.sessions.peek(&key(tenant, id))
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
        let k = key(tenant, id);
        // Out and back in: the new fingerprint changes the session's size.
        let mut state = self.sessions.remove(&k).unwrap_or_else(|| SessionState {
            first_seen_ms: now_ms,
            ..SessionState::default()
        });
        let before = SessionState {
            first_seen_ms: state.first_seen_ms,
            turns: state.turns,
            last_cached: state.last_cached,
            last_turn: None,
        };
        let prefix_break = state
            .last_turn
            .as_ref()
            .and_then(|prev| diagnose(prev, &turn));
        turn.tokens.truncate(self.max_tokens);
        state.last_turn = Some(turn);
        state.turns += 1;
        let bytes = session_bytes(&k, &state);
        self.sessions.insert(k, state, bytes);
        TurnContext {
            before,
            prefix_break,
        }
    }

    /// Records how many of the turn's prompt tokens were cached.
    pub fn record_cached(&mut self, tenant: &str, id: &str, cached: usize, prompt: usize) {
        // Two integers in place: the session's size does not change.
        if let Some(s) = self.sessions.get_mut(&key(tenant, id)) {
            s.last_cached = Some((cached, prompt));
        }
    }
}

/// The session memory as request handlers share it: a [`SessionStore`] behind one
/// lock, taken for each call (no guard is handed out).
pub struct Sessions(Mutex<SessionStore>);

impl Sessions {
    /// Memory of at most `max_bytes`, each fingerprint at most `max_tokens` ids.
    pub fn new(max_bytes: usize, max_tokens: usize) -> Self {
        Sessions(Mutex::new(SessionStore::new(max_bytes, max_tokens)))
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
        let mut s = SessionStore::new(1 << 20, 1 << 20);
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
        let mut s = SessionStore::new(1 << 20, 1 << 20);
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

    /// Bytes one session of `tokens` ids costs (id of one byte, tenant `t`).
    fn one_session(tokens: usize) -> usize {
        let fp = turn("s", &vec![1; tokens]);
        SESSION_OVERHEAD_BYTES + 2 + fp.heap_bytes()
    }

    #[test]
    fn the_byte_bound_holds_and_the_least_recently_seen_goes_first() {
        let one = one_session(1000);
        // Room for two sessions of 1000 ids, not three.
        let mut s = SessionStore::new(2 * one + one / 2, 1 << 20);
        s.begin_turn("t", "a", 0, turn("s", &[1; 1000]));
        s.begin_turn("t", "b", 0, turn("s", &[1; 1000]));
        assert_eq!(s.bytes(), 2 * one);
        // a is seen again, so b is now the least recently seen.
        s.begin_turn("t", "a", 0, turn("s", &[1; 1000]));
        s.begin_turn("t", "c", 0, turn("s", &[1; 1000]));
        assert_eq!(s.len(), 2);
        assert!(s.bytes() <= 2 * one + one / 2);
        assert!(s.get("t", "a").is_some() && s.get("t", "b").is_none());
        assert!(s.get("t", "c").is_some());
        // One long session pushes out as many as it needs.
        s.begin_turn("t", "d", 0, turn("s", &[1; 2000]));
        assert!(s.bytes() <= 2 * one + one / 2, "{}", s.bytes());
        assert_eq!(s.len(), 1);
        assert!(s.get("t", "d").is_some());
    }

    #[test]
    fn sessions_are_charged_their_fingerprints() {
        // 4,096 sessions of 256k ids were ~4 GiB under the old count bound; a 16 MiB
        // bound keeps what fits in 16 MiB, the most recent.
        let max = 16 << 20;
        let mut s = SessionStore::new(max, 256 * 1024);
        for i in 0..64 {
            s.begin_turn("t", &format!("s{i:02}"), 0, turn("s", &vec![7; 256 * 1024]));
            assert!(s.bytes() <= max);
        }
        let per = one_session(256 * 1024) + 2;
        assert_eq!(s.len(), max / per);
        assert!(s.get("t", "s63").is_some() && s.get("t", "s00").is_none());
    }

    #[test]
    fn fingerprints_are_bounded() {
        let mut s = SessionStore::new(1 << 20, 4);
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
