//! Property test: random allocate / free / fork / evict / lookup / in-flight sequences
//! against a shadow model of what each block holds.

use kvfleet_core::BlockHash;
use kvfleet_engine::block_pool::{BlockId, BlockPool};
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Op {
    /// A new sequence whose prompt is `len` blocks of chain `chain`.
    Admit { chain: u8, len: u8, in_flight: bool },
    /// Free sequence `i` (mod live count).
    Free(usize),
    /// Fork sequence `i` into `n` children.
    Fork(usize, u8),
    /// Grab and return `n` private blocks (forces evictions).
    Churn(u8),
    /// Look up block `depth` of chain `chain`.
    Lookup { chain: u8, depth: u8 },
    /// Finish any in-flight blocks of sequence `i`.
    Complete(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..4, 1u8..8, any::<bool>()).prop_map(|(chain, len, in_flight)| Op::Admit { chain, len, in_flight }),
        3 => (0usize..64).prop_map(Op::Free),
        1 => (0usize..64, 1u8..4).prop_map(|(i, n)| Op::Fork(i, n)),
        1 => (1u8..12).prop_map(Op::Churn),
        2 => (0u8..4, 0u8..8).prop_map(|(chain, depth)| Op::Lookup { chain, depth }),
        2 => (0usize..64).prop_map(Op::Complete),
    ]
}

/// Hash of block `depth` of chain `chain`: chains 0 and 1 share their first 2 blocks.
fn chain_hash(chain: u8, depth: u8) -> BlockHash {
    let root = if depth < 2 && chain < 2 {
        0
    } else {
        chain as u64
    };
    BlockHash(root << 32 | depth as u64 | 1 << 40)
}

struct Shadow {
    pool: BlockPool,
    /// What each block's memory holds: the hash whose K/V were written there.
    content: Vec<Option<BlockHash>>,
    /// Live sequences: (owner id, blocks).
    seqs: Vec<(u64, Vec<BlockId>)>,
    next_owner: u64,
}

impl Shadow {
    fn holders(&self) -> HashMap<BlockId, u32> {
        let mut m = HashMap::new();
        for (_, bs) in &self.seqs {
            for b in bs {
                *m.entry(*b).or_insert(0) += 1;
            }
        }
        m
    }

    fn allocate(&mut self) -> Option<BlockId> {
        let id = self.pool.allocate()?;
        assert!(
            !self.seqs.iter().any(|(_, bs)| bs.contains(&id)),
            "allocated block {id} is still in use"
        );
        self.content[id as usize] = None;
        Some(id)
    }

    fn release_all(&mut self, owner: u64, blocks: Vec<BlockId>) {
        for b in blocks.into_iter().rev() {
            self.pool.release(b, owner);
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Admit {
                chain,
                len,
                in_flight,
            } => {
                let owner = self.next_owner;
                self.next_owner += 1;
                let mut blocks = Vec::new();
                let mut parent = None;
                for d in 0..len {
                    let h = chain_hash(chain, d);
                    if let Some(b) = self.pool.acquire(h) {
                        blocks.push(b);
                    } else {
                        let Some(b) = self.allocate() else {
                            self.release_all(owner, blocks);
                            return;
                        };
                        if in_flight {
                            if self.pool.publish_in_flight(b, h, parent, owner) {
                                self.content[b as usize] = Some(h);
                            }
                        } else if self.pool.publish_ready(b, h, parent) {
                            self.content[b as usize] = Some(h);
                        }
                        blocks.push(b);
                    }
                    parent = Some(h);
                }
                self.seqs.push((owner, blocks));
            }
            Op::Free(i) => {
                if !self.seqs.is_empty() {
                    let (owner, blocks) = self.seqs.remove(i % self.seqs.len());
                    self.release_all(owner, blocks);
                }
            }
            Op::Fork(i, n) => {
                if self.seqs.is_empty() {
                    return;
                }
                let (_, blocks) = self.seqs[i % self.seqs.len()].clone();
                let Some((&last, full)) = blocks.split_last() else {
                    return;
                };
                for _ in 0..n {
                    let owner = self.next_owner;
                    self.next_owner += 1;
                    let mut child = Vec::new();
                    for &b in full {
                        self.pool.share(b);
                        child.push(b);
                    }
                    // Copy-on-write of the last block: a private copy of its memory.
                    let Some(copy) = self.allocate() else {
                        self.release_all(owner, child);
                        return;
                    };
                    self.content[copy as usize] = self.content[last as usize];
                    child.push(copy);
                    self.seqs.push((owner, child));
                }
            }
            Op::Churn(n) => {
                let mut got = Vec::new();
                for _ in 0..n {
                    match self.allocate() {
                        Some(b) => got.push(b),
                        None => break,
                    }
                }
                self.release_all(u64::MAX - 1, got);
            }
            Op::Lookup { chain, depth } => {
                let h = chain_hash(chain, depth);
                if let Some(b) = self.pool.lookup(h) {
                    assert_eq!(
                        self.content[b as usize],
                        Some(h),
                        "lookup served block {b} whose memory holds something else"
                    );
                    assert_eq!(self.pool.hash_of(b), Some(h));
                }
            }
            Op::Complete(i) => {
                if self.seqs.is_empty() {
                    return;
                }
                let (owner, blocks) = self.seqs[i % self.seqs.len()].clone();
                for b in blocks {
                    if !self.pool.is_ready(b) && self.pool.claim(b, owner) {
                        self.pool.mark_ready(b);
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn pool_invariants_hold_under_random_operations(
        num_blocks in 1usize..24,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut pool = BlockPool::new(num_blocks);
        // Kept from the start, so every step checks it against the pool.
        let ready_index = pool.ready_index();
        let mut s = Shadow {
            pool,
            content: vec![None; num_blocks],
            seqs: Vec::new(),
            next_owner: 1,
        };
        for op in ops {
            s.apply(op);
            if let Err(e) = s.pool.check_invariants() {
                panic!("invariant broken: {e}");
            }
            // Every held block's reference count covers its holders.
            for (b, n) in s.holders() {
                prop_assert!(s.pool.ref_count(b) >= n, "block {} refcount below its holders", b);
            }
            prop_assert_eq!(s.pool.num_in_use(), s.holders().len());
            // What another thread would copy out holds what its hash names.
            for c in 0..4u8 {
                for d in 0..8u8 {
                    if let Some(b) = ready_index.id_of(chain_hash(c, d)) {
                        prop_assert_eq!(s.content[b as usize], Some(chain_hash(c, d)));
                    }
                }
            }
        }
        // Free everything: no block may leak.
        let seqs = std::mem::take(&mut s.seqs);
        for (owner, blocks) in seqs {
            s.release_all(owner, blocks);
        }
        prop_assert_eq!(s.pool.num_free(), num_blocks);
        s.pool.check_invariants().map_err(TestCaseError::fail)?;
        // Whatever is still cached must hold what its hash names.
        for c in 0..4u8 {
            for d in 0..8u8 {
                if let Some(b) = s.pool.lookup(chain_hash(c, d)) {
                    prop_assert_eq!(s.content[b as usize], Some(chain_hash(c, d)));
                }
            }
        }
    }
}
