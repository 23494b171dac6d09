//! End-to-end engine behaviour on the seeded `tiny` model: prefix-cache hits give the
//! same logits as cold runs, concurrent identical prefixes are computed once, forks
//! match solo runs, and preemption loses nothing.

use kvfleet_engine::{
    CpuBackend, DecodeReserveConfig, DumpedBlock, Engine, EngineConfig, FinishReason, ForkChild,
    ForkRequest, KvEventKind, LlamaModel, Medium, ModelConfig, RecordingSink, Request,
    SamplingParams,
};
mod support;

use std::sync::Arc;
use support::prompt;

const BS: usize = 16;

fn model() -> Arc<LlamaModel> {
    Arc::new(LlamaModel::seeded(ModelConfig::tiny(), 7).expect("seeded model"))
}

fn engine_with(
    model: &Arc<LlamaModel>,
    num_blocks: usize,
    budget: usize,
    max_seqs: usize,
) -> Engine {
    engine_chunked(model, num_blocks, budget, max_seqs, budget)
}

fn engine_chunked(
    model: &Arc<LlamaModel>,
    num_blocks: usize,
    budget: usize,
    max_seqs: usize,
    chunk: usize,
) -> Engine {
    engine_reserving(
        model,
        num_blocks,
        budget,
        max_seqs,
        chunk,
        DecodeReserveConfig::default(),
    )
}

fn engine_reserving(
    model: &Arc<LlamaModel>,
    num_blocks: usize,
    budget: usize,
    max_seqs: usize,
    chunk: usize,
    decode_reserve: DecodeReserveConfig,
) -> Engine {
    let backend = CpuBackend::new(model.clone(), num_blocks, BS);
    Engine::new(
        EngineConfig {
            model_id: "tiny".into(),
            block_size: BS,
            max_num_seqs: max_seqs,
            max_batched_tokens: budget,
            max_prefill_chunk: chunk,
            decode_reserve,
        },
        Box::new(backend),
        None,
    )
    .expect("engine")
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

/// Runs one request and returns (logits of its first sampled token, cached tokens).
fn first_logits(engine: &mut Engine, id: u64, tokens: &[u32]) -> (Vec<f32>, usize) {
    engine.set_logits_capture(true);
    engine
        .add_request(Request::new(id, tokens.to_vec(), greedy(1)))
        .expect("add");
    let mut found = None;
    while engine.has_unfinished() {
        for o in engine.step().expect("step") {
            if o.id != id {
                continue;
            }
            if let Some(logits) = o.logits {
                found = Some((logits, o.cached_tokens));
            }
        }
    }
    found.expect("logits")
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn prefix_cache_hits_give_the_cold_logits() {
    let m = model();
    // 8 full blocks + a partial one.
    let p = prompt(1, 8 * BS + 5);
    let (cold, cached_cold) = first_logits(&mut engine_with(&m, 64, 4096, 8), 1, &p);
    assert_eq!(cached_cold, 0);

    // Hits of one block, of many blocks, and of all but the last block.
    for hit_blocks in [1usize, 5, 8] {
        let mut e = engine_with(&m, 64, 4096, 8);
        let (_, c) = first_logits(&mut e, 1, &p[..hit_blocks * BS + 1]);
        assert_eq!(c, 0);
        let (warm, cached) = first_logits(&mut e, 2, &p);
        assert_eq!(cached, hit_blocks * BS, "hit of {hit_blocks} blocks");
        let d = max_abs_diff(&cold, &warm);
        assert!(
            d <= 1e-5,
            "hit of {hit_blocks} blocks: logits differ by {d}"
        );
    }

    // A prompt that is an exact multiple of the block size: everything but the last
    // block is reused and the last token is still computed.
    let q = prompt(2, 6 * BS);
    let (cold_q, _) = first_logits(&mut engine_with(&m, 64, 4096, 8), 1, &q);
    let mut e = engine_with(&m, 64, 4096, 8);
    first_logits(&mut e, 1, &q);
    let (warm_q, cached) = first_logits(&mut e, 2, &q);
    assert_eq!(cached, 5 * BS);
    assert!(max_abs_diff(&cold_q, &warm_q) <= 1e-5);
    e.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_gives_the_unchunked_logits() {
    let m = model();
    let p = prompt(3, 10 * BS + 3);
    let (whole, _) = first_logits(&mut engine_with(&m, 64, 4096, 8), 1, &p);
    let (chunked, _) = first_logits(&mut engine_with(&m, 64, 23, 8), 1, &p);
    assert!(max_abs_diff(&whole, &chunked) <= 1e-5);
}

#[test]
fn concurrent_identical_prefixes_are_computed_once() {
    let m = model();
    // A small per-sequence chunk makes the prefix take many steps while the siblings,
    // admitted in the same steps, find its blocks still in flight.
    let mut e = engine_chunked(&m, 256, 4096, 16, 32);
    let prefix = prompt(4, 20 * BS);
    let n = 5;
    for i in 0..n {
        let mut p = prefix.clone();
        p.extend(prompt(100 + i, 9));
        e.add_request(Request::new(i as u64 + 1, p, greedy(4)))
            .unwrap();
    }
    // The backlog a router reads counts the shared prefix once, as it will be
    // computed: one prefix plus five tails, before the first step and after each.
    let unique = prefix.len() + 5 * 9;
    assert_eq!(e.load().queued_prefill_tokens, unique);
    for _ in 0..3 {
        e.step().unwrap();
        let computed = e.stats().prompt_tokens_computed as usize;
        assert_eq!(e.load().queued_prefill_tokens, unique - computed);
    }
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), n as usize);
    let computed = e.stats().prompt_tokens_computed as usize;
    // One prefix plus five tails of 9 tokens: nothing computed twice.
    assert_eq!(
        computed,
        prefix.len() + 5 * 9,
        "prompt tokens computed across the batch"
    );
    let mut cached: Vec<usize> = done.iter().map(|c| c.cached_tokens).collect();
    cached.sort();
    assert_eq!(cached, vec![0, 320, 320, 320, 320]);

    // And each answer equals that request run alone.
    for c in &done {
        let mut p = prefix.clone();
        p.extend(prompt(100 + (c.id as u32 - 1), 9));
        let mut solo = engine_with(&m, 256, 4096, 16);
        solo.add_request(Request::new(1, p, greedy(4))).unwrap();
        let s = solo.run_to_completion().unwrap();
        assert_eq!(s[0].tokens, c.tokens, "request {}", c.id);
    }
    e.check_invariants().unwrap();
}

#[test]
fn fork_children_equal_solo_runs_and_share_the_prefix() {
    let m = model();
    let prefix = prompt(5, 7 * BS + 9); // ends in a partial block: copy-on-write
    let children: Vec<ForkChild> = (0..4)
        .map(|i| ForkChild {
            id: 10 + i,
            suffix: prompt(200 + i as u32, 11 + i as usize),
            params: greedy(6),
        })
        .collect();
    let mut e = engine_with(&m, 128, 4096, 16);
    e.add_fork(ForkRequest {
        id: 1,
        prefix: prefix.clone(),
        cache_salt: String::new(),
        children: children.clone(),
    })
    .unwrap();
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), 5);
    assert_eq!(done[0].finish, FinishReason::Prefilled);
    let suffix_total: usize = children.iter().map(|c| c.suffix.len()).sum();
    assert_eq!(
        e.stats().prompt_tokens_computed as usize,
        prefix.len() + suffix_total,
        "the prefix is computed once for all children"
    );
    for (c, child) in done[1..].iter().zip(&children) {
        assert_eq!(c.id, child.id);
        assert_eq!(c.cached_tokens, prefix.len());
        let mut p = prefix.clone();
        p.extend(&child.suffix);
        let mut solo = engine_with(&m, 128, 4096, 16);
        solo.add_request(Request::new(1, p, greedy(6))).unwrap();
        assert_eq!(
            solo.run_to_completion().unwrap()[0].tokens,
            c.tokens,
            "child {}",
            c.id
        );
    }
    e.check_invariants().unwrap();
}

/// Six prompts of 40 to 105 tokens; with 40 generated tokens each needs 5 to 10 blocks.
fn six_growing_requests() -> Vec<Vec<u32>> {
    (0..6)
        .map(|i| prompt(300 + i, 40 + 13 * i as usize))
        .collect()
}

#[test]
fn preemption_finishes_every_request_with_unconstrained_output() {
    let m = model();
    let reqs = six_growing_requests();
    // Admitting on prompt room alone (no decode reserve) is what forces preemptions.
    let run = |num_blocks: usize| {
        let mut e = engine_reserving(&m, num_blocks, 64, 6, 64, DecodeReserveConfig::off());
        for (i, p) in reqs.iter().enumerate() {
            e.add_request(Request::new(i as u64, p.clone(), greedy(40)))
                .unwrap();
        }
        let done = e.run_to_completion().unwrap();
        e.check_invariants().unwrap();
        (done, e.stats().preemptions)
    };
    let (free_run, p0) = run(512);
    assert_eq!(p0, 0);
    // Each request needs up to 10 blocks; 14 cannot hold six at once.
    let (tight, preemptions) = run(14);
    assert!(preemptions > 0, "the small pool must force preemption");
    assert_eq!(tight.len(), reqs.len());
    for (a, b) in free_run.iter().zip(&tight) {
        assert_eq!(a.id, b.id);
        assert_eq!(
            a.tokens, b.tokens,
            "request {} changed under preemption",
            a.id
        );
        assert_eq!(b.tokens.len(), 40);
        assert_eq!(b.finish, FinishReason::Length);
    }
}

#[test]
fn admissions_leave_room_for_what_running_requests_will_generate() {
    // The pool and requests of the test above. Admitted on prompt room alone, the
    // running requests preempt each other as they grow, and each preempted one is
    // computed again. Reserving their whole max_tokens, a request waits until the
    // running ones leave room for its length: nothing is preempted and every prompt
    // is computed once. The default reserve (a share of max_tokens) preempts less
    // than none. The tokens are those of an unhurried run every time.
    let m = model();
    let reqs = six_growing_requests();
    let run = |num_blocks: usize, reserve: DecodeReserveConfig| {
        let mut e = engine_reserving(&m, num_blocks, 64, 6, 64, reserve);
        for (i, p) in reqs.iter().enumerate() {
            e.add_request(Request::new(i as u64, p.clone(), greedy(40)))
                .expect("add");
        }
        let done = e.run_to_completion().expect("run");
        e.check_invariants().expect("invariants");
        (
            done,
            e.stats().preemptions,
            e.stats().prompt_tokens_computed,
        )
    };
    let prompts: u64 = reqs.iter().map(|p| p.len() as u64).sum();
    let whole = DecodeReserveConfig {
        init_ratio: 1.0,
        min_ratio: 1.0,
        ..DecodeReserveConfig::default()
    };
    let (free_run, _, _) = run(512, DecodeReserveConfig::off());
    let (off, preempted_off, computed_off) = run(14, DecodeReserveConfig::off());
    assert!(
        preempted_off > 0 && computed_off > prompts,
        "{preempted_off} preemptions, {computed_off} prompt tokens computed"
    );
    let (reserved, preempted, computed) = run(14, whole);
    assert_eq!(
        preempted, 0,
        "the whole max_tokens reserved: nothing preempted"
    );
    assert_eq!(computed, prompts, "every prompt computed once");
    let (default, preempted_default, _) = run(14, DecodeReserveConfig::default());
    assert!(
        preempted_default < preempted_off,
        "{preempted_default} preemptions with the default reserve, {preempted_off} without"
    );
    for done in [&off, &reserved, &default] {
        assert_eq!(done.len(), reqs.len());
        for (a, b) in free_run.iter().zip(done) {
            assert_eq!((a.id, &a.tokens), (b.id, &b.tokens));
        }
    }
}

#[test]
fn a_lone_request_is_admitted_whatever_it_may_generate() {
    // 20 blocks hold 320 tokens; max_tokens allows far more. The reserve never keeps
    // a request waiting for room nobody is using: it runs until the pool is full.
    let m = model();
    let mut e = engine_with(&m, 20, 256, 4);
    e.add_request(Request::new(1, prompt(5, 30), greedy(3000)))
        .expect("add");
    let outs = step_until_done(&mut e, 2000);
    assert!(!e.has_unfinished());
    let generated = outs.iter().filter(|o| o.token.is_some()).count();
    assert!(generated > 200, "it ran ({generated} tokens)");
}

#[test]
fn kv_events_describe_the_cache() {
    let m = model();
    let sink = RecordingSink::new();
    let mut e = engine_with(&m, 8, 4096, 4);
    e.set_event_sink(Arc::new(sink.clone()));
    let p = prompt(6, 3 * BS + 2);
    e.add_request(Request::new(1, p.clone(), greedy(1)))
        .unwrap();
    e.run_to_completion().unwrap();
    let ev = sink.events();
    let seqs: Vec<u64> = ev.iter().map(|x| x.seq).collect();
    assert_eq!(
        seqs,
        (1..=ev.len() as u64).collect::<Vec<_>>(),
        "gap-free sequence numbers"
    );
    let hashes = kvfleet_core::hash_blocks(e.namespace_seed(""), &p, BS);
    assert_eq!(
        ev[0].kind,
        KvEventKind::Stored {
            parent_hash: None,
            block_hashes: hashes.clone(),
            medium: Medium::Device,
        }
    );
    let dump: Vec<_> = {
        let mut d = e.cache_dump();
        d.sort();
        d
    };
    let mut want = vec![
        DumpedBlock::device(hashes[0], None),
        DumpedBlock::device(hashes[1], Some(hashes[0])),
        DumpedBlock::device(hashes[2], Some(hashes[1])),
    ];
    want.sort();
    assert_eq!(dump, want);
    // Another prompt needing all 8 blocks evicts the cached ones.
    e.add_request(Request::new(2, prompt(7, 7 * BS + 3), greedy(1)))
        .unwrap();
    e.run_to_completion().unwrap();
    let removed: Vec<_> = sink
        .events()
        .into_iter()
        .filter_map(|x| match x.kind {
            KvEventKind::Removed { block_hashes, .. } => Some(block_hashes),
            _ => None,
        })
        .flatten()
        .collect();
    for h in &hashes {
        assert!(removed.contains(h), "evicted block {h} reported");
    }
    e.clear_cache();
    assert_eq!(
        sink.events().last().map(|x| x.kind.clone()),
        Some(KvEventKind::Cleared)
    );
    assert!(e.cache_dump().is_empty());
}

#[test]
fn tenants_with_different_salts_share_nothing() {
    let m = model();
    let mut e = engine_with(&m, 64, 4096, 4);
    let p = prompt(8, 4 * BS + 1);
    let mut a = Request::new(1, p.clone(), greedy(1));
    a.cache_salt = "tenant-a".into();
    e.add_request(a).unwrap();
    e.run_to_completion().unwrap();
    let mut b = Request::new(2, p.clone(), greedy(1));
    b.cache_salt = "tenant-b".into();
    e.add_request(b).unwrap();
    assert_eq!(e.run_to_completion().unwrap()[0].cached_tokens, 0);
    let mut a2 = Request::new(3, p, greedy(1));
    a2.cache_salt = "tenant-a".into();
    e.add_request(a2).unwrap();
    assert_eq!(e.run_to_completion().unwrap()[0].cached_tokens, 4 * BS);
}

#[test]
fn uncacheable_tail_never_enters_the_cache() {
    let m = model();
    let mut e = engine_with(&m, 64, 4096, 4);
    let p = prompt(9, 6 * BS);
    let mut r = Request::new(1, p.clone(), greedy(1));
    r.cacheable_len = Some(2 * BS + 3);
    e.add_request(r).unwrap();
    e.run_to_completion().unwrap();
    assert_eq!(
        e.cache_dump().len(),
        2,
        "only blocks wholly before the tail are cached"
    );
    e.add_request(Request::new(2, p, greedy(1))).unwrap();
    assert_eq!(e.run_to_completion().unwrap()[0].cached_tokens, 2 * BS);
}

#[test]
fn bad_requests_are_refused_with_reasons() {
    let m = model();
    let mut e = engine_with(&m, 8, 4096, 4);
    let err = |r: kvfleet_engine::Result<()>| r.unwrap_err().to_string();
    assert!(err(e.add_request(Request::new(1, vec![], greedy(1)))).contains("empty"));
    assert!(err(e.add_request(Request::new(1, vec![9999], greedy(1)))).contains("vocabulary"));
    assert!(
        err(e.add_request(Request::new(1, prompt(1, 9 * BS), greedy(1)))).contains("KV blocks")
    );
    let ctx = ModelConfig::tiny().max_position_embeddings;
    let mut big = engine_with(&m, ctx / BS + 8, 4096, 4);
    assert!(
        err(big.add_request(Request::new(1, prompt(1, ctx), greedy(1)))).contains("context length")
    );
    assert!(err(e.add_request(Request::new(1, prompt(1, 4), greedy(0)))).contains("max_tokens"));
    e.add_request(Request::new(1, prompt(1, 4), greedy(2)))
        .unwrap();
    assert!(err(e.add_request(Request::new(1, prompt(1, 4), greedy(2)))).contains("already in use"));
    assert!(e.abort(1));
    assert!(!e.has_unfinished());
}

#[test]
fn stop_tokens_and_max_tokens_end_generation() {
    let m = model();
    let p = prompt(10, 20);
    let mut e = engine_with(&m, 16, 4096, 4);
    e.add_request(Request::new(1, p.clone(), greedy(8)))
        .unwrap();
    let free = e.run_to_completion().unwrap().remove(0);
    assert_eq!(free.tokens.len(), 8);
    assert_eq!(free.finish, FinishReason::Length);
    // Stopping on the third generated token returns the two before it.
    let mut params = greedy(8);
    params.stop_token_ids = vec![free.tokens[2]];
    e.add_request(Request::new(2, p, params)).unwrap();
    let stopped = e.run_to_completion().unwrap().remove(0);
    let first = free
        .tokens
        .iter()
        .position(|t| *t == free.tokens[2])
        .unwrap();
    assert_eq!(stopped.tokens, free.tokens[..first].to_vec());
    assert_eq!(stopped.finish, FinishReason::Stop);
}

/// Steps `e` until nothing is unfinished or `max_steps` pass; returns every output.
fn step_until_done(e: &mut Engine, max_steps: usize) -> Vec<kvfleet_engine::StepOutput> {
    let mut outs = Vec::new();
    for _ in 0..max_steps {
        if !e.has_unfinished() {
            break;
        }
        outs.extend(e.step().unwrap());
    }
    outs
}

#[test]
fn a_request_that_outgrows_the_whole_pool_finishes_with_length() {
    // 40 blocks of 16 hold 640 tokens; the request asks for far more. Once it holds the
    // whole pool it can never grow: it must end (Length), not preempt and re-admit
    // itself forever.
    let m = model();
    let mut e = engine_with(&m, 40, 256, 4);
    let p = prompt(77, 20);
    e.add_request(Request::new(1, p.clone(), greedy(3000)))
        .unwrap();
    let outs = step_until_done(&mut e, 5000);
    assert!(
        !e.has_unfinished(),
        "the request never finished ({} preemptions so far)",
        e.stats().preemptions
    );
    let finish: Vec<_> = outs.iter().filter_map(|o| o.finish).collect();
    assert_eq!(finish, vec![FinishReason::Length]);
    let generated = outs.iter().filter(|o| o.token.is_some()).count();
    assert!(
        generated > 0 && p.len() + generated <= 40 * BS,
        "generated {generated} tokens"
    );
    e.check_invariants().unwrap();
    // The engine serves the next request normally.
    e.add_request(Request::new(2, p, greedy(4))).unwrap();
    let done = e.run_to_completion().unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].tokens.len(), 4);
}

#[test]
fn reported_logprobs_are_the_log_softmax_of_the_step_logits() {
    let m = model();
    let mut e = engine_with(&m, 64, 256, 4);
    e.set_logits_capture(true);
    let asked = SamplingParams {
        temperature: 0.9,
        seed: Some(5),
        logprobs: Some(3),
        ..greedy(8)
    };
    e.add_request(Request::new(1, prompt(1, 40), asked))
        .unwrap();
    e.add_request(Request::new(2, prompt(2, 40), greedy(8)))
        .unwrap();
    let outs = step_until_done(&mut e, 100);
    let mut checked = 0;
    for o in &outs {
        let Some(token) = o.token else { continue };
        if o.id == 2 {
            assert!(o.logprobs.is_none(), "not asked for: {o:?}");
            continue;
        }
        let logits = o.logits.as_ref().expect("captured logits");
        let lp = o.logprobs.as_ref().expect("asked for logprobs");
        // The engine's own log-softmax of this step's logits, in f64.
        let max = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = max
            + logits
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let own = |t: u32| logits[t as usize] as f64 - lse;
        assert_eq!(lp.token, token);
        assert!((lp.logprob as f64 - own(token)).abs() < 1e-4, "{lp:?}");
        assert!(lp.logprob <= 0.0);
        assert_eq!(lp.top.len(), 3);
        let mut best: Vec<u32> = (0..logits.len() as u32).collect();
        best.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        for (k, (t, l)) in lp.top.iter().enumerate() {
            assert_eq!(*t, best[k]);
            assert!((*l as f64 - own(*t)).abs() < 1e-4);
        }
        checked += 1;
    }
    assert_eq!(checked, 8);
}

/// Runs one request to its end, step by step; returns (cached tokens, pin outcome).
fn run_pinned(
    engine: &mut Engine,
    id: u64,
    tokens: Vec<u32>,
    pin: Option<kvfleet_engine::PinSpec>,
) -> (usize, Option<kvfleet_engine::PinOutcome>) {
    let mut req = Request::new(id, tokens, greedy(1));
    req.pin = pin;
    engine.add_request(req).expect("add");
    let (mut cached, mut outcome) = (0, None);
    while engine.has_unfinished() {
        for o in engine.step().expect("step") {
            cached = o.cached_tokens;
            outcome = outcome.or(o.pin);
        }
    }
    (cached, outcome)
}

#[test]
fn a_pinned_prefix_survives_traffic_that_evicts_everything_else_until_it_expires() {
    use kvfleet_engine::{PinOutcome, PinSpec};
    use std::sync::Mutex;
    use std::time::{Duration, Instant};
    let m = model();
    // 24 blocks, pins capped at half of them.
    let mut e = engine_with(&m, 24, 512, 4);
    e.set_pin_pool_fraction(0.5);
    assert_eq!(e.pin_capacity(), 12);
    let t0 = Instant::now();
    let now = Arc::new(Mutex::new(t0));
    let clock = now.clone();
    e.set_pin_clock(Arc::new(move || *clock.lock().unwrap()));
    // A 4-block system prefix, pinned for 300 s, then a question.
    let system = prompt(1, 4 * BS);
    let ask = |tail: u32| {
        let mut p = system.clone();
        p.extend(prompt(100 + tail, 7));
        p
    };
    let ttl = Duration::from_secs(300);
    let spec = PinSpec { blocks: 4, ttl };
    let (cached, outcome) = run_pinned(&mut e, 1, ask(0), Some(spec));
    assert_eq!(cached, 0);
    assert_eq!(
        outcome,
        Some(PinOutcome::Pinned {
            blocks: 4,
            expires: t0 + ttl
        })
    );
    assert_eq!(e.pinned_blocks(), 4);
    // An unpinned prompt, then enough other traffic to cycle every unpinned block.
    let unpinned = prompt(2, 4 * BS + 7);
    run_pinned(&mut e, 2, unpinned.clone(), None);
    for i in 0..6 {
        run_pinned(&mut e, 10 + i, prompt(50 + i as u32, 10 * BS), None);
    }
    e.check_invariants().expect("invariants");
    let (cached, _) = run_pinned(&mut e, 20, unpinned.clone(), None);
    assert_eq!(cached, 0, "the unpinned prefix was evicted");
    // The pinned prefix is still whole: a new question reads all four blocks.
    let (cached, _) = run_pinned(&mut e, 21, ask(1), None);
    assert_eq!(cached, 4 * BS);
    // A re-pin extends the pin without a second reference.
    *now.lock().unwrap() = t0 + Duration::from_secs(100);
    let (_, again) = run_pinned(&mut e, 22, ask(2), Some(spec));
    let extended = t0 + Duration::from_secs(100) + ttl;
    assert_eq!(
        again,
        Some(PinOutcome::Pinned {
            blocks: 4,
            expires: extended
        })
    );
    assert_eq!(e.pinned_blocks(), 4);
    // Past the first expiry it holds; past the extended one it is released, and the
    // same traffic evicts it like any other prefix.
    *now.lock().unwrap() = t0 + ttl + Duration::from_secs(1);
    run_pinned(&mut e, 23, prompt(60, 10 * BS), None);
    assert_eq!(e.pinned_blocks(), 4);
    *now.lock().unwrap() = extended;
    for i in 0..6 {
        run_pinned(&mut e, 30 + i, prompt(70 + i as u32, 10 * BS), None);
    }
    assert_eq!(e.pinned_blocks(), 0);
    let (cached, _) = run_pinned(&mut e, 40, ask(3), None);
    assert_eq!(cached, 0, "expired: evicted by the traffic since");
    e.check_invariants().expect("invariants");
}

#[test]
fn pins_past_the_pool_cap_are_refused_and_served() {
    use kvfleet_engine::{PinOutcome, PinRefusal, PinSpec};
    use std::time::Duration;
    let m = model();
    let mut e = engine_with(&m, 16, 512, 4);
    e.set_pin_pool_fraction(0.25);
    let spec = PinSpec {
        blocks: 3,
        ttl: Duration::from_secs(60),
    };
    let (_, a) = run_pinned(&mut e, 1, prompt(1, 3 * BS + 2), Some(spec));
    assert!(
        matches!(a, Some(PinOutcome::Pinned { blocks: 3, .. })),
        "{a:?}"
    );
    // Three more would make six of a cap of four: refused, yet the request ran.
    let mut req = Request::new(2, prompt(2, 3 * BS + 2), greedy(3));
    req.pin = Some(spec);
    e.add_request(req).expect("add");
    let done = e.run_to_completion().expect("run");
    assert_eq!(done[0].tokens.len(), 3);
    let (_, b) = run_pinned(&mut e, 3, prompt(3, 3 * BS + 2), Some(spec));
    assert_eq!(b, Some(PinOutcome::Refused(PinRefusal::Capacity)));
    assert_eq!(e.pinned_blocks(), 3);
    // A ttl over an hour is a bad request.
    let mut bad = Request::new(4, prompt(4, 20), greedy(1));
    bad.pin = Some(PinSpec {
        blocks: 1,
        ttl: Duration::from_secs(3601),
    });
    assert!(e.add_request(bad).is_err());
}

#[test]
fn a_waiting_request_keeps_its_cached_prefix_from_the_admissions_ahead_of_it() {
    let m = model();
    // 16 blocks, one sequence at a time: the second request waits behind the first.
    let mut e = engine_with(&m, 16, 512, 1);
    // Two 4-block prefixes cached, `older` the least recently used.
    let older = prompt(1, 4 * BS + 3);
    let newer = prompt(2, 4 * BS + 3);
    assert_eq!(run_pinned(&mut e, 1, older.clone(), None).0, 0);
    assert_eq!(run_pinned(&mut e, 2, newer.clone(), None).0, 0);
    // A stranger needing 12 blocks arrives first, then a request reusing `older`. The
    // stranger's admission must evict four cached blocks: `newer`'s, since the waiting
    // request made `older` the most recent when it arrived.
    let mut reuse = older.clone();
    reuse.extend(prompt(4, 5));
    queue_for_one_token(&mut e, vec![(3, prompt(3, 11 * BS + 3)), (4, reuse)]);
    let cached = cached_by_request(&mut e);
    assert_eq!(cached.get(&3), Some(&0));
    assert_eq!(
        cached.get(&4),
        Some(&(4 * BS)),
        "its prefix survived the stranger"
    );
    assert_eq!(run_pinned(&mut e, 5, newer, None).0, 0, "evicted instead");
    e.check_invariants().expect("invariants");
}

/// Queues each `(id, prompt)` in order, each for one greedy token.
fn queue_for_one_token(e: &mut Engine, requests: Vec<(u64, Vec<u32>)>) {
    for (id, p) in requests {
        e.add_request(Request::new(id, p, greedy(1))).expect("add");
    }
}

/// Runs every queued request to the end: each one's cached prompt tokens.
fn cached_by_request(e: &mut Engine) -> std::collections::BTreeMap<u64, usize> {
    let mut cached = std::collections::BTreeMap::new();
    while e.has_unfinished() {
        for o in e.step().expect("step") {
            cached.insert(o.id, o.cached_tokens);
        }
    }
    cached
}

/// An engine of 16 blocks running one sequence at a time, with a 4-block prefix
/// cached (request 1), and a prompt that reuses that prefix.
fn engine_with_a_cached_prefix(m: &Arc<LlamaModel>) -> (Engine, Vec<u32>) {
    let mut e = engine_with(m, 16, 512, 1);
    let older = prompt(1, 4 * BS + 3);
    assert_eq!(run_pinned(&mut e, 1, older.clone(), None).0, 0);
    let mut reuse = older;
    reuse.extend(prompt(4, 5));
    (e, reuse)
}

#[test]
fn a_waiting_request_holds_its_cached_prefix_while_the_requests_ahead_finish() {
    let m = model();
    let (mut e, reuse) = engine_with_a_cached_prefix(&m);
    // Two strangers of 8 blocks each queue ahead of a request reusing `older`. The
    // first one's finished blocks become more recent than `older` (touched when the
    // request arrived), so without a hold the second one's admission evicts it.
    queue_for_one_token(
        &mut e,
        vec![
            (2, prompt(2, 7 * BS + 3)),
            (3, prompt(3, 7 * BS + 3)),
            (4, reuse),
        ],
    );
    let cached = cached_by_request(&mut e);
    assert_eq!((cached.get(&2), cached.get(&3)), (Some(&0), Some(&0)));
    assert_eq!(
        cached.get(&4),
        Some(&(4 * BS)),
        "its prefix was held while it waited"
    );
    e.check_invariants().expect("invariants");
}

#[test]
fn a_prefix_two_waiting_siblings_hold_counts_once_against_the_cap() {
    let m = model();
    // 16 blocks, one sequence at a time; the waiting sequences may hold 8. A 5-block
    // prefix is cached, and two siblings reusing it wait with two strangers between
    // them. The first sibling holds the 5 blocks; the second holds the same 5, which
    // take no more of the pool. Counted once per holder they made 10, and the second
    // sibling held 3: by the time it is admitted, the strangers' admissions have
    // evicted the rest of its prefix.
    let mut e = engine_with(&m, 16, 512, 1);
    let shared = prompt(1, 5 * BS + 3);
    assert_eq!(run_pinned(&mut e, 1, shared.clone(), None).0, 0);
    let sibling = |tail: u32| {
        let mut p = shared.clone();
        p.extend(prompt(tail, 5));
        p
    };
    queue_for_one_token(
        &mut e,
        vec![
            (2, sibling(10)),
            (3, prompt(3, 3 * BS + 3)),
            (4, prompt(4, 9 * BS + 3)),
            (5, sibling(11)),
        ],
    );
    let cached = cached_by_request(&mut e);
    assert_eq!(cached.get(&2), Some(&(5 * BS)));
    assert_eq!(
        cached.get(&5),
        Some(&(5 * BS)),
        "the second sibling held the whole shared prefix"
    );
    e.check_invariants().expect("invariants");
}

#[test]
fn held_prefixes_give_way_to_the_request_at_the_head_of_the_queue() {
    let m = model();
    let (mut e, reuse) = engine_with_a_cached_prefix(&m);
    // The head needs 15 of the 16 blocks, and the request behind it holds 4: the hold
    // is dropped so the head runs (a hold never stalls the queue or preempts).
    e.add_request(Request::new(2, prompt(2, 14 * BS + 3), greedy(2)))
        .expect("add");
    e.add_request(Request::new(3, reuse, greedy(1)))
        .expect("add");
    let mut steps = 0;
    let mut finished = Vec::new();
    let mut head_tokens = 0;
    while e.has_unfinished() {
        steps += 1;
        assert!(steps < 100, "the queue stalled");
        for o in e.step().expect("step") {
            if o.id == 2 && o.token.is_some() {
                head_tokens += 1;
            }
            if o.finish.is_some() {
                finished.push(o.id);
            }
        }
    }
    assert_eq!(finished, vec![2, 3]);
    assert_eq!(
        head_tokens, 2,
        "the head ran whole, not cut short for want of blocks"
    );
    assert_eq!(e.stats().preemptions, 0, "nothing was preempted");
    e.check_invariants().expect("invariants");
}

#[test]
fn the_reported_admission_headroom_says_whether_a_prompt_starts_at_once() {
    // A router reads `admit_blocks` to tell a worker that would start a prompt from
    // one that would queue it behind its running sequences. With the whole max_tokens
    // reserved, one running request of 3 prompt blocks that may grow to 8 leaves
    // 20 - 3 - 5 = 12 blocks of headroom: a waiting request expected to need 12 is
    // admitted at the next step, one that needs 13 is not.
    let m = model();
    let whole = DecodeReserveConfig {
        init_ratio: 1.0,
        min_ratio: 1.0,
        ..DecodeReserveConfig::default()
    };
    for (blocks, admitted) in [(12usize, true), (13, false)] {
        let mut e = engine_reserving(&m, 20, 256, 4, 256, whole);
        let idle = e.load();
        assert_eq!(idle.admit_blocks, 20, "an idle engine's whole pool");
        e.add_request(Request::new(1, prompt(1, 3 * BS), greedy(5 * BS)))
            .expect("add");
        e.step().expect("step");
        let load = e.load();
        assert_eq!((load.running, load.free_blocks), (1, 17));
        assert_eq!(load.admit_blocks, 12, "17 free less 5 of expected growth");
        // `blocks` blocks of prompt and expected output (max_tokens 2).
        let tokens = (blocks - 1) * BS + 1;
        e.add_request(Request::new(2, prompt(2, tokens - 2), greedy(2)))
            .expect("add");
        e.step().expect("step");
        let load = e.load();
        assert_eq!(load.running + load.waiting, 2);
        assert_eq!(
            load.running == 2,
            admitted,
            "a request of {blocks} blocks beside a headroom of 12"
        );
    }
}
