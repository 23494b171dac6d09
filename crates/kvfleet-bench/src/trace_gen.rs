//! `kvfleet bench gen`: agent sessions with fork fan-out.
//!
//! A session is a parent conversation that grows turn by turn: its first prompt is the
//! system prompt, the tool definitions and the history so far; each later turn appends
//! the previous answer and a new tail (a tool result or user message). After its last
//! turn the parent's answer calls `fork_k` tools at once, forking `fork_k` children
//! whose prompts are the parent's prompt + that answer + constant placeholder tool
//! results + a ~200-token directive of their own. Each child then runs its own
//! multi-turn loop. Children name their parent (`parent_id`) and wait for it.
//!
//! Prompts are built from segments (system, tools, history, turns…) and cut into
//! `block_size`-token blocks; a block's id names its content *and everything before
//! it*, so equal ids at equal positions mean a shared prefix, as in Mooncake traces.
//! With `shared_prefix` (the herd case) every session of a tenant starts with the same
//! system prompt and tool definitions.

use crate::trace::{Trace, TraceRecord};
use kvfleet_routing::policy::mix64;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// How sessions arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arrival {
    /// Exponential gaps (a Poisson process) at `session_rate`.
    Poisson,
    /// Constant gaps of `1 / session_rate`.
    Uniform,
    /// Bursts of [`BURST_SESSIONS`] sessions starting at the same instant, the bursts
    /// a Poisson process at `session_rate / BURST_SESSIONS` (a batch job, a retry
    /// storm, an agent framework starting its workers together).
    Bursty,
}

/// Sessions per burst of [`Arrival::Bursty`].
pub const BURST_SESSIONS: usize = 8;

impl std::str::FromStr for Arrival {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "poisson" => Ok(Arrival::Poisson),
            "uniform" => Ok(Arrival::Uniform),
            "bursty" => Ok(Arrival::Bursty),
            _ => Err(format!(
                "unknown arrival process {s:?}; use poisson, uniform or bursty"
            )),
        }
    }
}

/// Generator settings; sizes default to the economics in DESIGN.md.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenConfig {
    /// Agent sessions.
    pub sessions: usize,
    /// Tenants (sessions are dealt round-robin; tenants never share a prefix).
    pub tenants: usize,
    /// Every session of a tenant shares the system prompt and tool definitions.
    pub shared_prefix: bool,
    /// System prompt tokens.
    pub system_tokens: usize,
    /// Tool definition tokens.
    pub tools_tokens: usize,
    /// History tokens before the first turn.
    pub history_tokens: usize,
    /// Parent turns before the fork.
    pub parent_turns: usize,
    /// Tokens each turn appends (tool result or user message).
    pub turn_tokens: usize,
    /// Children per fork.
    pub fork_k: usize,
    /// Tokens of the constant placeholder tool results children share.
    pub placeholder_tokens: usize,
    /// Tokens of each child's own directive.
    pub directive_tokens: usize,
    /// Turns of each child's own loop (the first is its forked prompt).
    pub child_turns: usize,
    /// Tokens each answer generates.
    pub output_tokens: usize,
    /// Sessions started per second.
    pub session_rate: f64,
    /// Arrival process of sessions.
    pub arrival: Arrival,
    /// Think time between a turn and the next, in ms (the earliest start; a turn also
    /// waits for the one before).
    pub turn_gap_ms: u64,
    /// Tokens per hash id.
    pub block_size: usize,
    /// Seed.
    pub seed: u64,
}

impl Default for GenConfig {
    fn default() -> Self {
        Self {
            sessions: 50,
            tenants: 1,
            shared_prefix: false,
            system_tokens: 4_096,
            tools_tokens: 12_288,
            history_tokens: 30_720,
            parent_turns: 3,
            turn_tokens: 1_500,
            fork_k: 5,
            placeholder_tokens: 300,
            directive_tokens: 200,
            child_turns: 3,
            output_tokens: 150,
            session_rate: 0.5,
            arrival: Arrival::Poisson,
            turn_gap_ms: 3_000,
            block_size: 512,
            seed: 1,
        }
    }
}

impl GenConfig {
    /// Requests per session.
    pub fn requests_per_session(&self) -> usize {
        self.parent_turns + self.fork_k * self.child_turns
    }

    /// Multi-turn conversations without forks, the shape of the sweep's
    /// `conversation` family and of `kvfleet bench tiers`: 2k system + 1k tools + 1k
    /// history tokens, then 12 turns of +768 tokens with 256-token answers, `gap_ms`
    /// apart (other fields: the defaults).
    pub fn conversation(sessions: usize, gap_ms: u64) -> Self {
        Self {
            sessions,
            fork_k: 0,
            parent_turns: 12,
            system_tokens: 2048,
            tools_tokens: 1024,
            history_tokens: 1024,
            turn_tokens: 768,
            output_tokens: 256,
            turn_gap_ms: gap_ms,
            ..Self::default()
        }
    }
}

/// A run of tokens with one content id.
#[derive(Clone, Copy, Debug)]
struct Segment {
    uid: u64,
    len: usize,
}

struct Builder {
    block_size: usize,
    ids: HashMap<u64, u64>,
}

impl Builder {
    /// The hash ids of a prompt made of `segs`.
    fn hash_ids(&mut self, segs: &[Segment]) -> (usize, Vec<u64>) {
        let bs = self.block_size;
        let mut out = Vec::new();
        let mut chain = 0x6b76_6765_6e00_0001u64;
        let mut fill = 0usize;
        let mut total = 0usize;
        for s in segs {
            let mut off = 0;
            while off < s.len {
                let take = (bs - fill).min(s.len - off);
                chain = mix64(chain ^ mix64(s.uid ^ ((off as u64) << 40) ^ take as u64));
                fill += take;
                off += take;
                total += take;
                if fill == bs {
                    out.push(self.compact(chain));
                    chain = mix64(chain ^ 0xb10c);
                    fill = 0;
                }
            }
        }
        if fill > 0 {
            out.push(self.compact(chain));
        }
        (total, out)
    }

    fn compact(&mut self, content: u64) -> u64 {
        let n = self.ids.len() as u64;
        *self.ids.entry(content).or_insert(n)
    }
}

/// A SplitMix64 stream.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Generates a fork fan-out trace.
pub fn generate(cfg: &GenConfig) -> anyhow::Result<Trace> {
    anyhow::ensure!(cfg.block_size > 0, "block size must be at least 1");
    anyhow::ensure!(cfg.tenants > 0, "tenants must be at least 1");
    anyhow::ensure!(cfg.parent_turns > 0, "parent turns must be at least 1");
    anyhow::ensure!(
        cfg.session_rate > 0.0 && cfg.session_rate.is_finite(),
        "session rate must be positive"
    );
    let mut rng = Rng(cfg.seed);
    let mut b = Builder {
        block_size: cfg.block_size,
        ids: HashMap::new(),
    };
    let uid = |session: u64, kind: u64, idx: u64| mix64(mix64(session ^ (kind << 56)) ^ idx);
    let mut records = Vec::new();
    let mut start_ms = 0.0f64;
    let mut next_id = 0u64;
    let mut fork_group = 0u64;
    for s in 0..cfg.sessions as u64 {
        let tenant = s % cfg.tenants as u64;
        let gap = match cfg.arrival {
            Arrival::Poisson => -(1.0 - rng.unit()).ln() / cfg.session_rate,
            Arrival::Uniform => 1.0 / cfg.session_rate,
            Arrival::Bursty if (s as usize).is_multiple_of(BURST_SESSIONS) => {
                -(1.0 - rng.unit()).ln() * BURST_SESSIONS as f64 / cfg.session_rate
            }
            Arrival::Bursty => 0.0,
        };
        if s > 0 {
            start_ms += gap * 1000.0;
        }
        // The prefix owner: the tenant (herd) or the session itself.
        let owner = if cfg.shared_prefix {
            u64::MAX - tenant
        } else {
            s
        };
        let mut segs = vec![
            Segment {
                uid: uid(owner, 1, 0),
                len: cfg.system_tokens,
            },
            Segment {
                uid: uid(owner, 2, 0),
                len: cfg.tools_tokens,
            },
            Segment {
                uid: uid(s, 3, 0),
                len: cfg.history_tokens,
            },
        ];
        let tenant_name = (cfg.tenants > 1).then(|| format!("tenant-{tenant}"));
        let mut push = |segs: &[Segment], t: f64, parent: Option<u64>, fg: Option<u64>| {
            let (len, hash_ids) = b.hash_ids(segs);
            let id = next_id;
            next_id += 1;
            records.push(TraceRecord {
                timestamp: t.round() as u64,
                input_length: len,
                output_length: cfg.output_tokens,
                hash_ids,
                block_size: Some(cfg.block_size),
                id: Some(id),
                session_id: Some(s),
                parent_id: parent,
                fork_group: fg,
                tenant: tenant_name.clone(),
            });
            id
        };
        let mut parent = None;
        let mut t = start_ms;
        for turn in 0..cfg.parent_turns as u64 {
            segs.push(Segment {
                uid: uid(s, 4, turn),
                len: cfg.turn_tokens,
            });
            parent = Some(push(&segs[..], t, parent, None));
            // The answer becomes history.
            segs.push(Segment {
                uid: uid(s, 5, turn),
                len: cfg.output_tokens,
            });
            t += cfg.turn_gap_ms as f64;
        }
        if cfg.fork_k == 0 || cfg.child_turns == 0 {
            continue;
        }
        // The last answer made fork_k tool calls; every child sees the same
        // placeholder results, then its own directive.
        segs.push(Segment {
            uid: uid(s, 6, 0),
            len: cfg.placeholder_tokens,
        });
        let fg = fork_group;
        fork_group += 1;
        let fork_parent = parent;
        // Children of one fork are emitted turn by turn so timestamps stay sorted
        // within the session; the trace is sorted globally at the end.
        let mut child_segs: Vec<Vec<Segment>> = (0..cfg.fork_k as u64)
            .map(|c| {
                let mut v = segs.clone();
                v.push(Segment {
                    uid: uid(s, 7, c),
                    len: cfg.directive_tokens,
                });
                v
            })
            .collect();
        let mut child_parent: Vec<Option<u64>> = vec![fork_parent; cfg.fork_k];
        for turn in 0..cfg.child_turns as u64 {
            for (c, cs) in child_segs.iter_mut().enumerate() {
                if turn > 0 {
                    cs.push(Segment {
                        uid: uid(s, 8 + 2 * turn, c as u64),
                        len: cfg.output_tokens,
                    });
                    cs.push(Segment {
                        uid: uid(s, 9 + 2 * turn, c as u64),
                        len: cfg.turn_tokens,
                    });
                }
                let group = (turn == 0).then_some(fg);
                child_parent[c] = Some(push(&cs[..], t + c as f64, child_parent[c], group));
            }
            t += cfg.turn_gap_ms as f64;
        }
    }
    // Sort by arrival; ids stay as assigned (parents always precede children in time,
    // and the stable sort keeps that order on equal timestamps).
    records.sort_by_key(|r| r.timestamp);
    Ok(Trace { records })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> GenConfig {
        GenConfig {
            sessions: 4,
            system_tokens: 1000,
            tools_tokens: 1000,
            history_tokens: 1000,
            turn_tokens: 300,
            block_size: 64,
            ..GenConfig::default()
        }
    }

    #[test]
    fn deterministic_and_valid() {
        let a = generate(&small()).unwrap();
        let b = generate(&small()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.records.len(), 4 * small().requests_per_session());
        let mut text = Vec::new();
        a.write(&mut text).unwrap();
        assert_eq!(
            Trace::read(text.as_slice()).unwrap(),
            a,
            "passes the reader"
        );
        let c = generate(&GenConfig { seed: 2, ..small() }).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn bursty_sessions_start_together() {
        let cfg = GenConfig {
            sessions: 3 * BURST_SESSIONS,
            arrival: Arrival::Bursty,
            ..small()
        };
        let t = generate(&cfg).unwrap();
        // Each session's first request (no parent) is its start time.
        let mut starts: Vec<u64> = t
            .records
            .iter()
            .filter(|r| r.parent_id.is_none())
            .map(|r| r.timestamp)
            .collect();
        starts.dedup();
        assert_eq!(starts.len(), 3, "{starts:?}");
        assert_eq!("bursty".parse::<Arrival>(), Ok(Arrival::Bursty));
    }

    #[test]
    fn children_share_the_parent_prefix_and_differ_in_the_tail() {
        let t = generate(&small()).unwrap();
        let by_id: HashMap<u64, &TraceRecord> =
            t.records.iter().map(|r| (r.id.unwrap(), r)).collect();
        let kids: Vec<&TraceRecord> = t
            .records
            .iter()
            .filter(|r| r.session_id == Some(0) && r.fork_group.is_some())
            .collect();
        assert_eq!(kids.len(), 5);
        let parent = by_id[&kids[0].parent_id.unwrap()];
        assert!(kids.iter().all(|k| k.parent_id == kids[0].parent_id));
        // The parent's full blocks are a prefix of every child's ids.
        let full = parent.input_length / 64;
        for k in &kids {
            assert_eq!(k.hash_ids[..full], parent.hash_ids[..full]);
            assert!(k.timestamp >= parent.timestamp);
            assert!(k.input_length > parent.input_length + 150 + 300);
        }
        // Children share everything up to their directive, then differ.
        let (a, b) = (&kids[0].hash_ids, &kids[1].hash_ids);
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let shared_tokens = parent.input_length + 150 + 300;
        assert_eq!(common, shared_tokens / 64);
        assert_ne!(a.last(), b.last());
        // Without a shared prefix, sessions share nothing; with it, the system prompt
        // and tools blocks are common.
        let s1 = t.records.iter().find(|r| r.session_id == Some(1)).unwrap();
        assert_ne!(s1.hash_ids[0], parent.hash_ids[0]);
        let herd = generate(&GenConfig {
            shared_prefix: true,
            ..small()
        })
        .unwrap();
        let h0 = herd
            .records
            .iter()
            .find(|r| r.session_id == Some(0))
            .unwrap();
        let h1 = herd
            .records
            .iter()
            .find(|r| r.session_id == Some(1))
            .unwrap();
        assert_eq!(h0.hash_ids[..2000 / 64], h1.hash_ids[..2000 / 64]);
        assert_ne!(h0.hash_ids[3000 / 64], h1.hash_ids[3000 / 64]);
    }
}
