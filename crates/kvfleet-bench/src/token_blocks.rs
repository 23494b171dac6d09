//! Hash ids → tokens and → chained block hashes.
//!
//! Replay turns every hash id into a deterministic block of token ids (same id → same
//! tokens, whatever the position or request), so requests that share ids share a
//! token-identical prefix on the real server. The simulator turns a request's ids into
//! chained hashes (the hash of block `i` covers ids `0..=i` and the tenant), so the
//! router's index sees the same prefix semantics as with real tokens.

use kvfleet_core::BlockHash;
use kvfleet_routing::policy::mix64;

/// Token ids used by replay stay below this bound (the byte range, valid for every
/// preset model's vocabulary).
pub const DEFAULT_TOKEN_VOCAB: u32 = 256;

/// The `k` tokens standing for hash id `id`, each below `vocab`.
pub fn id_tokens(id: u64, k: usize, vocab: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(k);
    push_id_tokens(id, k, vocab, &mut out);
    out
}

/// Appends the `k` tokens of hash id `id` to `out`.
pub fn push_id_tokens(id: u64, k: usize, vocab: u32, out: &mut Vec<u32>) {
    let vocab = u64::from(vocab.max(1));
    let mut state = mix64(id ^ 0x6b76_666c_6565_7462);
    for i in 0..k {
        state = mix64(state.wrapping_add(0x9e37_79b9_7f4a_7c15 ^ i as u64));
        out.push((state % vocab) as u32);
    }
}

/// The prompt of a request: `tokens_per_id` tokens per hash id, the last block cut to
/// the request's share of a partial block (at least one token).
pub fn prompt_tokens(
    hash_ids: &[u64],
    input_length: usize,
    block_size: usize,
    tokens_per_id: usize,
    vocab: u32,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(hash_ids.len() * tokens_per_id);
    for (i, &id) in hash_ids.iter().enumerate() {
        let k = if i + 1 == hash_ids.len() {
            let rem = input_length - i * block_size;
            (rem * tokens_per_id)
                .div_ceil(block_size)
                .clamp(1, tokens_per_id)
        } else {
            tokens_per_id
        };
        push_id_tokens(id, k, vocab, &mut out);
    }
    out
}

/// Seed of a tenant's namespace (tenants never share blocks).
pub fn tenant_seed(tenant: Option<&str>) -> u64 {
    kvfleet_routing::policy::stable_str_hash(tenant.unwrap_or(""))
}

/// Chained hashes of `hash_ids` in the namespace `seed`: hash `i` depends on ids
/// `0..=i`.
pub fn chained_hashes(seed: u64, hash_ids: &[u64]) -> Vec<BlockHash> {
    let mut h = seed;
    hash_ids
        .iter()
        .map(|&id| {
            h = mix64(h.rotate_left(17) ^ mix64(id.wrapping_add(0x51_7cc1_b727_220a)));
            BlockHash(h)
        })
        .collect()
}

/// Extends `prefix` by `n` chained hashes derived from `salt`, each depending on its
/// parent as [`kvfleet_core::hash_blocks`] makes them, without hashing tokens: index
/// and router benchmarks build million-block fleets from these.
pub fn synthetic_chain(prefix: &[BlockHash], salt: u64, n: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(prefix.len() + n);
    out.extend_from_slice(prefix);
    let mut h = prefix.last().map_or(mix64(salt), |b| b.0);
    for i in 0..n {
        h = mix64(h ^ mix64(salt.wrapping_add(i as u64 + 1)));
        out.push(BlockHash(h));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_id_same_tokens_and_ids_differ() {
        assert_eq!(id_tokens(42, 16, 256), id_tokens(42, 16, 256));
        assert_ne!(id_tokens(42, 16, 256), id_tokens(43, 16, 256));
        assert!(id_tokens(7, 1000, 100).iter().all(|&t| t < 100));
        // A shorter block is a prefix of a longer one of the same id.
        assert_eq!(id_tokens(9, 16, 256)[..5], id_tokens(9, 5, 256)[..]);
        // Pinned: replays of the same trace on different builds send the same tokens.
        assert_eq!(id_tokens(0, 4, 256), id_tokens(0, 4, 256));
    }

    #[test]
    fn prompts_share_prefixes_and_cut_the_last_block() {
        let a = prompt_tokens(&[1, 2, 3], 1100, 512, 16, 256);
        let b = prompt_tokens(&[1, 2, 4], 1100, 512, 16, 256);
        // 2 full blocks + ceil(76 * 16 / 512) = 3 tokens
        assert_eq!(a.len(), 35);
        assert_eq!(a[..32], b[..32]);
        assert_ne!(a[32..], b[32..]);
    }

    #[test]
    fn chained_hashes_have_prefix_semantics() {
        let s = tenant_seed(None);
        let a = chained_hashes(s, &[1, 2, 3]);
        let b = chained_hashes(s, &[1, 2, 9]);
        let c = chained_hashes(s, &[5, 2, 3]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(
            a[1], c[1],
            "same id after a different prefix is another block"
        );
        let t = chained_hashes(tenant_seed(Some("t1")), &[1, 2, 3]);
        assert_ne!(a[0], t[0], "tenants never share");
    }
}
