//! Token ids and the blocks they are grouped into.

/// A token id in a model's vocabulary.
pub type TokenId = u32;

/// Number of full blocks in `n_tokens` tokens.
pub fn full_blocks(n_tokens: usize, block_size: usize) -> usize {
    n_tokens / block_size
}

/// Number of blocks, the last possibly partial, needed to hold `n_tokens` tokens.
pub fn blocks_needed(n_tokens: usize, block_size: usize) -> usize {
    n_tokens.div_ceil(block_size)
}

/// Blocks a prompt of `prompt_tokens` needs before it can start: its tokens and the
/// first one generated. An engine refuses a prompt needing more than its whole pool.
pub fn blocks_to_start(prompt_tokens: usize, block_size: usize) -> usize {
    blocks_needed(prompt_tokens + 1, block_size)
}
