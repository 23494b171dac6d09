//! The trace format: JSONL, one request per line, a superset of the Mooncake trace
//! format (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`), with
//! optional `block_size` (default 512), `id`, `session_id`, `parent_id`, `fork_group`
//! and `tenant`.
//!
//! `hash_ids` holds one id per `block_size`-token block of the prompt (the last one
//! possibly partial); equal ids at equal positions with equal ids before them mean a
//! shared prefix. `id` names a request (default: its 0-based line index among the
//! requests) so that `parent_id` can point at it: a request with a parent starts only
//! after its parent finished. Readers validate every line and name the bad one.
//!
//! `id`, `parent_id`, `session_id` and `fork_group` may be integers or strings (traces
//! exported from other systems name them with strings). Strings are numbered as they
//! are first met, from 2^63 up; so that they never meet an integer id, a trace that
//! names ids with strings must number the rest below 2^63. A trace written back holds
//! the numbers, and reads back the same.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, Write};
use std::path::Path;

/// Default tokens per hash id (the Mooncake traces' block size).
pub const DEFAULT_TRACE_BLOCK_SIZE: usize = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: usize,
    /// Tokens to generate.
    pub output_length: usize,
    /// One id per block of the prompt.
    pub hash_ids: Vec<u64>,
    /// Tokens per hash id (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// The request's id, for `parent_id` references (default: its index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    /// The agent session it belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<u64>,
    /// The request that must finish before this one starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<u64>,
    /// The fork group (siblings forked from one parent turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_group: Option<u64>,
    /// The tenant (its cache namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

impl TraceRecord {
    /// Tokens per hash id.
    pub fn block_size(&self) -> usize {
        self.block_size.unwrap_or(DEFAULT_TRACE_BLOCK_SIZE)
    }
}

/// A validated trace: records in file order, each with its id resolved.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    /// The requests.
    pub records: Vec<TraceRecord>,
}

impl Trace {
    /// The trace's block size (the first record's; all must agree).
    pub fn block_size(&self) -> usize {
        self.records
            .first()
            .map_or(DEFAULT_TRACE_BLOCK_SIZE, TraceRecord::block_size)
    }

    /// Total hash ids (blocks) over all requests.
    pub fn total_blocks(&self) -> usize {
        self.records.iter().map(|r| r.hash_ids.len()).sum()
    }

    /// Each record's parent, as an index into `records` (`None` without a
    /// `parent_id`, or when it names no record).
    pub fn parent_indices(&self) -> Vec<Option<usize>> {
        let index_of: std::collections::HashMap<u64, usize> = self
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.id.unwrap_or(i as u64), i))
            .collect();
        self.records
            .iter()
            .map(|r| r.parent_id.and_then(|p| index_of.get(&p).copied()))
            .collect()
    }

    /// Duration from first to last arrival, in ms.
    pub fn span_ms(&self) -> u64 {
        let max = self.records.iter().map(|r| r.timestamp).max().unwrap_or(0);
        let min = self.records.iter().map(|r| r.timestamp).min().unwrap_or(0);
        max - min
    }

    /// The same trace with every timestamp multiplied by `factor`
    /// (> 1 stretches it: a lighter load).
    pub fn scaled_time(&self, factor: f64) -> Trace {
        let mut t = self.clone();
        for r in &mut t.records {
            r.timestamp = (r.timestamp as f64 * factor).round() as u64;
        }
        t
    }

    /// The same trace at `tokens_per_id` tokens per hash id: each record's block size
    /// becomes `tokens_per_id` and its length the length replay sends
    /// ([`crate::token_blocks::prompt_tokens`]).
    pub fn with_tokens_per_id(&self, tokens_per_id: usize) -> Trace {
        let mut t = self.clone();
        for r in &mut t.records {
            let bs = r.block_size();
            let n = r.hash_ids.len();
            let last = r.input_length - (n - 1) * bs;
            let last_k = (last * tokens_per_id).div_ceil(bs).clamp(1, tokens_per_id);
            r.input_length = (n - 1) * tokens_per_id + last_k;
            r.block_size = Some(tokens_per_id);
        }
        t
    }

    /// The first `n` records.
    pub fn truncated(&self, n: usize) -> Trace {
        Trace {
            records: self.records.iter().take(n).cloned().collect(),
        }
    }

    /// Reads and validates a JSONL trace file.
    pub fn read_path(path: &Path) -> Result<Trace> {
        let f = std::fs::File::open(path)
            .with_context(|| format!("opening trace {}", path.display()))?;
        Self::read(std::io::BufReader::new(f))
            .with_context(|| format!("reading trace {}", path.display()))
    }

    /// Reads and validates a JSONL trace. Blank lines are skipped; any other bad line
    /// is an error naming its 1-based line number.
    pub fn read(reader: impl BufRead) -> Result<Trace> {
        let mut records: Vec<TraceRecord> = Vec::new();
        let mut ids = HashSet::new();
        let mut block_size = None;
        let mut names = IdNames::default();
        for (i, line) in reader.lines().enumerate() {
            let n = i + 1;
            let line = line.with_context(|| format!("line {n}: reading"))?;
            if line.trim().is_empty() {
                continue;
            }
            let mut value: serde_json::Value = serde_json::from_str(&line)
                .with_context(|| format!("line {n}: not a valid trace record"))?;
            names
                .number(&mut value)
                .with_context(|| format!("line {n}"))?;
            let mut r: TraceRecord = serde_json::from_value(value)
                .with_context(|| format!("line {n}: not a valid trace record"))?;
            let bs = r.block_size();
            if bs == 0 {
                bail!("line {n}: block_size must be at least 1");
            }
            match block_size {
                None => block_size = Some(bs),
                Some(b) if b != bs => {
                    bail!("line {n}: block_size {bs} differs from the trace's {b}")
                }
                _ => {}
            }
            let need = r.input_length.div_ceil(bs);
            if r.hash_ids.len() != need {
                bail!(
                    "line {n}: {} hash_ids for input_length {} (block size {bs} needs {need})",
                    r.hash_ids.len(),
                    r.input_length
                );
            }
            if r.input_length == 0 {
                bail!("line {n}: input_length must be at least 1");
            }
            if let Some(prev) = records.last() {
                if r.timestamp < prev.timestamp {
                    bail!(
                        "line {n}: timestamp {} is before the previous line's {}",
                        r.timestamp,
                        prev.timestamp
                    );
                }
            }
            let id = *r.id.get_or_insert(records.len() as u64);
            if !ids.insert(id) {
                bail!(
                    "line {n}: duplicate id {}",
                    names.show(IdSpace::Request, id)
                );
            }
            if let Some(p) = r.parent_id {
                if !ids.contains(&p) || p == id {
                    bail!(
                        "line {n}: parent_id {} does not name an earlier request",
                        names.show(IdSpace::Request, p)
                    );
                }
            }
            records.push(r);
        }
        Ok(Trace { records })
    }

    /// Writes the trace as JSONL.
    pub fn write(&self, mut w: impl Write) -> Result<()> {
        for r in &self.records {
            serde_json::to_writer(&mut w, r)?;
            w.write_all(b"\n")?;
        }
        w.flush()?;
        Ok(())
    }

    /// Writes the trace to a file.
    pub fn write_path(&self, path: &Path) -> Result<()> {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        self.write(std::io::BufWriter::new(f))
    }
}

/// The id spaces of a trace: `id` and `parent_id` share one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum IdSpace {
    Request,
    Session,
    ForkGroup,
}

/// Numbers for string ids, per space, in the order they are first met.
#[derive(Default)]
struct IdNames {
    numbers: HashMap<(IdSpace, String), u64>,
    names: HashMap<(IdSpace, u64), String>,
    /// The first integer id at or above [`FIRST_NAMED_ID`], if any was met.
    high_integer: Option<(&'static str, u64)>,
}

/// The first number a string id gets: above every integer id a trace may hold.
const FIRST_NAMED_ID: u64 = 1 << 63;

impl IdNames {
    /// Replaces the string ids in one record's fields by numbers. `parent_id` must name
    /// an `id` already met; the other fields get a new number on first sight. A trace
    /// with string ids must keep its integer ids below [`FIRST_NAMED_ID`].
    fn number(&mut self, value: &mut serde_json::Value) -> Result<()> {
        let Some(fields) = value.as_object_mut() else {
            bail!("not a JSON object");
        };
        for (field, space) in [
            ("id", IdSpace::Request),
            ("parent_id", IdSpace::Request),
            ("session_id", IdSpace::Session),
            ("fork_group", IdSpace::ForkGroup),
        ] {
            let Some(v) = fields.get_mut(field) else {
                continue;
            };
            match v {
                serde_json::Value::String(name) => {
                    let key = (space, std::mem::take(name));
                    let number = match self.numbers.get(&key) {
                        Some(&k) => k,
                        None if field == "parent_id" => {
                            bail!("parent_id {:?} does not name an earlier request", key.1)
                        }
                        None => {
                            let k = FIRST_NAMED_ID + self.numbers.len() as u64;
                            self.names.insert((space, k), key.1.clone());
                            self.numbers.insert(key, k);
                            k
                        }
                    };
                    *v = serde_json::Value::from(number);
                }
                serde_json::Value::Number(num) => {
                    if let Some(k) = num.as_u64().filter(|&k| k >= FIRST_NAMED_ID) {
                        self.high_integer.get_or_insert((field, k));
                    }
                }
                // Anything else is left to the record's own check, which names the type.
                _ => {}
            }
        }
        if let (Some((field, k)), false) = (self.high_integer, self.numbers.is_empty()) {
            bail!("{field} {k} is too large for a trace with string ids (integers must be below 2^63)");
        }
        Ok(())
    }

    /// An id as the trace wrote it, for messages.
    fn show(&self, space: IdSpace, id: u64) -> String {
        match self.names.get(&(space, id)) {
            Some(name) => format!("{name:?}"),
            None => id.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mooncake_lines_and_round_trips() {
        let text = "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 6, \"hash_ids\": [0, 1]}\n\n{\"timestamp\": 5, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0], \"parent_id\": 0, \"tenant\": \"a\"}\n";
        let t = Trace::read(text.as_bytes()).unwrap();
        assert_eq!(t.records.len(), 2);
        assert_eq!(t.records[1].id, Some(1));
        assert_eq!(t.records[1].parent_id, Some(0));
        assert_eq!(t.block_size(), 512);
        assert_eq!(t.total_blocks(), 3);
        let mut out = Vec::new();
        t.write(&mut out).unwrap();
        assert_eq!(Trace::read(out.as_slice()).unwrap(), t);
    }

    #[test]
    fn string_ids_read_as_their_integer_equivalent() {
        let line = |ts: u64, extra: &str| {
            format!("{{\"timestamp\": {ts}, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [7]{extra}}}\n")
        };
        let named = [
            line(0, r#", "id": "root", "session_id": "s-a""#),
            line(
                1,
                r#", "id": "k1", "parent_id": "root", "session_id": "s-a", "fork_group": "f""#,
            ),
            line(
                1,
                r#", "id": "k2", "parent_id": "root", "session_id": "s-a", "fork_group": "f""#,
            ),
            line(2, r#", "session_id": "s-b""#),
        ]
        .concat();
        let t = Trace::read(named.as_bytes()).unwrap();
        let r = &t.records;
        // Requests numbered from 2^63 in order; the unnamed one takes its index.
        let root = FIRST_NAMED_ID;
        assert_eq!(r[0].id, Some(root));
        assert_eq!([r[1].parent_id, r[2].parent_id], [Some(root), Some(root)]);
        assert!(r[1].id > Some(root) && r[2].id > r[1].id);
        assert_eq!(r[3].id, Some(3));
        assert_eq!(r[0].session_id, r[1].session_id);
        assert_ne!(r[0].session_id, r[3].session_id);
        assert_eq!(r[1].fork_group, r[2].fork_group);
        assert!(r[1].fork_group.is_some());
        // Written back as numbers, it reads the same.
        let mut out = Vec::new();
        t.write(&mut out).unwrap();
        assert_eq!(Trace::read(out.as_slice()).unwrap(), t);

        let orphan = [line(0, r#", "id": "a""#), line(1, r#", "parent_id": "b""#)].concat();
        let err = format!("{:#}", Trace::read(orphan.as_bytes()).unwrap_err());
        assert!(
            err.starts_with(r#"line 2: parent_id "b" does not name"#),
            "{err}"
        );
        let twice = [line(0, r#", "id": "a""#), line(1, r#", "id": "a""#)].concat();
        let err = format!("{:#}", Trace::read(twice.as_bytes()).unwrap_err());
        assert!(err.starts_with(r#"line 2: duplicate id "a""#), "{err}");
        let huge = [
            line(0, r#", "session_id": 9223372036854775808"#),
            line(0, r#", "session_id": "s""#),
        ]
        .concat();
        let err = format!("{:#}", Trace::read(huge.as_bytes()).unwrap_err());
        assert!(
            err.starts_with("line 2: session_id 9223372036854775808 is too large"),
            "{err}"
        );
        let bad = line(0, r#", "fork_group": [1]"#);
        let err = format!("{:#}", Trace::read(bad.as_bytes()).unwrap_err());
        assert!(err.starts_with("line 1: not a valid trace record"), "{err}");
    }

    #[test]
    fn bad_lines_are_named_by_number() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [7]}";
        let cases = [
            ("{\"timestamp\": 1, \"input_length\": 10}", "line 3"),
            ("not json", "line 3"),
            ("{\"timestamp\": 1, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [7]}", "line 3: 1 hash_ids"),
            ("{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [7], \"parent_id\": 9}", "line 3: parent_id 9"),
            ("{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [7], \"bogus\": 1}", "line 3"),
        ];
        for (bad, want) in cases {
            let text = format!("{good}\n{good}\n{bad}\n{good}\n");
            let err = format!("{:#}", Trace::read(text.as_bytes()).unwrap_err());
            assert!(err.starts_with(want), "{bad}: {err}");
        }
        let back = format!(
            "{}\n{good}\n",
            good.replace("\"timestamp\": 0", "\"timestamp\": 9")
        );
        let err = format!("{:#}", Trace::read(back.as_bytes()).unwrap_err());
        assert!(err.starts_with("line 2: timestamp 0"), "{err}");
    }
}
