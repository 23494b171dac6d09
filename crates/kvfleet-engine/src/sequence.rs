//! One request's state inside the engine: its tokens, its block table and how far
//! its K/V have been computed.

use crate::block_pool::BlockId;
use crate::sampling::{Sampler, SamplingParams};
use crate::stop_matcher::StopMatcher;
use kvfleet_core::tokenizer::{StreamDecoder, Tokenizer};
use kvfleet_core::{chain_hash, BlockHash, TokenId};

/// Caller-chosen id of a request (unique among the engine's unfinished requests).
pub type RequestId = u64;

/// Why a sequence stopped generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// The caller aborted it.
    Aborted,
    /// A prefill-only request (a fork parent) finished computing its prompt.
    Prefilled,
}

/// Where a sequence is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqStatus {
    /// Queued, holding no blocks.
    Waiting,
    /// Admitted: holds blocks and is scheduled every step it can make progress.
    Running,
    /// Done.
    Finished(FinishReason),
}

/// A request as the engine tracks it.
pub struct Sequence {
    /// The request id (also the owner id of blocks it computes).
    pub id: RequestId,
    /// Order of arrival; lower runs first (FCFS).
    pub arrival: u64,
    /// Prompt followed by every generated token.
    pub tokens: Vec<TokenId>,
    /// Number of prompt tokens.
    pub prompt_len: usize,
    /// Blocks holding this sequence's K/V, in position order.
    pub block_table: Vec<BlockId>,
    /// Tokens whose K/V are in the cache (a prefix of `tokens`).
    pub num_computed: usize,
    /// Chained hashes of the full blocks of `tokens[..cacheable_len]`.
    pub hashes: Vec<BlockHash>,
    /// Namespace seed of this request's cache (model id + cache salt).
    pub namespace: u64,
    /// Tokens past this index never enter the shared prefix cache.
    pub cacheable_len: usize,
    /// Current status.
    pub status: SeqStatus,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// The sequence's own random stream (kept across preemption).
    pub sampler: Sampler,
    /// Prompt tokens this sequence ran through the model itself, over all attempts.
    pub prompt_tokens_computed: usize,
    /// Whether the prompt's cached-token count has been fixed (first prefill done).
    pub cached_tokens: Option<usize>,
    /// Only compute the prompt; sample nothing (a fork parent).
    pub prefill_only: bool,
    /// How many times the scheduler evicted this sequence to recompute it later.
    pub preemptions: u32,
    /// Text decoder for generated tokens.
    pub decoder: StreamDecoder,
    /// Stop-string matcher over the decoded text.
    pub stop: StopMatcher,
    /// The block size hashes are computed with.
    pub block_size: usize,
    /// The grammar's state when the request has one (structured outputs).
    pub constraint: Option<Box<crate::constrained::SeqConstraint>>,
    /// Promoted prefix blocks (from a lower tier or a peer) this sequence holds a
    /// reference to until it is admitted, so nothing evicts them in between.
    pub staged: Vec<BlockId>,
    /// Of `staged`, the blocks nobody else referenced when it took them: what its
    /// hold takes from the free pool (a prefix a queued sibling holds costs nothing
    /// more).
    pub staged_free: usize,
    /// Disk reads of its prefix still in flight: not admitted until they land.
    pub awaiting_loads: usize,
    /// Whether its prefix has been looked up in the lower tiers since it last queued.
    pub tier_staged: bool,
    /// Prompt tokens of its prefix that came from each tier instead of the model.
    pub promoted: PromotedTokens,
    /// The pin its request asked for, until its prompt is computed and it is applied.
    pub pin: Option<crate::pins::PinSpec>,
}

pub use kvfleet_core::kv_events::PromotedTokens;

impl Sequence {
    /// The text still held back when the sequence ends at a length limit: the
    /// decoder's rest, cut at a stop string if one completes in it (then `true`: the
    /// sequence stopped rather than ran out), else with the matcher's held text.
    pub fn finish_text(&mut self, tokenizer: &dyn Tokenizer) -> (String, bool) {
        let rest = self.decoder.finish(tokenizer).unwrap_or_default();
        let check = self.stop.push(&rest);
        let mut text = check.emit;
        if !check.stopped {
            text.push_str(&self.stop.flush());
        }
        (text, check.stopped)
    }

    /// Leading full blocks (of `block_size` tokens) that may be taken from the cache:
    /// every one before the block holding the last token, whose logits must be computed.
    pub fn reusable_blocks(&self, block_size: usize) -> usize {
        (self.tokens.len().saturating_sub(1) / block_size.max(1)).min(self.hashes.len())
    }

    /// Number of generated tokens.
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to be run through the model before the next sample.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Generated token ids.
    pub fn output_tokens(&self) -> &[TokenId] {
        &self.tokens[self.prompt_len..]
    }

    /// Hashes every full block that is now complete and cacheable.
    pub fn extend_hashes(&mut self) {
        let limit = self.tokens.len().min(self.cacheable_len);
        let full = limit / self.block_size;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = self.hashes.last().map_or(self.namespace, |h| h.0);
            let h = chain_hash(
                parent,
                &self.tokens[i * self.block_size..(i + 1) * self.block_size],
            );
            self.hashes.push(h);
        }
    }

    /// Parent hash of block `i` (None for the first block).
    pub fn parent_of(&self, i: usize) -> Option<BlockHash> {
        if i == 0 {
            None
        } else {
            self.hashes.get(i - 1).copied()
        }
    }
}
