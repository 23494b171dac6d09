//! Block pool costs at 1M blocks: allocate + free, and prefix lookup per block.
//!
//! `cargo bench --bench block_pool`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvfleet_core::{hash_blocks, namespace_seed};
use kvfleet_engine::block_pool::BlockPool;

const BLOCKS: usize = 1 << 20;

/// A pool whose every block caches one block of a long chain, all idle on the free
/// list: the state of a warm worker, where each allocation evicts a cached block.
fn warm_pool() -> (BlockPool, Vec<kvfleet_core::BlockHash>) {
    let mut pool = BlockPool::new(BLOCKS);
    let tokens: Vec<u32> = (0..(BLOCKS * 16) as u32).map(|i| i % 50_000).collect();
    let hashes = hash_blocks(namespace_seed("bench", ""), &tokens, 16);
    let mut held = Vec::with_capacity(BLOCKS);
    let mut parent = None;
    for h in &hashes {
        let id = pool.allocate().expect("free block");
        pool.publish_ready(id, *h, parent);
        parent = Some(*h);
        held.push(id);
    }
    for id in held.into_iter().rev() {
        pool.release(id, 0);
    }
    pool.drain_events();
    (pool, hashes)
}

fn bench_pool(c: &mut Criterion) {
    let (mut pool, hashes) = warm_pool();
    let mut g = c.benchmark_group("block_pool_1M");
    g.throughput(Throughput::Elements(1));
    g.bench_function("allocate_free_evicting", |b| {
        b.iter(|| {
            let id = pool.allocate().expect("free block");
            pool.release(std::hint::black_box(id), 0);
        });
        pool.drain_events();
    });

    // Prefix lookup of a 2,048-block prompt: acquire every block, then release them.
    let (mut pool, hashes2) = warm_pool();
    let _ = hashes;
    let prompt = &hashes2[..2048];
    g.throughput(Throughput::Elements(prompt.len() as u64));
    g.bench_function("prefix_lookup_2048_blocks", |b| {
        b.iter_batched_ref(
            Vec::new,
            |held: &mut Vec<u32>| {
                for h in prompt {
                    match pool.acquire(*h) {
                        Some(id) => held.push(id),
                        None => break,
                    }
                }
                for id in held.drain(..).rev() {
                    pool.release(id, 0);
                }
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("lookup_only_2048_blocks", |b| {
        b.iter(|| {
            prompt
                .iter()
                .take_while(|h| pool.lookup(**h).is_some())
                .count()
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench_pool
}
criterion_main!(benches);
