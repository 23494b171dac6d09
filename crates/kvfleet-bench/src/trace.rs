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

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
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
        for (i, line) in reader.lines().enumerate() {
            let n = i + 1;
            let line = line.with_context(|| format!("line {n}: reading"))?;
            if line.trim().is_empty() {
                continue;
            }
            let mut r: TraceRecord = serde_json::from_str(&line)
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
                bail!("line {n}: duplicate id {id}");
            }
            if let Some(p) = r.parent_id {
                if !ids.contains(&p) || p == id {
                    bail!("line {n}: parent_id {p} does not name an earlier request");
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
