//! The KV blocks a simulated worker's running sequences hold, counted as an engine's
//! block pool counts them: a prompt block shared by several sequences (a fork's
//! prefix) once, and each sequence's blocks for its generated tokens apart. The load
//! report gives them as `total − free`, as a real worker's does, and `cache-aware`'s
//! memory price reads them from there. A sequence holds its blocks from the start of
//! its prefill to its last token; a queued one holds none yet.

use kvfleet_core::{BlockHash, BlockHashMap};

/// Blocks held by running sequences.
#[derive(Clone, Debug, Default)]
pub struct BlocksInUse {
    /// Prompt blocks, with how many running sequences hold each.
    prompt: BlockHashMap<u32>,
    /// Blocks for the generated tokens (and the prompt's partial last block).
    output: usize,
}

impl BlocksInUse {
    /// A sequence with `prompt` full blocks and `output` more starts running.
    pub fn hold(&mut self, prompt: &[BlockHash], output: usize) {
        for &h in prompt {
            *self.prompt.entry(h).or_insert(0) += 1;
        }
        self.output += output;
    }

    /// A running sequence takes `n` more blocks for its generated tokens.
    pub fn take_output(&mut self, n: usize) {
        self.output += n;
    }

    /// A sequence started with [`hold`](Self::hold) finished.
    pub fn release(&mut self, prompt: &[BlockHash], output: usize) {
        for h in prompt {
            if let Some(n) = self.prompt.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.prompt.remove(h);
                }
            }
        }
        self.output = self.output.saturating_sub(output);
    }

    /// Whether a running sequence holds prompt block `h`.
    pub fn holds(&self, h: &BlockHash) -> bool {
        self.prompt.contains_key(h)
    }

    /// Blocks in use.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.output
    }

    /// Whether no block is in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_counts_once_and_output_blocks_apart() {
        let chain = |n: u64, tail: u64| -> Vec<BlockHash> {
            (0..n)
                .map(BlockHash)
                .chain([BlockHash(100 + tail)])
                .collect()
        };
        let mut u = BlocksInUse::default();
        // Two fork siblings: 4 shared blocks and one of their own, 2 output blocks each.
        u.hold(&chain(4, 1), 2);
        u.hold(&chain(4, 2), 2);
        assert_eq!(u.len(), 4 + 2 + 4);
        u.release(&chain(4, 1), 2);
        assert_eq!(u.len(), 4 + 1 + 2);
        u.release(&chain(4, 2), 2);
        assert!(u.is_empty());
    }
}
