//! Behaviour of the routing facade: fork siblings, spills, balance, policies.

use super::*;
use crate::events::{DumpedBlock, Medium};
use kvfleet_core::{hash_blocks, namespace_seed};

const BS: usize = 16;

/// Deterministic pseudo-random tokens for prompt `id`.
fn tokens(id: u64, n: usize) -> Vec<u32> {
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 50_000) as u32
        })
        .collect()
}

fn hashes(toks: &[u32]) -> Vec<BlockHash> {
    hash_blocks(namespace_seed("test-model", ""), toks, BS)
}

fn router(workers: usize) -> KvRouter {
    let mut r = KvRouter::default();
    for i in 0..workers {
        r.add_worker(&format!("w{i}"), BS).unwrap();
    }
    r
}

/// A fork family: one shared prefix, then a different tail per child.
fn fork_children(
    prefix_tokens: usize,
    tail_tokens: usize,
    n: usize,
) -> Vec<(Vec<BlockHash>, usize)> {
    let prefix = tokens(1, prefix_tokens);
    (0..n)
        .map(|i| {
            let mut t = prefix.clone();
            t.extend(tokens(100 + i as u64, tail_tokens));
            (hashes(&t), t.len())
        })
        .collect()
}

#[test]
fn fork_siblings_follow_the_first_under_cache_aware() {
    let mut r = router(5);
    let kids = fork_children(48_496, 200, 5);
    let mut chosen = Vec::new();
    for (i, (h, n)) in kids.iter().enumerate() {
        // Back to back: no KV event arrives in between.
        let d = r.route(h, *n, PolicyKind::CacheAware, i as u64).unwrap();
        if i > 0 {
            assert_eq!(
                d.predicted_cached_tokens, 48_496,
                "sibling {i} sees the pending prefix"
            );
        }
        assert!(d.reservation.is_some());
        chosen.push(d.worker.to_string());
    }
    assert!(chosen.iter().all(|w| *w == chosen[0]), "{chosen:?}");
    assert_eq!(r.reservations().len(), 5);
    let d = r.load(&chosen[0]).unwrap();
    assert_eq!(d.inflight_requests, 5);
}

#[test]
fn a_sibling_waits_behind_its_prefix_being_computed_but_not_behind_other_work() {
    // The first sibling is computing the 500-block prefix: waiting behind it (8,160
    // queued + 2 × 160 + 16) beats recomputing the prefix on the idle lane, which
    // would end no wait (1.5 × 8,160).
    let kids = second_sibling_follows_the_first(0);
    // The prefix already computed on w0, whose lane is busy with as much other work:
    // the idle lane starts sooner and takes the sibling (0.9 × 8,160 < 8,496).
    let mut r = router(2);
    r.apply_event(
        "w0",
        &RouterKvEvent::stored(1, None, kids[0].0[..500].to_vec()),
    )
    .unwrap();
    backlog(&mut r, "w0", 8_160);
    let d = r
        .route(&kids[1].0, kids[1].1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*d.worker, "w1");
    assert_eq!(d.deepest_match_blocks, 500);
}

#[test]
fn a_sibling_finds_its_prefix_queued_longer_than_thirty_seconds() {
    // On a slow or loaded fleet the first sibling may still be queued 40 s after it
    // was routed: its prefix is still coming, so the next sibling follows it rather
    // than computing it again on the idle lane (a 30 s TTL forgot it).
    second_sibling_follows_the_first(40_000);
}

/// Routes two fork siblings of an 8,000-token prefix over two idle workers, the second
/// `later_ms` after the first, and checks that the second follows the first onto the
/// prefix it is computing; returns the siblings.
fn second_sibling_follows_the_first(later_ms: u64) -> Vec<(Vec<BlockHash>, usize)> {
    let kids = fork_children(8_000, 160, 2);
    let mut r = router(2);
    let first = r
        .route(&kids[0].0, kids[0].1, PolicyKind::CacheAware, 0)
        .unwrap();
    let second = r
        .route(&kids[1].0, kids[1].1, PolicyKind::CacheAware, later_ms)
        .unwrap();
    assert_eq!(second.worker, first.worker);
    assert_eq!(second.predicted_cached_tokens, 8_000);
    kids
}

#[test]
fn round_robin_spreads_fork_siblings() {
    let mut r = router(5);
    let kids = fork_children(4_000, 200, 5);
    let mut chosen: Vec<String> = kids
        .iter()
        .map(|(h, n)| {
            r.route(h, *n, PolicyKind::RoundRobin, 0)
                .unwrap()
                .worker
                .to_string()
        })
        .collect();
    chosen.sort();
    chosen.dedup();
    assert_eq!(chosen.len(), 5);
}

#[test]
fn reservations_expire_and_events_confirm_them() {
    let mut r = router(3);
    let ttl = r.config().reservation_ttl_ms;
    let kids = fork_children(1_600, 40, 3);
    let (h0, n0) = &kids[0];
    let d0 = r.route(h0, *n0, PolicyKind::CacheAware, 1_000).unwrap();
    let w0 = d0.worker.to_string();
    assert_eq!(r.matches(&kids[1].0, 1_000).depth(d0.worker_idx), 100);
    // Just before the TTL the reservation still counts; at the TTL it is gone.
    assert_eq!(
        r.matches(&kids[1].0, 1_000 + ttl - 1).depth(d0.worker_idx),
        100
    );
    assert_eq!(r.matches(&kids[1].0, 1_000 + ttl).depth(d0.worker_idx), 0);
    assert!(r.reservations().is_empty());
    assert!(!r.cancel_reservation(d0.reservation.unwrap()));

    // With the reservation expired and w0 busy with the first request's prefill, the
    // next sibling goes elsewhere.
    let d1 = r
        .route(&kids[1].0, kids[1].1, PolicyKind::CacheAware, 1_000 + ttl)
        .unwrap();
    assert_ne!(d1.worker.to_string(), w0);
    assert_eq!(d1.predicted_cached_tokens, 0);

    // The worker's Stored events confirm a reservation: it ends, and the index takes
    // over.
    let (h2, n2) = &kids[2];
    let d2 = r
        .route(h2, *n2, PolicyKind::CacheAware, 1_000 + ttl)
        .unwrap();
    assert_eq!(d2.worker, d1.worker, "follows the pending sibling");
    assert_eq!(r.reservations().worker_len(d1.worker_idx), 2);
    let half = h2.len() / 2;
    r.apply_event(
        &d1.worker,
        &RouterKvEvent::stored(1, None, h2[..half].to_vec()),
    )
    .unwrap();
    assert_eq!(
        r.reservations().worker_len(d1.worker_idx),
        2,
        "not yet complete"
    );
    r.apply_event(
        &d1.worker,
        &RouterKvEvent::stored(2, Some(h2[half - 1]), h2[half..].to_vec()),
    )
    .unwrap();
    assert_eq!(
        r.reservations().worker_len(d1.worker_idx),
        1,
        "kids[2] confirmed"
    );
    assert_eq!(r.matches(h2, 1_000 + ttl).depth(d1.worker_idx), h2.len());
}

#[test]
fn cancelled_reservations_stop_attracting_siblings() {
    let mut r = router(2);
    let kids = fork_children(800, 40, 2);
    let d = r
        .route(&kids[0].0, kids[0].1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert!(r.cancel_reservation(d.reservation.unwrap()));
    r.request_finished(&d.worker, d.prefill_tokens).unwrap();
    assert_eq!(r.matches(&kids[1].0, 0).deepest(), 0);
}

#[test]
fn hot_prefix_spills_when_its_holder_is_swamped_by_prefill() {
    let mut r = router(4);
    let kids = fork_children(8_000, 160, 3);
    let (h, n) = &kids[0];
    // w2 caches the shared prefix.
    r.apply_event("w2", &RouterKvEvent::stored(1, None, h[..500].to_vec()))
        .unwrap();
    let d = r
        .route(&kids[1].0, kids[1].1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*d.worker, "w2");
    assert_eq!(d.predicted_cached_tokens, 8_000);
    r.request_finished(&d.worker, d.prefill_tokens).unwrap();
    // Now w2 reports a huge prefill queue: recomputing the prefix elsewhere is cheaper.
    r.update_load(
        "w2",
        WorkerLoad {
            queued_prefill_tokens: 1_000_000,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    let d = r.route(h, *n, PolicyKind::CacheAware, 1).unwrap();
    assert_ne!(&*d.worker, "w2");
    assert_eq!(d.predicted_cached_tokens, 0);
    assert_eq!(d.deepest_match_blocks, 500);
}

#[test]
fn bounded_load_guard_spills_and_the_spill_target_warms_a_copy() {
    let mut r = router(4);
    let kids = fork_children(48_000, 160, 4);
    r.apply_event(
        "w1",
        &RouterKvEvent::stored(1, None, kids[0].0[..3_000].to_vec()),
    )
    .unwrap();
    // w1 holds the prefix but already decodes 100 sequences; w0 is idle, w2 and w3
    // have short prefill queues. By cost alone w1 still wins (100 × 16 ≪ 1.5 ×
    // 48,000): the guard must step in.
    r.update_load(
        "w1",
        WorkerLoad {
            running: 100,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    for w in ["w2", "w3"] {
        backlog(&mut r, w, 1_000);
    }
    let d = r
        .route(&kids[0].0, kids[0].1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_ne!(&*d.worker, "w1");
    assert_eq!(d.spilled_from.as_deref(), Some("w1"));
    let spill = d.worker.clone();
    assert_eq!(&*spill, "w0", "the idle lane");
    // The spill target now (pending) holds a second copy: the next sibling follows it
    // and is predicted to hit the prefix there, rather than recompute it on a busy
    // lane.
    let d2 = r
        .route(&kids[1].0, kids[1].1, PolicyKind::CacheAware, 1)
        .unwrap();
    assert_eq!(d2.worker, spill);
    assert_eq!(d2.predicted_cached_tokens, 48_000);
    assert_eq!(d2.spilled_from.as_deref(), Some("w1"));
}

#[test]
fn absolute_prefill_cap_spills() {
    let mut cfg = RouterConfig::default();
    cfg.cache_aware.max_prefill_backlog_tokens = Some(4_500);
    let mut r = KvRouter::new(cfg);
    for i in 0..2 {
        r.add_worker(&format!("w{i}"), BS).unwrap();
    }
    let kids = fork_children(3_200, 160, 2);
    r.apply_event(
        "w0",
        &RouterKvEvent::stored(1, None, kids[0].0[..200].to_vec()),
    )
    .unwrap();
    r.update_load(
        "w0",
        WorkerLoad {
            queued_prefill_tokens: 4_400,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    // w1's lane is busy too (an idle one would start sooner than w0 and win on cost).
    r.update_load(
        "w1",
        WorkerLoad {
            queued_prefill_tokens: 100,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    // Cost favours w0 (4,400 + 2 × 160 < 100 + 2 × 3,361 and w1's price for
    // recomputing w0's prefix), but 4,400 + 160 is over the cap.
    let d = r
        .route(&kids[0].0, kids[0].1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*d.worker, "w1");
    assert_eq!(d.spilled_from.as_deref(), Some("w0"));
}

#[test]
fn unrelated_sessions_balance_and_turns_stick() {
    let mut r = router(4);
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    let mut first_turn = Vec::new();
    for s in 0..64u64 {
        let t = tokens(1_000 + s, 1_000 + (s as usize * 37) % 3_000);
        let d = r
            .route(&hashes(&t), t.len(), PolicyKind::CacheAware, s)
            .unwrap();
        *counts.entry(d.worker.to_string()).or_default() += 1;
        first_turn.push((t, d.worker.clone()));
    }
    let mean = 64.0 / 4.0;
    for (w, c) in &counts {
        assert!(*c as f64 <= 1.5 * mean, "{w} got {c}: {counts:?}");
    }
    assert_eq!(counts.len(), 4);
    // Second turns extend the first: each goes back to its session's worker.
    for (s, (t, w)) in first_turn.iter().enumerate() {
        let mut t2 = t.clone();
        t2.extend(tokens(5_000 + s as u64, 300));
        let d = r
            .route(&hashes(&t2), t2.len(), PolicyKind::CacheAware, 100)
            .unwrap();
        assert_eq!(&d.worker, w, "session {s}");
        assert_eq!(d.predicted_cached_tokens, t.len() / BS * BS);
    }
}

#[test]
fn consistent_hash_is_sticky_and_bounded() {
    let mut r = router(4);
    let kids = fork_children(640, 48, 40);
    // With requests finishing in between, the same prefix always maps to one worker.
    let mut home = None;
    for (h, n) in &kids[..10] {
        let d = r.route(h, *n, PolicyKind::ConsistentHash, 0).unwrap();
        assert_eq!(*home.get_or_insert(d.worker.clone()), d.worker);
        assert_eq!(d.spilled_from, None);
        r.request_finished(&d.worker, d.prefill_tokens).unwrap();
    }
    // A second router replica with the same workers (added in another order) agrees.
    let mut other = KvRouter::default();
    for i in (0..4).rev() {
        other.add_worker(&format!("w{i}"), BS).unwrap();
    }
    let d = other
        .route(&kids[0].0, kids[0].1, PolicyKind::ConsistentHash, 0)
        .unwrap();
    assert_eq!(Some(d.worker), home);
    // Without finishing, load bounds spread the hot key: no worker exceeds
    // ⌈1.25 × (m + 1) / 4⌉ at any point.
    let mut r = router(4);
    let mut counts = [0usize; 4];
    for (m, (h, n)) in kids.iter().enumerate() {
        let d = r.route(h, *n, PolicyKind::ConsistentHash, 0).unwrap();
        counts[d.worker_idx.index()] += 1;
        let cap = (1.25 * (m + 1) as f64 / 4.0).ceil() as usize;
        assert!(counts.iter().all(|c| *c <= cap), "{counts:?} cap {cap}");
    }
}

#[test]
fn least_loaded_and_random() {
    let mut r = router(3);
    r.update_load(
        "w0",
        WorkerLoad {
            running: 5,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    r.update_load(
        "w1",
        WorkerLoad {
            running: 2,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    r.update_load(
        "w2",
        WorkerLoad {
            running: 2,
            queued_prefill_tokens: 10,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    let d = r.route(&[], 10, PolicyKind::LeastLoaded, 0).unwrap();
    assert_eq!(&*d.worker, "w1");
    assert_eq!(d.policy, "least-loaded");
    assert_eq!(d.reservation, None, "nothing to reserve below one block");

    let pick = |seed| {
        let mut r = KvRouter::new(RouterConfig {
            random_seed: seed,
            ..RouterConfig::default()
        });
        for i in 0..4 {
            r.add_worker(&format!("w{i}"), BS).unwrap();
        }
        (0..200)
            .map(|_| {
                r.route(&[], 10, PolicyKind::Random, 0)
                    .unwrap()
                    .worker_idx
                    .index()
            })
            .collect::<Vec<_>>()
    };
    let a = pick(7);
    assert_eq!(a, pick(7), "seeded: reproducible");
    assert_ne!(a, pick(8));
    for w in 0..4 {
        let c = a.iter().filter(|x| **x == w).count();
        assert!((25..=75).contains(&c), "worker {w} picked {c} of 200");
    }
}

#[test]
fn predicted_cached_tokens_leave_one_token_to_compute() {
    let mut r = router(1);
    let t = tokens(9, 64);
    let h = hashes(&t);
    r.apply_event("w0", &RouterKvEvent::stored(1, None, h.clone()))
        .unwrap();
    // 64 tokens, all 4 blocks cached: the last token must be computed, so 3 blocks.
    let d = r.route(&h, 64, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!(d.matched_blocks, 3);
    assert_eq!(d.predicted_cached_tokens, 48);
    assert_eq!(d.prefill_tokens, 16);
    assert_eq!(d.deepest_match_blocks, 4);
    assert_eq!(d.reservation, None, "already cached: nothing to reserve");
    let d = r.route(&h, 65, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!(d.predicted_cached_tokens, 64);
    r.record_outcome(64, 48);
    r.record_outcome(16, 32);
    let p = r.snapshot().predictions;
    assert_eq!(
        (p.decisions, p.outcomes, p.overestimates, p.underestimates),
        (2, 2, 1, 1)
    );
    assert_eq!(p.abs_error_tokens, 32);
    assert_eq!(p.predicted_cached_tokens, 48 + 64);
}

#[test]
fn block_size_mismatch_is_refused() {
    let mut r = router(1);
    let err = r.add_worker("big", 32).unwrap_err();
    assert_eq!(
        err,
        RegisterError::BlockSizeMismatch {
            worker: "big".into(),
            block_size: 32,
            fleet_block_size: 16
        }
    );
    let msg = err.to_string();
    assert!(
        msg.contains("32") && msg.contains("16") && msg.contains("never mixes"),
        "{msg}"
    );
    assert_eq!(r.worker_count(), 1);
    assert_eq!(r.add_worker("", 16), Err(RegisterError::EmptyId));
}

#[test]
fn errors_for_no_workers_unknown_workers_and_gaps() {
    let mut r = KvRouter::default();
    assert_eq!(
        r.route(&[], 5, PolicyKind::CacheAware, 0),
        Err(RouteError::NoWorkers)
    );
    assert_eq!(
        r.apply_event("ghost", &RouterKvEvent::cleared(1)),
        Err(IndexError::UnknownWorker("ghost".into()))
    );
    assert_eq!(
        r.update_load("ghost", WorkerLoad::default()),
        Err(UnknownWorker("ghost".into()))
    );
    r.add_worker("w0", BS).unwrap();
    let h = hashes(&tokens(3, 64));
    r.apply_event("w0", &RouterKvEvent::stored(1, None, h[..2].to_vec()))
        .unwrap();
    let gap = r.apply_event("w0", &RouterKvEvent::stored(3, Some(h[2]), h[3..].to_vec()));
    assert!(matches!(
        gap,
        Err(IndexError::Gap {
            expected: 2,
            got: 3,
            ..
        })
    ));
    // Resync from a dump, then the stream continues after the dump's seq.
    let dump: Vec<_> = (0..4)
        .map(|i| DumpedBlock::device(h[i], i.checked_sub(1).map(|p| h[p])))
        .collect();
    r.rebuild_worker("w0", &dump, 3).unwrap();
    assert_eq!(r.last_seq("w0"), Some(3));
    r.apply_event("w0", &RouterKvEvent::removed(4, vec![h[3]]))
        .unwrap();
    assert_eq!(r.matches(&h, 0).depth(WorkerIdx(0)), 3);
}

#[test]
fn removing_a_worker_drops_its_blocks_and_reservations() {
    let mut r = router(2);
    let kids = fork_children(320, 32, 2);
    r.apply_event(
        "w1",
        &RouterKvEvent::stored(1, None, kids[0].0[..20].to_vec()),
    )
    .unwrap();
    let d = r
        .route(&kids[1].0, kids[1].1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*d.worker, "w1");
    assert!(r.remove_worker("w1"));
    assert!(!r.remove_worker("w1"));
    assert_eq!(r.index().num_blocks(), 0);
    assert!(r.reservations().is_empty());
    // The recycled slot starts clean.
    let idx = r.add_worker("w9", BS).unwrap();
    assert_eq!(idx, d.worker_idx);
    assert_eq!(r.last_seq("w9"), Some(0));
    assert_eq!(r.load("w9"), Some(WorkerLoad::default()));
    assert!(r.request_finished("w1", 1).is_err());
    let snap = r.snapshot();
    assert_eq!(snap.workers.len(), 2);
    assert_eq!(snap.workers[1].id, "w9");
    assert_eq!(snap.indexed_blocks, 0);
    assert!(serde_json::to_string(&snap).is_ok());
}

#[test]
fn snapshot_reports_blocks_load_and_inflight() {
    let mut r = router(2);
    let h = hashes(&tokens(4, 160));
    r.apply_event("w0", &RouterKvEvent::stored(1, None, h.clone()))
        .unwrap();
    r.request_started("w1", 500).unwrap();
    r.update_load(
        "w1",
        WorkerLoad {
            running: 3,
            free_blocks: 10,
            total_blocks: 20,
            ..WorkerLoad::default()
        },
    )
    .unwrap();
    let snap = r.snapshot();
    assert_eq!(snap.block_size, BS);
    assert_eq!(snap.indexed_blocks, 10);
    assert_eq!(snap.workers[0].cached_blocks, 10);
    assert_eq!(snap.workers[0].last_event_seq, 1);
    let w1 = &snap.workers[1];
    assert_eq!(
        (w1.load.inflight_requests, w1.load.inflight_prefill_tokens),
        (1, 500)
    );
    assert_eq!(w1.load.running, 3);
    assert_eq!(w1.load.prefill_tokens_since_poll, 0, "the report covers it");
}

#[test]
fn fenced_workers_are_skipped_even_when_pinned_or_holding_the_prefix() {
    let mut r = router(2);
    let t = tokens(7, 64);
    let h = hashes(&t);
    let first = r.route(&h, t.len(), PolicyKind::CacheAware, 0).unwrap();
    let holder = first.worker.to_string();
    r.set_fenced(&holder, true);
    assert!(r.is_fenced(&holder));
    for policy in [PolicyKind::CacheAware, PolicyKind::RoundRobin] {
        for i in 0..4 {
            let d = r.route(&h, t.len(), policy, 1 + i).unwrap();
            assert_ne!(
                &*d.worker,
                holder.as_str(),
                "{policy:?} routed to a fenced worker"
            );
        }
    }
    let pinned = r
        .route_pinned(&h, t.len(), Some(&holder), PolicyKind::CacheAware, 10)
        .unwrap();
    assert_ne!(
        &*pinned.worker,
        holder.as_str(),
        "a pin on a fenced worker is dropped"
    );
    r.set_fenced(&holder, false);
    let back = r.route(&h, t.len(), PolicyKind::CacheAware, 20).unwrap();
    assert_eq!(
        &*back.worker,
        holder.as_str(),
        "unfenced, the prefix holder wins again"
    );
}

#[test]
fn all_workers_fenced_is_no_workers() {
    let mut r = router(1);
    r.set_fenced("w0", true);
    let t = tokens(8, 32);
    assert!(r
        .route(&hashes(&t), t.len(), PolicyKind::RoundRobin, 0)
        .is_err());
}

/// Stores `hashes` in tier `medium` of worker `id` (as its `seq`-th event).
fn store_in(r: &mut KvRouter, id: &str, seq: u64, hashes: &[BlockHash], medium: Medium) {
    let ev = RouterKvEvent {
        seq,
        kind: RouterKvEventKind::Stored {
            parent_hash: None,
            block_hashes: hashes.to_vec(),
            medium,
        },
    };
    r.apply_event(id, &ev).unwrap();
}

fn backlog(r: &mut KvRouter, id: &str, tokens: usize) {
    let load = WorkerLoad {
        queued_prefill_tokens: tokens,
        waiting: usize::from(tokens > 0),
        ..WorkerLoad::default()
    };
    r.update_load(id, load).unwrap();
}

/// Sets `id`'s load to `running` decoding sequences and an idle prefill lane.
fn decoding(r: &mut KvRouter, id: &str, running: usize) {
    let load = WorkerLoad {
        running,
        ..WorkerLoad::default()
    };
    r.update_load(id, load).unwrap();
}

/// A 100-block prompt held in full on w0's device, w1's host tier and w2's disk; w3
/// holds nothing.
fn tiered_fleet(tiers: crate::policy::TierCostConfig) -> (KvRouter, Vec<BlockHash>, usize) {
    let mut r = KvRouter::new(RouterConfig {
        cache_aware: CacheAwareConfig {
            tiers,
            ..CacheAwareConfig::default()
        },
        ..RouterConfig::default()
    });
    for i in 0..4 {
        r.add_worker(&format!("w{i}"), BS).unwrap();
    }
    let toks = tokens(77, 100 * BS + 1);
    let h = hashes(&toks);
    store_in(&mut r, "w0", 1, &h, Medium::Device);
    store_in(&mut r, "w1", 1, &h, Medium::Host);
    store_in(&mut r, "w2", 1, &h, Medium::Disk);
    (r, h, toks.len())
}

#[test]
fn a_device_hit_beats_host_beats_disk_beats_a_cold_start_as_load_shifts() {
    let (mut r, h, n) = tiered_fleet(Default::default());
    let route = |r: &mut KvRouter| {
        let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
        r.request_finished(&d.worker, d.prefill_tokens).unwrap();
        d
    };
    // Equal load: the device hit.
    let d = route(&mut r);
    assert_eq!(&*d.worker, "w0");
    assert_eq!(
        (d.matched_blocks, d.host_blocks, d.disk_blocks),
        (100, 0, 0)
    );
    // A small backlog on w0 is still cheaper than the host copy's load time.
    backlog(&mut r, "w0", 20);
    assert_eq!(&*route(&mut r).worker, "w0");
    // w0 has 2,000 tokens queued: loading 100 blocks from host (~2% of a recompute
    // each, ~34 token-equivalents) is far cheaper than waiting.
    backlog(&mut r, "w0", 2_000);
    let d = route(&mut r);
    assert_eq!(&*d.worker, "w1");
    assert_eq!(
        (d.matched_blocks, d.host_blocks, d.disk_blocks),
        (0, 100, 0)
    );
    assert_eq!(d.predicted_cached_tokens, 1_600);
    assert_eq!(d.prefill_tokens, 1);
    // (That route reserved the chain on w1's device.) w0 and w1 both busy: the disk copy (~21% of a recompute) beats waiting and beats
    // recomputing on idle w3.
    backlog(&mut r, "w0", 2_000);
    backlog(&mut r, "w1", 2_000);
    let d = route(&mut r);
    assert_eq!(&*d.worker, "w2");
    assert_eq!(d.disk_blocks, 100);
    // Everyone with a copy swamped: the cold start on w3.
    backlog(&mut r, "w2", 5_000);
    backlog(&mut r, "w0", 5_000);
    backlog(&mut r, "w1", 5_000);
    let d = route(&mut r);
    assert_eq!(&*d.worker, "w3");
    assert_eq!(d.predicted_cached_tokens, 0);
}

#[test]
fn dynamo_style_discounts_overprice_a_fast_host_tier() {
    use crate::policy::{TierCostConfig, TierScoring};
    // w0 (device) has 300 tokens queued (300 + 2 + 16 for the waiting sequence), w1
    // holds the prompt in host memory, idle. Priced by load time, the host copy costs
    // ~34 token-equivalents: w1. With a fixed 0.75 discount it costs 400 (0.9 × 401 =
    // 361 on the idle lane), so the router waits behind w0's queue.
    let (mut by_time, h, n) = tiered_fleet(TierCostConfig::default());
    backlog(&mut by_time, "w0", 300);
    assert_eq!(
        &*by_time
            .route(&h, n, PolicyKind::CacheAware, 0)
            .unwrap()
            .worker,
        "w1"
    );
    let (mut discounted, h, n) = tiered_fleet(TierCostConfig {
        scoring: TierScoring::Discount,
        ..TierCostConfig::default()
    });
    backlog(&mut discounted, "w0", 300);
    assert_eq!(
        &*discounted
            .route(&h, n, PolicyKind::CacheAware, 0)
            .unwrap()
            .worker,
        "w0"
    );
    // Tier-blind scoring treats w1's copy as a miss, but the decision still predicts
    // the tokens w1 will load rather than compute.
    let (mut blind, h, n) = tiered_fleet(TierCostConfig {
        scoring: TierScoring::DeviceOnly,
        ..TierCostConfig::default()
    });
    backlog(&mut blind, "w0", 5_000);
    backlog(&mut blind, "w2", 5_000);
    backlog(&mut blind, "w3", 100);
    let d = blind.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!(
        &*d.worker, "w1",
        "idle, and a miss like w3's but with no backlog"
    );
    assert_eq!(d.host_blocks, 100);
}

#[test]
fn a_reservation_on_top_of_a_host_copy_is_not_counted_twice() {
    let (mut r, h, n) = tiered_fleet(Default::default());
    backlog(&mut r, "w0", 2_000);
    // Route once to w1 (host copy) and keep the request in flight: its reservation
    // now covers the chain on w1's device.
    let first = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!(&*first.worker, "w1");
    let again = r.route(&h, n, PolicyKind::CacheAware, 1).unwrap();
    assert_eq!(&*again.worker, "w1");
    assert_eq!((again.matched_blocks, again.host_blocks), (100, 0));
    assert_eq!(again.predicted_cached_tokens, 1_600);
}

#[test]
fn tier_pricing_takes_the_kv_size_a_worker_reports() {
    let mut r = router(1);
    let before = r
        .config()
        .cache_aware
        .tiers
        .load_fraction(kvfleet_core::kv_events::Medium::Host);
    // SmolLM2-135M on the CPU: 737,280 bytes per 16-token block.
    r.set_kv_block_bytes("w0", 737_280, 16);
    let tiers = &r.config().cache_aware.tiers;
    assert_eq!(tiers.kv_bytes_per_token, 46_080.0);
    let after = tiers.load_fraction(kvfleet_core::kv_events::Medium::Host);
    assert!(
        (after / before - 46_080.0 / 131_072.0).abs() < 1e-9,
        "host load time scales with the model's KV bytes: {before} -> {after}"
    );
    // A worker that cannot copy blocks out reports 0: the pricing stays as it was.
    r.set_kv_block_bytes("w0", 0, 16);
    assert_eq!(r.config().cache_aware.tiers.kv_bytes_per_token, 46_080.0);
}

/// Two workers; w0 holds the whole 100-block prompt on its device; pulls of at least
/// `min_blocks` blocks (0: off).
fn pull_fleet(min_blocks: usize) -> (KvRouter, Vec<BlockHash>, usize) {
    pull_fleet_with(min_blocks, crate::policy::PullTrigger::Cost)
}

fn pull_fleet_with(
    min_blocks: usize,
    trigger: crate::policy::PullTrigger,
) -> (KvRouter, Vec<BlockHash>, usize) {
    let mut r = KvRouter::new(RouterConfig {
        cache_aware: CacheAwareConfig {
            tiers: crate::policy::TierCostConfig {
                peer_pull_min_blocks: min_blocks,
                ..Default::default()
            },
            pull_trigger: trigger,
            ..CacheAwareConfig::default()
        },
        ..RouterConfig::default()
    });
    for i in 0..2 {
        r.add_worker(&format!("w{i}"), BS).unwrap();
    }
    let toks = tokens(91, 100 * BS + 1);
    let h = hashes(&toks);
    store_in(&mut r, "w0", 1, &h, Medium::Device);
    (r, h, toks.len())
}

#[test]
fn a_swamped_holder_hands_its_prefix_to_an_idle_worker_by_pull() {
    // Without pulls, 1,000 queued tokens on the holder still beat a 1,617-token cold
    // start; with pulls, w1 computes one block's worth and pulls the other 100.
    let (mut off, h, n) = pull_fleet(0);
    backlog(&mut off, "w0", 1_000);
    let d = off.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!((&*d.worker, d.pull.as_ref()), ("w0", None));

    let (mut r, h, n) = pull_fleet(4);
    backlog(&mut r, "w0", 1_000);
    let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!(&*d.worker, "w1");
    let plan = d.pull.clone().expect("a pull from the holder");
    assert_eq!(
        (&*plan.from, plan.first_block, plan.end_block),
        ("w0", 0, 100)
    );
    assert_eq!(d.peer_blocks, 100);
    assert_eq!(d.predicted_cached_tokens, 1_600);
    assert_eq!(d.prefill_tokens, 1, "only the last token is computed");
    r.cancel_reservation(d.reservation.unwrap());
    r.request_finished(&d.worker, d.prefill_tokens).unwrap();

    // An idle holder keeps the request: a pull is cheap, never free.
    backlog(&mut r, "w0", 0);
    let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!((&*d.worker, d.pull.as_ref()), ("w0", None));
}

#[test]
fn the_idle_wait_trigger_pulls_only_past_a_cold_start() {
    // The default trigger: 1,000 queued tokens on the holder are under a 1,617-token
    // cold start on w1, so the request waits there; 1,800 are past it, and w1 pulls.
    // (w1 decodes 30 sequences, so by cost alone the request would stay on w0.)
    let (mut r, h, n) = pull_fleet_with(4, crate::policy::PullTrigger::default());
    decoding(&mut r, "w1", 30);
    backlog(&mut r, "w0", 1_000);
    let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!((&*d.worker, d.pull.as_ref()), ("w0", None));
    assert_eq!(d.reservation, None, "w0 already holds the whole chain");
    r.request_finished(&d.worker, d.prefill_tokens).unwrap();
    backlog(&mut r, "w0", 1_800);
    let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
    assert_eq!(&*d.worker, "w1");
    assert_eq!(d.spilled_from.as_deref(), Some("w0"));
    assert_eq!(d.peer_blocks, 100);
}

#[test]
fn any_policy_pulls_what_it_lacks_and_never_from_an_excluded_holder() {
    let (mut r, h, n) = pull_fleet(4);
    // Round-robin picks w0 then w1: the second pulls from w0.
    let first = r.route(&h, n, PolicyKind::RoundRobin, 0).unwrap();
    let second = r.route(&h, n, PolicyKind::RoundRobin, 0).unwrap();
    let (holder, other) = if &*first.worker == "w0" {
        (first, second)
    } else {
        (second, first)
    };
    assert!(holder.pull.is_none());
    assert_eq!(other.pull.as_ref().map(|p| &*p.from), Some("w0"));
    // A pull must save at least min_blocks: a 3-block prefix is recomputed, a
    // 5-block one pulled (w1 is pinned, as a shared placement would).
    let pinned = |blocks: usize| {
        let (mut r, h, _) = pull_fleet(4);
        r.route_excluding(
            &h[..blocks],
            blocks * BS + 1,
            Some(Pin {
                worker: "w1",
                holds_blocks: 0,
            }),
            PolicyKind::CacheAware,
            0,
            &[],
        )
        .unwrap()
    };
    let d = pinned(3);
    assert_eq!((&*d.worker, d.pull.as_ref()), ("w1", None));
    let d = pinned(5);
    assert_eq!(d.pull.map(|p| (p.first_block, p.end_block)), Some((0, 5)));
    // The holder failed this request already: nobody pulls from it.
    let (mut r, h, n) = pull_fleet(4);
    let d = r
        .route_excluding(&h, n, None, PolicyKind::CacheAware, 0, &["w0".to_string()])
        .unwrap();
    assert_eq!((&*d.worker, d.pull.as_ref()), ("w1", None));
}

#[test]
fn a_holder_whose_last_request_failed_is_no_pull_source_until_it_answers_again() {
    // w0 holds the prompt and is swamped, so w1 takes the request and pulls from it.
    let (mut r, h, n) = pull_fleet(4);
    backlog(&mut r, "w0", 1_000);
    let route = |r: &mut KvRouter| {
        let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
        if let Some(id) = d.reservation {
            r.cancel_reservation(id);
        }
        r.request_finished(&d.worker, d.prefill_tokens).unwrap();
        d
    };
    assert_eq!(route(&mut r).pull.map(|p| p.from), Some("w0".into()));
    // A failure may be a hang: a pull from it would wait out its start deadline. The
    // request is priced without the pull, and 1,000 queued tokens on w0 beat a cold
    // start on w1.
    r.set_pull_source("w0", false);
    let d = route(&mut r);
    assert_eq!(
        (&*d.worker, d.pull.as_ref(), d.peer_blocks),
        ("w0", None, 0)
    );
    r.set_pull_source("w0", true);
    assert_eq!(route(&mut r).pull.map(|p| p.from), Some("w0".into()));
}

#[test]
fn a_worker_with_no_kv_to_move_is_never_a_pull_source_or_target() {
    // Round-robin alternates w0, w1: w1 would pull w0's 100 blocks.
    let pulls_of = |r: &mut KvRouter, h: &[BlockHash], n: usize| {
        (0..2)
            .map(|_| {
                let d = r.route(h, n, PolicyKind::RoundRobin, 0).unwrap();
                (d.worker.to_string(), d.pull.map(|p| p.from.to_string()))
            })
            .collect::<Vec<_>>()
    };
    let (mut r, h, n) = pull_fleet(4);
    let mut seen = pulls_of(&mut r, &h, n);
    seen.sort();
    assert_eq!(
        seen,
        [("w0".into(), None), ("w1".into(), Some("w0".into()))]
    );
    // The holder is a simulated engine (0 KV bytes): w1 recomputes.
    let (mut r, h, n) = pull_fleet(4);
    r.set_kv_block_bytes("w0", 0, BS);
    assert!(pulls_of(&mut r, &h, n).iter().all(|(_, p)| p.is_none()));
    // The puller is one: it cannot import what w0 would send.
    let (mut r, h, n) = pull_fleet(4);
    r.set_kv_block_bytes("w0", 737_280, BS);
    r.set_kv_block_bytes("w1", 0, BS);
    assert!(pulls_of(&mut r, &h, n).iter().all(|(_, p)| p.is_none()));
}

#[test]
fn the_idle_wait_trigger_never_sends_a_request_to_pull_onto_a_worker_that_cannot() {
    // w0 holds 100 of 101 blocks behind 1,800 queued tokens: past a cold start, so the
    // idle w1 would take the request and pull. A simulated-engine w1 cannot import
    // blocks: the request stays on the holder instead of recomputing on w1 (which
    // decodes 30 sequences: by cost alone the request stays on w0).
    let route = |w1_bytes: u64, with_w2: bool| {
        let (mut r, h, n) = pull_fleet_with(4, crate::policy::PullTrigger::IdleWait);
        r.set_kv_block_bytes("w0", 737_280, BS);
        r.set_kv_block_bytes("w1", w1_bytes, BS);
        decoding(&mut r, "w1", 30);
        if with_w2 {
            r.add_worker("w2", BS).unwrap();
        }
        backlog(&mut r, "w0", 1_800);
        let d = r.route(&h, n, PolicyKind::CacheAware, 0).unwrap();
        let pulled_from = d.pull.as_ref().map(|p| p.from.to_string());
        (d.worker.to_string(), pulled_from, d.predicted_cached_tokens)
    };
    let w0 = Some("w0".to_string());
    assert_eq!(route(737_280, false), ("w1".into(), w0.clone(), 100 * BS));
    assert_eq!(route(0, false), ("w0".into(), None, 100 * BS));
    // An idle worker that can import takes the pull in w1's place.
    assert_eq!(route(0, true), ("w2".into(), w0, 100 * BS));
}

/// On a large fleet every worker reports an admission headroom of its own. Workers
/// whose loads are equal but for it cost one of two amounts for a prompt (they admit it
/// at once or not), so the ordered walk adds the two parts of their run, each by its
/// preferred member and ring neighbours, not a run per headroom: a handful of
/// candidates, not the fleet. It chooses what pricing every worker chooses, whether
/// most of the run admits the prompt or only a few dozen workers do (found by
/// headroom, not by scanning the run).
#[test]
fn equal_loads_with_every_headroom_are_walked_as_two_parts_not_a_run_each() {
    const WORKERS: usize = 1_024;
    let system = tokens(41, 8 * BS);
    // Headrooms spread over 0 to 1,023 blocks, or 0 to 34: a 33-block prompt waits
    // on a few dozen workers, or on all but 34.
    for spread in [1, 30] {
        let build = |full_scan: bool| {
            let mut r = router(WORKERS);
            r.set_full_scan(full_scan);
            for w in 0..WORKERS {
                let id = format!("w{w}");
                store_in(&mut r, &id, 1, &hashes(&system), Medium::Device);
                // Two decoding sequences each, one pool level.
                let load = WorkerLoad {
                    running: 2,
                    total_blocks: 4_096,
                    free_blocks: 4_000,
                    admit_blocks: Some((w * 389) % WORKERS / spread),
                    ..WorkerLoad::default()
                };
                r.update_load(&id, load).unwrap();
            }
            r
        };
        let (mut walk, mut scan) = (build(false), build(true));
        for session in 0..8 {
            let mut prompt = system.clone();
            prompt.extend(tokens(500 + session, 24 * BS));
            let h = hashes(&prompt);
            let a = walk
                .route(&h, prompt.len() + 1, PolicyKind::CacheAware, 0)
                .unwrap();
            let s = scan
                .route(&h, prompt.len() + 1, PolicyKind::CacheAware, 0)
                .unwrap();
            assert_eq!(a.worker, s.worker, "spread {spread}, session {session}");
            assert_eq!(scan.candidates.len(), WORKERS);
            // Both parts: the preferred member and the ring's nearest of each.
            assert!(
                walk.candidates.len() <= 2 * (1 + crate::policy::TIE_RING_REACH),
                "spread {spread}, session {session}: {} candidates",
                walk.candidates.len()
            );
            // The chosen worker's reported headroom holds the prompt.
            let w: usize = a.worker[1..].parse().unwrap();
            assert!((w * 389) % WORKERS / spread >= 33, "{}", a.worker);
            for (r, d) in [(&mut walk, &a), (&mut scan, &s)] {
                if let Some(id) = d.reservation {
                    r.cancel_reservation(id);
                }
                if let Some(id) = d.running {
                    r.request_done(id);
                }
                r.request_finished(&d.worker, d.prefill_tokens).unwrap();
            }
        }
    }
}

mod ordered_walk {
    //! `cache-aware` walking the load order chooses exactly what pricing every worker
    //! chooses.

    use super::*;
    use crate::policy::TierCostConfig;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    struct Fleet {
        workers: usize,
        /// Of every this many workers, one lacks the system prompt (0: all hold it).
        without_system_every: usize,
        /// Workers holding each body: (body, first worker, count).
        bodies: Vec<(u64, usize, usize)>,
        /// Every this many workers (from 1) holds body 0 in its host tier (0: none).
        host_every: usize,
        /// Per-worker load seeds: running, waiting, backlog, sixteenths of the pool in
        /// use.
        loads: Vec<(u8, u8, u16, u8)>,
        /// Every prefill lane busy (no idle lane to fall back on).
        all_busy: bool,
        /// Every worker reports the first worker's load (long runs of ties).
        uniform: bool,
        near_tie_tokens: f64,
        near_tie_ratio: f64,
        cap: Option<usize>,
        balance_slack: f64,
        decode_cost: f64,
        memory_weight: f64,
        pulls: bool,
        /// Requests: (body, body blocks kept, tail id, load change seed).
        requests: Vec<(u64, usize, u64, u16)>,
    }

    fn fleet() -> impl Strategy<Value = Fleet> {
        (1usize..300).prop_flat_map(|workers| {
            (
                Just(workers),
                prop_oneof![Just(0usize), 2usize..6, Just(1)],
                prop::collection::vec((0u64..4, 0..workers, 1usize..4), 0..6),
                prop_oneof![Just(0usize), 3usize..9],
                prop::collection::vec((0u8..9, 0u8..3, 0u16..6, 0u8..17), workers),
                (
                    prop_oneof![Just(0.0), Just(300.0)],
                    prop_oneof![Just(0.0), Just(0.05)],
                    prop_oneof![Just(None), Just(Some(3_000usize))],
                    prop_oneof![Just(16.0), Just(0.0), Just(2.0)],
                    prop_oneof![Just(16.0), Just(0.0)],
                    any::<bool>(),
                    any::<bool>(),
                    any::<bool>(),
                    prop_oneof![Just(0.25), Just(0.0), Just(3.0)],
                ),
                prop::collection::vec((0u64..5, 0usize..12, 0u64..1_000, any::<u16>()), 1..25),
            )
                .prop_map(
                    |(workers, without, bodies, host_every, loads, knobs, requests)| Fleet {
                        workers,
                        without_system_every: without,
                        bodies,
                        host_every,
                        loads,
                        all_busy: knobs.6,
                        uniform: knobs.7,
                        near_tie_tokens: knobs.0,
                        near_tie_ratio: knobs.1,
                        cap: knobs.2,
                        balance_slack: knobs.3,
                        decode_cost: knobs.4,
                        memory_weight: knobs.8,
                        pulls: knobs.5,
                        requests,
                    },
                )
        })
    }

    const SYSTEM: usize = 8;
    const BODY: usize = 12;

    fn system() -> Vec<u32> {
        tokens(9_000, SYSTEM * BS)
    }

    fn body(b: u64, blocks: usize) -> Vec<u32> {
        let mut t = system();
        t.extend(tokens(9_100 + b, blocks * BS));
        t
    }

    fn build(f: &Fleet, full_scan: bool) -> KvRouter {
        let mut r = KvRouter::new(RouterConfig {
            cache_aware: CacheAwareConfig {
                near_tie_tokens: f.near_tie_tokens,
                near_tie_ratio: f.near_tie_ratio,
                max_prefill_backlog_tokens: f.cap,
                balance_slack: f.balance_slack,
                decode_cost_per_sequence: f.decode_cost,
                memory_weight: f.memory_weight,
                tiers: TierCostConfig {
                    peer_pull_min_blocks: usize::from(f.pulls) * 2,
                    ..TierCostConfig::default()
                },
                ..CacheAwareConfig::default()
            },
            ..RouterConfig::default()
        });
        r.set_full_scan(full_scan);
        let sys = hashes(&system());
        let mut seq = vec![0u64; f.workers];
        let mut store = |r: &mut KvRouter, w: usize, h: &[BlockHash], m: Medium| {
            seq[w] += 1;
            store_in(r, &format!("w{w}"), seq[w], h, m);
        };
        for w in 0..f.workers {
            r.add_worker(&format!("w{w}"), BS).unwrap();
            // With pulls on, every third worker cannot import KV (a simulated
            // engine): never a pull's target, whatever it costs.
            if f.pulls && w % 3 == 1 {
                r.set_kv_block_bytes(&format!("w{w}"), 0, BS);
            }
            if f.without_system_every == 0 || w % f.without_system_every != 0 {
                store(&mut r, w, &sys, Medium::Device);
            }
            if f.host_every > 0 && w % f.host_every == 1 {
                store(&mut r, w, &hashes(&body(0, BODY)), Medium::Host);
            }
            let (running, waiting, queued, usage) = f.loads[if f.uniform { 0 } else { w }];
            r.update_load(
                &format!("w{w}"),
                WorkerLoad {
                    running: running as usize,
                    waiting: waiting as usize,
                    queued_prefill_tokens: if f.all_busy {
                        (queued as usize + 1) * 256
                    } else {
                        queued as usize * 256 * usize::from(waiting > 0)
                    },
                    total_blocks: 64,
                    free_blocks: 64 - 4 * usize::from(usage),
                    // Headroom for 0 to 63 blocks, or unsaid: prompts of 9 to 21
                    // blocks are admitted at once on some workers and not on others.
                    admit_blocks: (w % 4 != 3)
                        .then(|| (64 - 4 * usize::from(usage)).saturating_sub(w * 5 % 48)),
                    ..WorkerLoad::default()
                },
            )
            .unwrap();
        }
        for &(b, first, count) in &f.bodies {
            for w in (first..first + count).filter(|w| *w < f.workers) {
                store(&mut r, w, &hashes(&body(b, BODY)), Medium::Device);
            }
        }
        r
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn the_ordered_walk_chooses_what_the_full_scan_chooses(f in fleet()) {
            let mut walk = build(&f, false);
            let mut scan = build(&f, true);
            for (i, &(b, keep, tail, change)) in f.requests.iter().enumerate() {
                let mut t = body(b, keep.min(BODY));
                t.extend(tokens(tail, 1 + (tail as usize % 40)));
                let h = hashes(&t);
                let now = i as u64;
                let a = walk.route(&h, t.len(), PolicyKind::CacheAware, now).unwrap();
                let s = scan.route(&h, t.len(), PolicyKind::CacheAware, now).unwrap();
                prop_assert_eq!(&a.worker, &s.worker, "request {}", i);
                prop_assert_eq!(&a.spilled_from, &s.spilled_from);
                prop_assert_eq!(
                    (a.matched_blocks, a.host_blocks, a.peer_blocks, a.prefill_tokens),
                    (s.matched_blocks, s.host_blocks, s.peer_blocks, s.prefill_tokens)
                );
                // Loads move between requests: one worker finishes one, another
                // reports a new backlog.
                let w = format!("w{}", change as usize % f.workers);
                if change % 3 == 0 {
                    for (r, d) in [(&mut walk, &a), (&mut scan, &s)] {
                        r.request_finished(&d.worker, d.prefill_tokens).unwrap();
                        // Its blocks no longer count as running there.
                        if let Some(id) = d.running {
                            r.request_done(id);
                        }
                    }
                } else if change % 3 == 1 {
                    for r in [&mut walk, &mut scan] {
                        backlog(r, &w, (change as usize % 7) * 512);
                    }
                } else {
                    // Its running sequences leave room for fewer blocks.
                    let load = WorkerLoad {
                        running: 1 + change as usize % 5,
                        admit_blocks: Some(change as usize % 32),
                        ..WorkerLoad::default()
                    };
                    for r in [&mut walk, &mut scan] {
                        r.update_load(&w, load).unwrap();
                    }
                }
            }
        }
    }
}

/// A worker whose running sequences leave too little admission headroom for a prompt
/// would queue it until they end, however idle its prefill lane: `cache-aware` sends a
/// cold prompt to a lane that starts it at once. A worker that says nothing of its
/// headroom, or runs nothing (a lone sequence is always admitted), is priced as before.
#[test]
fn a_prompt_goes_where_the_admission_headroom_holds_it() {
    let toks = tokens(11, 20 * BS);
    let h = hashes(&toks);
    let decoding = |running: usize, admit_blocks: Option<usize>| WorkerLoad {
        running,
        total_blocks: 64,
        free_blocks: 40,
        admit_blocks,
        ..WorkerLoad::default()
    };
    for (w0_admits, expect) in [
        (None, "w0"),
        (Some(21), "w0"),
        (Some(20), "w1"),
        (Some(5), "w1"),
    ] {
        let mut r = router(2);
        // w0 decodes 3 sequences, w1 4: on sequences alone w0 is cheaper.
        r.update_load("w0", decoding(3, w0_admits)).unwrap();
        r.update_load("w1", decoding(4, Some(64))).unwrap();
        // The prompt and its one partial block: 21 blocks.
        let d = r
            .route(&h, toks.len() + 1, PolicyKind::CacheAware, 0)
            .unwrap();
        assert_eq!(&*d.worker, expect, "w0's headroom {w0_admits:?}");
    }
    // Running nothing, w0 admits whatever its reported headroom.
    let mut r = router(2);
    r.update_load("w0", decoding(0, Some(0))).unwrap();
    r.update_load("w1", decoding(1, Some(64))).unwrap();
    let d = r
        .route(&h, toks.len() + 1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*d.worker, "w0");
}

/// An idle lane's free pool need not hold the prompt blocks its running sequences
/// hold: a system prompt shared with a request this router sent there that has not
/// ended. Such a lane starts the prompt at once rather than the prompt queueing behind
/// its busy holder; once that request ends, or while prefills are queued there (they
/// take the free blocks first), the whole prompt must fit again.
#[test]
fn blocks_the_running_sequences_hold_need_no_room_on_an_idle_lane() {
    // A 4-block system prompt; the session's prompt adds 12 blocks: 17 blocks with
    // its partial one.
    let system = tokens(31, 4 * BS);
    let with = |id: u64, blocks: usize| {
        let mut t = system.clone();
        t.extend(tokens(id, blocks * BS));
        t
    };
    let (other, prompt) = (with(32, 8), with(33, 12));
    let (oh, ph) = (hashes(&other), hashes(&prompt));
    let load = |queued: usize, running: usize, admit: usize| WorkerLoad {
        queued_prefill_tokens: queued,
        running,
        total_blocks: 64,
        free_blocks: 40,
        admit_blocks: Some(admit),
        ..WorkerLoad::default()
    };
    for (case, end_it, w1_queued, expect) in [
        ("running the system prompt", false, 0, "w1"),
        ("its request ended", true, 0, "w0"),
        ("prefills queued", false, 8, "w0"),
    ] {
        let mut r = router(2);
        // w0 holds 14 of the prompt's 16 blocks (its session's last turn) and has
        // 1,330 tokens of prefill queued: it costs 2 × 33 + 1,330 + 2 × 16 = 1,428.
        // Idle and admitting, w1 costs 0.9 × 193 + 16 = 190 (its start ends the wait
        // on w0). Unable to admit, it costs 2 × 193 + 128 (half the prompt's wait) +
        // 6 × 160 (the blocks w0 holds, computed again on a busy lane) + 16 = 1,490,
        // and with 8 tokens queued 1,498 (1,370 were its running blocks counted).
        r.apply_event("w0", &RouterKvEvent::stored(1, None, ph[..14].to_vec()))
            .unwrap();
        r.update_load("w0", load(1_330, 2, 64)).unwrap();
        // w1 runs another session sharing the system prompt, sent by this router.
        let d = r
            .route_pinned(&oh, other.len() + 1, Some("w1"), PolicyKind::CacheAware, 0)
            .unwrap();
        assert_eq!(&*d.worker, "w1");
        r.apply_event("w1", &RouterKvEvent::stored(1, None, oh.clone()))
            .unwrap();
        r.prefill_finished("w1", d.prefill_tokens, d.load_reports)
            .unwrap();
        if end_it {
            r.request_finished("w1", 0).unwrap();
            r.request_done(d.running.unwrap());
        }
        // Room for 13 blocks: the prompt's 17 less the 4 its running sequence holds.
        r.update_load("w1", load(w1_queued, 1, 13)).unwrap();
        let got = r
            .route(&ph, prompt.len() + 1, PolicyKind::CacheAware, 1)
            .unwrap();
        assert_eq!(&*got.worker, expect, "{case}");
    }
}

/// The prompts a router sent a worker since its last poll take their blocks from the
/// reported headroom until the next poll: two cold prompts arriving within a poll do
/// not both go to the one worker that had room for one of them.
#[test]
fn prompts_sent_since_the_last_poll_use_up_the_headroom() {
    let decoding = |running: usize, admit: usize| WorkerLoad {
        running,
        total_blocks: 64,
        free_blocks: 40,
        admit_blocks: Some(admit),
        ..WorkerLoad::default()
    };
    let mut r = router(2);
    r.update_load("w0", decoding(1, 30)).unwrap();
    r.update_load("w1", decoding(3, 64)).unwrap();
    // Two different cold prompts of 21 blocks each.
    let a = tokens(21, 20 * BS);
    let b = tokens(22, 20 * BS);
    let first = r
        .route(&hashes(&a), a.len() + 1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*first.worker, "w0", "fewer sequences, room for 30 blocks");
    // Its first token comes before the next poll: w0's lane is idle again, and the
    // prompt decodes there.
    r.prefill_finished("w0", first.prefill_tokens, first.load_reports)
        .unwrap();
    let second = r
        .route(&hashes(&b), b.len() + 1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*second.worker, "w1", "w0 has 9 blocks of room left");
    // Its next poll counts the first prompt; the headroom it reports is what holds.
    r.update_load("w0", decoding(2, 30)).unwrap();
    let c = tokens(23, 20 * BS);
    let third = r
        .route(&hashes(&c), c.len() + 1, PolicyKind::CacheAware, 0)
        .unwrap();
    assert_eq!(&*third.worker, "w0");
}

/// A prefix held only by a worker this request cannot use (fenced, or excluded by a
/// retry) is no longer "held elsewhere": recomputing it on a busy lane is not a
/// duplicate, so that lane pays no duplicate price for it.
#[test]
fn an_unusable_holder_does_not_make_a_recompute_a_duplicate() {
    let toks = tokens(7, 100 * BS);
    let h = hashes(&toks);
    let n = toks.len() + 1;
    for unusable in ["fenced", "excluded"] {
        let mut r = router(3);
        // w0 holds 80 blocks, w1 64 with a short queue, w2 nothing and is idle.
        r.apply_event("w0", &RouterKvEvent::stored(1, None, h[..80].to_vec()))
            .unwrap();
        r.apply_event("w1", &RouterKvEvent::stored(1, None, h[..64].to_vec()))
            .unwrap();
        let busy = WorkerLoad {
            queued_prefill_tokens: 100,
            running: 1,
            ..WorkerLoad::default()
        };
        r.update_load("w0", busy).unwrap();
        r.update_load("w1", busy).unwrap();
        let mut exclude = Vec::new();
        if unusable == "fenced" {
            r.set_fenced("w0", true);
        } else {
            exclude.push("w0".to_string());
        }
        // w1 finishes sooner (100 queued + 577 to compute, against 1,601 on w2) and
        // computes less: it wins (100 + 2 × 577 + 16 = 1,270 against 1.5 × 1,601)
        // unless w0's 80 blocks count as held elsewhere (6 × 256 more).
        let d = r
            .route_excluding(&h, n, None, PolicyKind::CacheAware, 0, &exclude)
            .unwrap();
        assert_eq!(&*d.worker, "w1", "{unusable}");
    }
}
