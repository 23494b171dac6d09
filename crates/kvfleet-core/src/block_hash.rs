//! Chained block hashes: the one definition of "same prefix" that router and worker share.
//!
//! A prompt is cut into blocks of `block_size` tokens. Only full blocks are hashed:
//! `h[0] = xxh3_64(namespace_seed ‖ tokens[0..bs])` and
//! `h[i] = xxh3_64(h[i-1] ‖ tokens[i·bs..(i+1)·bs])`, every value little-endian
//! (the seed and parent hash as u64, token ids as u32). Because each hash covers its
//! parent, equal hashes at equal depth mean an identical token prefix.

use crate::tokens::TokenId;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Default number of tokens per KV block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The hash of one full block of tokens, chained over all blocks before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

impl std::fmt::Display for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A hasher for keys that are already uniformly distributed hashes: it passes the u64
/// through, so maps keyed by [`BlockHash`] skip a second round of hashing.
#[derive(Default, Clone, Copy, Debug)]
pub struct PassThroughHasher(u64);

impl std::hash::Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys; fold them so the hasher stays correct.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// A `HashMap` keyed by block hash, without re-hashing the key.
pub type BlockHashMap<V> =
    std::collections::HashMap<BlockHash, V, std::hash::BuildHasherDefault<PassThroughHasher>>;

/// Seed of a cache namespace: blocks are shared only between requests whose model id
/// and cache salt (the tenant's, by default) are both equal.
pub fn namespace_seed(model_id: &str, cache_salt: &str) -> u64 {
    // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    let mut buf = Vec::with_capacity(32 + model_id.len() + cache_salt.len());
    buf.extend_from_slice(b"kvfleet/ns/v1");
    buf.extend_from_slice(&(model_id.len() as u64).to_le_bytes());
    buf.extend_from_slice(model_id.as_bytes());
    buf.extend_from_slice(&(cache_salt.len() as u64).to_le_bytes());
    buf.extend_from_slice(cache_salt.as_bytes());
    xxh3_64(&buf)
}

/// Hash of one full block given the previous block's hash (or the namespace seed for
/// the first block).
pub fn chain_hash(parent_or_seed: u64, block: &[TokenId]) -> BlockHash {
    // One-shot hashing of a stack buffer is several times faster than feeding the
    // streaming hasher 4 bytes at a time; blocks larger than the buffer stream.
    const MAX_INLINE_TOKENS: usize = 64;
    if block.len() <= MAX_INLINE_TOKENS {
        let mut buf = [0u8; 8 + 4 * MAX_INLINE_TOKENS];
        buf[..8].copy_from_slice(&parent_or_seed.to_le_bytes());
        for (i, t) in block.iter().enumerate() {
            buf[8 + 4 * i..12 + 4 * i].copy_from_slice(&t.to_le_bytes());
        }
        return BlockHash(xxh3_64(&buf[..8 + 4 * block.len()]));
    }
    let mut h = Xxh3::new();
    h.update(&parent_or_seed.to_le_bytes());
    for t in block {
        h.update(&t.to_le_bytes());
    }
    BlockHash(h.digest())
}

/// Hashes of every full block of `tokens`; a trailing partial block is not hashed.
pub fn hash_blocks(seed: u64, tokens: &[TokenId], block_size: usize) -> Vec<BlockHash> {
    extend_block_hashes(seed, &[], tokens, block_size)
}

/// Continue a chain: given the hashes already computed for the first
/// `known.len()` blocks of `tokens`, hash the remaining full blocks. Used where a
/// conversation grows by appending, so earlier blocks are never hashed twice.
pub fn extend_block_hashes(
    seed: u64,
    known: &[BlockHash],
    tokens: &[TokenId],
    block_size: usize,
) -> Vec<BlockHash> {
    assert!(block_size > 0, "block_size must be positive");
    let full = tokens.len() / block_size;
    let mut out = Vec::with_capacity(full);
    out.extend_from_slice(&known[..known.len().min(full)]);
    let mut parent = out.last().map_or(seed, |h| h.0);
    for b in out.len()..full {
        let h = chain_hash(parent, &tokens[b * block_size..(b + 1) * block_size]);
        out.push(h);
        parent = h.0;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_written_definition() {
        let seed = namespace_seed("tiny", "");
        let toks: Vec<u32> = (0..40).collect();
        let hs = hash_blocks(seed, &toks, 16);
        assert_eq!(hs.len(), 2, "the 8-token tail is not hashed");
        let mut b0 = seed.to_le_bytes().to_vec();
        for t in &toks[0..16] {
            b0.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(hs[0].0, xxh3_64(&b0));
        let mut b1 = hs[0].0.to_le_bytes().to_vec();
        for t in &toks[16..32] {
            b1.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(hs[1].0, xxh3_64(&b1));
    }

    #[test]
    fn namespaces_separate_tenants_and_models() {
        let toks: Vec<u32> = (0..16).collect();
        let a = hash_blocks(namespace_seed("m", "tenant-a"), &toks, 16);
        let b = hash_blocks(namespace_seed("m", "tenant-b"), &toks, 16);
        let c = hash_blocks(namespace_seed("m2", "tenant-a"), &toks, 16);
        assert_ne!(a, b);
        assert_ne!(a, c);
        assert_ne!(namespace_seed("ab", "c"), namespace_seed("a", "bc"));
    }

    #[test]
    fn chain_depends_on_every_earlier_token() {
        let seed = namespace_seed("m", "");
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[3] = 999;
        let ha = hash_blocks(seed, &a, 16);
        let hb = hash_blocks(seed, &b, 16);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
    }

    #[test]
    fn large_blocks_hash_by_the_same_definition() {
        let toks: Vec<u32> = (0..300).collect();
        let mut bytes = 42u64.to_le_bytes().to_vec();
        for t in &toks[..128] {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(hash_blocks(42, &toks, 128)[0].0, xxh3_64(&bytes));
    }

    #[test]
    fn extending_equals_hashing_from_scratch() {
        let seed = namespace_seed("m", "s");
        let toks: Vec<u32> = (0..100).map(|i| i * 7 % 31).collect();
        let first = hash_blocks(seed, &toks[..37], 16);
        assert_eq!(
            extend_block_hashes(seed, &first, &toks, 16),
            hash_blocks(seed, &toks, 16)
        );
    }
}
