//! A tuning experiment, not a check: `cache-aware`'s default weights
//! against stickier settings, on the Mooncake trace and the generated fork and herd
//! traces of the benchmark matrix, as ratios to the better of SGLang and Dynamo and to
//! SGLang alone. Run with
//! `cargo run --release -p kvfleet-bench --example tune_cache_aware`.

use kvfleet_bench::bounds::bounds;
use kvfleet_bench::matrix::load_scale;
use kvfleet_bench::sim::cost_model::CostModel;
use kvfleet_bench::sim::{simulate, SimConfig, SimPolicy};
use kvfleet_bench::trace_gen::{generate, GenConfig};
use kvfleet_routing::PolicyKind;

fn main() {
    let gen = GenConfig {
        sessions: 300,
        ..GenConfig::default()
    };
    let fork = generate(&gen).unwrap();
    let herd = generate(&GenConfig {
        shared_prefix: true,
        seed: 2,
        ..gen
    })
    .unwrap();
    let mooncake = kvfleet_bench::Trace::read_path(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/mooncake_synthetic_trace.jsonl"
    )))
    .unwrap();
    for (name, t) in [("mooncake", mooncake), ("fork", fork), ("herd", herd)] {
        for n in [8usize, 64] {
            let b = bounds(&t, n, 1000, &CostModel::h200_llama8b());
            for load in [0.5, 0.9, 1.3] {
                let mut base = SimConfig::new(n, 1000, SimPolicy::Kvfleet(PolicyKind::CacheAware));
                let s = load_scale(&t, &b, n, &base.cost, load).scale;
                let tt = t.scaled_time(s);
                let sg =
                    simulate(&tt, &SimConfig::new(n, 1000, SimPolicy::SglangCacheAware)).unwrap();
                let dy = simulate(&tt, &SimConfig::new(n, 1000, SimPolicy::DynamoKvCost)).unwrap();
                let best = sg.ttft_ms.p99.min(dy.ttft_ms.p99);
                let besth = sg.hit_ratio.max(dy.hit_ratio);
                for (pw, dc, slack) in [(2.0, 16.0, 16.0), (4.0, 16.0, 16.0), (6.0, 4.0, 32.0)] {
                    base.router.cache_aware.prefill_weight = pw;
                    base.router.cache_aware.decode_cost_per_sequence = dc;
                    base.router.cache_aware.balance_slack = slack;
                    let r = simulate(&tt, &base).unwrap();
                    println!(
                        "{name} n{n} load{load} pw{pw}: hit {:.3} ({:.3}) p99 {:.0} ({:.2})",
                        r.hit_ratio,
                        r.hit_ratio / besth,
                        r.ttft_ms.p99,
                        r.ttft_ms.p99 / best
                    );
                }
            }
        }
    }
}
