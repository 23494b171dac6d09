//! The deployment assets against real tools: the Helm chart (lint, render, schema
//! validation), the Grafana dashboards and the Prometheus rules (on a real Prometheus
//! scraping `kvfleet up` under a replayed fork trace).
//!
//! Tools come from `scripts/test.sh`: Helm v4's Go SDK from the `helm-python-sdk`
//! wheel and the `kubernetes-validate` schemas, both driven by
//! `scripts/check_chart.py` (`KVFLEET_PYTHON`, default `python3`); Debian's
//! `prometheus` and `promtool` (`KVFLEET_PROMETHEUS_BIN`, `KVFLEET_PROMTOOL_BIN`,
//! default: on `PATH`).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The one rules file (a link to the chart's `rules/kvfleet-rules.yaml`).
fn rules_file() -> PathBuf {
    Path::new(ROOT).join("deploy/prometheus/kvfleet-rules.yaml")
}

/// A tool from `var`, or `name` when it is on `PATH`; a clear failure otherwise.
fn tool(var: &str, name: &str) -> String {
    if let Ok(p) = std::env::var(var) {
        return p;
    }
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    assert!(
        !found.is_empty(),
        "{name} not found: run `bash scripts/test.sh` (it installs Debian's prometheus) or set {var}"
    );
    found
}

#[test]
fn chart_lints_renders_and_validates_for_every_example() {
    let python = std::env::var("KVFLEET_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import helm_python, kubernetes_validate"])
        .status()
        .expect("run python");
    assert!(
        probe.success(),
        "{python} lacks helm_python / kubernetes_validate: run `bash scripts/test.sh` \
         (pip install helm-python-sdk kubernetes-validate) or set KVFLEET_PYTHON"
    );
    let out = Command::new(&python)
        .arg(Path::new(ROOT).join("scripts/check_chart.py"))
        .output()
        .expect("run check_chart.py");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("check_chart.py printed no report ({e}): {stderr}"));
    println!(
        "Helm SDK {} (libhelm_c {}), kubernetes-validate {}, Kubernetes {}",
        report["helm_sdk"],
        report["helm_c"],
        report["kubernetes_validate"],
        report["kube_versions"]
    );
    let examples = report["examples"].as_object().expect("examples");
    assert_eq!(
        examples.len(),
        4,
        "three examples and the defaults: {report}"
    );
    for (name, e) in examples {
        println!(
            "{name}: {} objects {} lint problems {} validation errors {}",
            e["objects"], e["kinds"], e["lint_problems"], e["validation_errors"]
        );
        assert_eq!(e["ok"], true, "{name}: {e:#}");
        assert_eq!(
            e["lint_problems"].as_array().map(Vec::len),
            Some(0),
            "{e:#}"
        );
        assert_eq!(
            e["validation_errors"].as_array().map(Vec::len),
            Some(0),
            "{e:#}"
        );
    }
    // What the examples are for. The defaults: direct mode, the workers' stable names.
    let direct = &examples["defaults"];
    let router_args: Vec<&str> = direct["router_args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let workers = router_args
        .iter()
        .find_map(|a| a.strip_prefix("--workers="))
        .expect("direct mode lists the workers");
    assert_eq!(
        workers,
        "kvfleet-worker-0.kvfleet-worker-headless.llm.svc.cluster.local:50051,\
         kvfleet-worker-1.kvfleet-worker-headless.llm.svc.cluster.local:50051"
    );
    let single = &examples["values-single-node"];
    assert_eq!(
        single["kinds"]["StatefulSet"], 2,
        "workers and the bundled etcd"
    );
    assert_eq!(
        single["config"]["KVFLEET_ETCD"], "http://kvfleet-etcd:2379",
        "{single}"
    );
    assert_eq!(single["config"]["KVFLEET_KAFKA"], "", "{single}");
    let gpu = &examples["values-2routers-8gpu"];
    assert_eq!(gpu["worker_replicas"], 8);
    assert_eq!(gpu["worker_limits"]["nvidia.com/gpu"], 1);
    // GPU workers run on their GPU, the pool sized from its memory (no hand-computed
    // block count); CPU workers get no CUDA flags.
    let gpu_args = gpu["worker_args"].to_string();
    assert!(
        gpu_args.contains("\"--device=cuda:0\"")
            && gpu_args.contains("\"--gpu-memory-utilization=0.9\"")
            && !gpu_args.contains("--num-blocks"),
        "{gpu_args}"
    );
    for cpu in ["defaults", "values-single-node", "values-external"] {
        let args = examples[cpu]["worker_args"].to_string();
        assert!(
            !args.contains("--device") && !args.contains("--gpu-memory-utilization"),
            "{cpu}: {args}"
        );
    }
    let cases = report["gpu_cases"].as_object().expect("gpu_cases");
    for (case, c) in cases {
        println!("GPU flag case {case}: {c}");
        if let Some(p) = c.get("problems") {
            assert_eq!(p.as_array().map(Vec::len), Some(0), "{case}: {c}");
        }
    }
    assert_eq!(cases["check_catches_missing_device"]["caught"], true);
    assert_eq!(gpu["kinds"]["HorizontalPodAutoscaler"], 1);
    assert_eq!(
        gpu["kinds"]["StatefulSet"], 2,
        "workers and the bundled etcd"
    );
    let ext_args = examples["values-external"]["router_args"].to_string();
    assert!(
        ext_args.contains("--etcd=$(KVFLEET_ETCD)")
            && ext_args.contains("--kafka=$(KVFLEET_KAFKA)"),
        "{ext_args}"
    );
    assert_eq!(
        examples["values-external"]["kinds"].get("StatefulSet"),
        Some(&1.into())
    );
    // KV tiers: the flags and the disk tier's volume appear only when asked for; the
    // disk tier sits on an emptyDir (sized with headroom), a shared claim, or a claim
    // per worker.
    let tiers = report["tier_cases"].as_object().expect("tier_cases");
    let tier_args = |case: &str| -> Vec<String> {
        tiers[case]["worker_args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(|a| a.as_str())
            .filter(|a| a.contains("-cache-"))
            .map(String::from)
            .collect()
    };
    let count = |case: &str, key: &str| tiers[case][key].as_array().map_or(0, Vec::len);
    for case in ["tiers_off", "host_only"] {
        assert_eq!(count(case, "mounts") + count(case, "volumes"), 0, "{case}");
        assert_eq!(count(case, "claim_templates"), 0, "{case}");
    }
    assert!(
        tier_args("tiers_off").is_empty(),
        "{:?}",
        tier_args("tiers_off")
    );
    for ex in ["defaults", "values-single-node", "values-external"] {
        let args = examples[ex]["worker_args"].to_string();
        assert!(!args.contains("-cache-"), "{ex}: {args}");
    }
    assert_eq!(tier_args("host_only"), ["--host-cache-gib=4"]);
    let disk_dir = "--disk-cache-dir=/var/cache/kvfleet/kv";
    assert_eq!(
        tier_args("disk_emptydir"),
        ["--host-cache-gib=4", disk_dir, "--disk-cache-gib=2.5"]
    );
    let empty = &tiers["disk_emptydir"];
    assert_eq!(empty["mounts"][0]["mountPath"], "/var/cache/kvfleet/kv");
    assert_eq!(empty["volumes"][0]["emptyDir"]["sizeLimit"], "3584Mi");
    assert_eq!(count("disk_emptydir", "claim_templates"), 0);
    let shared = &tiers["disk_existing_claim"];
    assert_eq!(
        tier_args("disk_existing_claim"),
        ["--host-cache-gib=1.5", disk_dir, "--disk-cache-gib=16"]
    );
    assert_eq!(
        shared["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "kv-cache"
    );
    let per_worker = &tiers["disk_storage_class"];
    assert_eq!(count("disk_storage_class", "volumes"), 0, "{per_worker}");
    assert_eq!(per_worker["mounts"][0]["name"], "kv-disk");
    let claim = &per_worker["claim_templates"][0];
    assert_eq!(claim["metadata"]["name"], "kv-disk");
    assert_eq!(claim["spec"]["storageClassName"], "fast-ssd");
    assert_eq!(
        claim["spec"]["resources"]["requests"]["storage"],
        "103424Mi"
    );
    for (case, t) in tiers {
        assert_eq!(
            t["validation_errors"].as_array().map(Vec::len),
            Some(0),
            "{case}: {t}"
        );
    }
    assert_eq!(
        report["negative"]["disk_tier_without_host_tier"]["refused"],
        true
    );
    assert_eq!(report["negative"]["negative_host_cache"]["refused"], true);
    // The real binary accepts every rendered command line: flag names and value types
    // (clap checks each argument before `--help`), with the pods' $(VAR)s expanded. The
    // GPU flag cases render with the defaults' config.
    let default_config = examples["defaults"]["config"].clone();
    let rendered = examples
        .iter()
        .map(|(name, e)| (name, e, &e["config"], vec!["router_args", "worker_args"]))
        .chain(
            cases
                .iter()
                .chain(tiers.iter())
                .filter(|(_, c)| c.get("worker_args").is_some())
                .map(|(name, c)| (name, c, &default_config, vec!["worker_args"])),
        );
    for (name, e, config, keys) in rendered {
        let config = config.as_object().expect("config");
        for key in keys {
            let args: Vec<String> = e[key]
                .as_array()
                .expect("args")
                .iter()
                .map(|a| {
                    let mut a = a.as_str().expect("arg").to_string();
                    for (k, v) in config {
                        a = a.replace(&format!("$({k})"), v.as_str().unwrap_or(""));
                    }
                    a.replace("$(POD_NAME)", "kvfleet-worker-0")
                        .replace("$(POD_NAMESPACE)", "llm")
                })
                .collect();
            assert!(!args.iter().any(|a| a.contains("$(")), "{name}: {args:?}");
            let out = Command::new(env!("CARGO_BIN_EXE_kvfleet"))
                .args(&args)
                .arg("--help")
                .output()
                .expect("run kvfleet");
            assert!(
                out.status.success(),
                "{name}: kvfleet refuses the chart's {key} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    for (case, r) in report["negative"].as_object().expect("negative") {
        println!("negative case {case}: {r}");
    }
    assert_eq!(report["ok"], true, "{report:#}");
}

/// Every `kvfleet_*` name an expression mentions.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut cur = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            cur.push(c);
        } else {
            if cur.starts_with("kvfleet_") {
                names.insert(cur.clone());
            }
            cur.clear();
        }
    }
    names
}

/// (dashboard, panel title, expression) of every dashboard target.
fn dashboard_queries() -> Vec<(String, String, String)> {
    let dir = Path::new(ROOT).join("helm/kvfleet/dashboards");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("dashboards dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read dashboard");
        let board: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", f.display()));
        let uid = board["uid"].as_str().expect("uid").to_string();
        let panels = board["panels"].as_array().expect("panels");
        assert!(!panels.is_empty(), "{uid} has no panels");
        let ids: BTreeSet<_> = panels.iter().map(|p| p["id"].as_u64()).collect();
        assert_eq!(ids.len(), panels.len(), "{uid}: duplicate panel ids");
        for p in panels {
            let title = p["title"].as_str().expect("title").to_string();
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "{uid} / {title}: no query");
            for t in targets {
                let expr = t["expr"].as_str().unwrap_or("").trim().to_string();
                assert!(!expr.is_empty(), "{uid} / {title}: empty PromQL");
                out.push((uid.clone(), title.clone(), expr));
            }
        }
    }
    out
}

/// Grafana variables replaced by concrete values for evaluation.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("${price}", "3")
        .replace("$price", "3")
        .replace("$worker", ".*")
}

/// A Prometheus the test started, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    http: reqwest::blocking::Client,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus scraping `target` (`host:port`) every second and evaluating
    /// the kvfleet rules every second.
    fn start(target: &str) -> Prometheus {
        let bin = tool("KVFLEET_PROMETHEUS_BIN", "prometheus");
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: kvfleet\n    static_configs:\n      - targets: ['{target}']\n",
                rules_file().display()
            ),
        )
        .expect("write config");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn prometheus");
        let p = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            http: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .expect("client"),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !p
            .http
            .get(format!("{}/-/ready", p.url))
            .send()
            .is_ok_and(|r| r.status().is_success())
        {
            assert!(Instant::now() < deadline, "prometheus never became ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        p
    }

    /// `/api/v1/query`: Ok(result vector) or Err(the error).
    fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let r: serde_json::Value = self
            .http
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", expr)])
            .send()
            .map_err(|e| e.to_string())?
            .json()
            .map_err(|e| e.to_string())?;
        if r["status"] != "success" {
            return Err(format!("{}: {}", r["errorType"], r["error"]));
        }
        match &r["data"]["result"] {
            serde_json::Value::Array(v) => Ok(v.clone()),
            scalar => Ok(vec![serde_json::json!({ "value": scalar })]),
        }
    }

    /// Polls `done` for up to 30 s.
    fn wait_for(&self, done: impl Fn(&Prometheus) -> bool, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done(self) {
            assert!(Instant::now() < deadline, "prometheus never got {what}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits until Prometheus has scraped `n` requests in `kvfleet_requests_total`.
    fn wait_for_requests(&self, n: f64) {
        self.wait_for(
            |p| {
                p.query("sum(kvfleet_requests_total)")
                    .ok()
                    .and_then(|r| r.first()?["value"][1].as_str()?.parse::<f64>().ok())
                    == Some(n)
            },
            &format!("{n} requests"),
        );
    }

    fn rules(&self) -> serde_json::Value {
        self.http
            .get(format!("{}/api/v1/rules", self.url))
            .send()
            .expect("rules")
            .json()
            .expect("rules json")
    }
}

/// How many of `result`'s samples are finite numbers.
fn finite(result: &[serde_json::Value]) -> usize {
    result
        .iter()
        .filter(|s| {
            s["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        })
        .count()
}

/// Sum of `kvfleet_requests_total` in a scrape.
fn total_requests(scrape: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with("kvfleet_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The metric names in a Prometheus text exposition.
fn exported_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Two turns of one session whose second rewrites the system prompt: a prefix break.
fn prefix_break(cluster: &support::Cluster, session: &str) {
    let history = support::filler(7, 200);
    for system in ["You are terse.", "You are verbose."] {
        let body = support::chat(
            serde_json::json!([
                {"role": "system", "content": system},
                {"role": "user", "content": history},
            ]),
            2,
        );
        let (status, _, resp) = cluster.post_with_headers(
            "/v1/chat/completions",
            &body,
            &[("x-kvfleet-session", session)],
        );
        assert_eq!(status, 200, "{resp}");
    }
}

#[test]
fn dashboards_and_rules_return_data_on_a_real_prometheus() {
    // Static checks first: valid JSON, a query per panel, promtool accepts the rules.
    let queries = dashboard_queries();
    let promtool = tool("KVFLEET_PROMTOOL_BIN", "promtool");
    let check = Command::new(&promtool)
        .args(["check", "rules"])
        .arg(rules_file())
        .output()
        .expect("run promtool");
    assert!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    let cluster = support::Cluster::up(&["--workers", "3"]);
    let target = cluster.url.trim_start_matches("http://").to_string();
    let prom = Prometheus::start(&target);
    // Prometheus picks up new targets in its first discovery sync (about 5 s): traffic
    // before its first scrape would be invisible to rate().
    prom.wait_for(
        |p| p.query("up").is_ok_and(|r| finite(&r) > 0),
        "the first scrape",
    );

    // Small fork fan-out traces replayed against the cluster while Prometheus scrapes,
    // plus sessions that break their prefix. Two rounds: Prometheus counts a counter's
    // increase only from its first scrape, so the first round creates every series and
    // the second, after a few scrapes, moves them.
    let dir = tempfile::tempdir().expect("tempdir");
    for round in 1..=2 {
        let trace = dir.path().join(format!("trace-{round}.jsonl"));
        let trace_s = trace.to_str().expect("utf-8 path");
        let seed = round.to_string();
        support::run_kvfleet(&[
            "bench",
            "gen",
            "--out",
            trace_s,
            "--seed",
            &seed,
            "--sessions",
            "3",
            "--system-tokens",
            "512",
            "--tools-tokens",
            "512",
            "--history-tokens",
            "512",
            "--turn-tokens",
            "128",
            "--parent-turns",
            "2",
            "--child-turns",
            "1",
            "--fork-k",
            "3",
            "--output-tokens",
            "4",
            "--session-rate",
            "4",
            "--turn-gap-ms",
            "50",
        ]);
        let replay: serde_json::Value = serde_json::from_str(&support::run_kvfleet(&[
            "bench",
            "replay",
            "--trace",
            trace_s,
            "--target",
            &cluster.url,
            "--tokens-per-id",
            "16",
            "--no-progress",
            "--json",
        ]))
        .expect("replay json");
        assert_eq!(replay["failed"], 0, "{replay}");
        assert_eq!(replay["ok"], 15, "{replay}");
        prefix_break(&cluster, &format!("deploy-assets-{round}"));
        if round == 1 {
            // Round 2 starts once Prometheus holds round 1's counters.
            prom.wait_for_requests(total_requests(&cluster.get_text("/metrics")));
        }
    }

    // Every name the dashboards use is one the binary exports.
    let scrape = cluster.get_text("/metrics");
    let exported = exported_names(&scrape);
    let mut missing = Vec::new();
    for (uid, title, expr) in &queries {
        for name in metric_names(expr) {
            if !exported.contains(&name) {
                missing.push(format!("{uid} / {title}: {name}"));
            }
        }
    }
    assert!(missing.is_empty(), "not exported by kvfleet: {missing:#?}");

    // The event-stream lag gauge: one series per worker, caught up once the fleet is idle.
    let lag: BTreeMap<String, f64> = scrape
        .lines()
        .filter(|l| l.starts_with("kvfleet_router_worker_events_behind{"))
        .filter_map(|l| {
            let worker = l.split("worker=\"").nth(1)?.split('"').next()?.to_string();
            Some((worker, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect();
    assert_eq!(lag.len(), 3, "{lag:?}");

    // Wait until Prometheus holds the final counters and has evaluated the rules on them.
    prom.wait_for_requests(total_requests(&scrape));
    prom.wait_for(
        |p| {
            p.query("kvfleet:prefix_break_ratio:rate5m")
                .is_ok_and(|r| finite(&r) > 0)
        },
        "the recording rules",
    );

    let mut table = Vec::new();
    let mut failures = Vec::new();
    let mut check = |what: String, expr: &str, must_have_data: bool| match prom.query(expr) {
        Ok(r) => {
            let (n, fin) = (r.len(), finite(&r));
            table.push(format!("{n:>3} series ({fin:>2} finite)  {what}"));
            if must_have_data && fin == 0 {
                failures.push(format!(
                    "{what}: no data ({n} series, none finite) for {expr}"
                ));
            }
        }
        Err(e) => failures.push(format!("{what}: {e} in {expr}")),
    };
    for (uid, title, expr) in &queries {
        check(format!("{uid} / {title}: {expr}"), &substitute(expr), true);
    }
    // Rules: as Prometheus loaded them from the file.
    let rules = prom.rules();
    let all: Vec<&serde_json::Value> = rules["data"]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .collect();
    let recorded: BTreeSet<&str> = all
        .iter()
        .filter(|r| r["type"] == "recording")
        .filter_map(|r| r["name"].as_str())
        .collect();
    let mut alerts = 0;
    for r in &all {
        let name = r["name"].as_str().expect("name");
        let expr = r["query"].as_str().expect("query");
        assert_eq!(r["health"], "ok", "rule {name}: {r}");
        if r["type"] == "recording" {
            check(format!("record {name}: {expr}"), expr, true);
            check(format!("record {name} (stored series)"), name, true);
        } else {
            alerts += 1;
            // `<recorded base> <comparison>`: the base must have data; the alert
            // itself must evaluate (it may well be quiet).
            let base = expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .next()
                .unwrap_or("");
            assert!(
                recorded.contains(base),
                "alert {name} does not start with a recorded series: {expr}"
            );
            check(format!("alert {name} base {base}"), base, true);
            check(
                format!("alert {name}: {}", expr.replace('\n', " ")),
                expr,
                false,
            );
        }
    }
    println!("expr -> series (of which finite):\n{}", table.join("\n"));
    assert_eq!((recorded.len(), alerts), (8, 6), "{rules}");
    assert!(failures.is_empty(), "{failures:#?}");
    println!("event-stream lag per worker at the end: {lag:?}");
}

#[test]
fn worker_serves_metrics_and_health() {
    let worker = support::start(
        &[
            "worker",
            "--grpc",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ],
        "http://",
    );
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    let health = http
        .get(format!("http://{}/health", worker.addr))
        .send()
        .expect("health");
    assert_eq!(health.status(), 200);
    let metrics = http
        .get(format!("http://{}/metrics", worker.addr))
        .send()
        .expect("metrics")
        .text()
        .expect("text");
    // This process's own engine series (its id is `worker-<grpc port>`).
    let names = exported_names(&metrics);
    for name in ["kvfleet_worker_free_blocks", "kvfleet_worker_running"] {
        assert!(names.contains(name), "{name} missing: {metrics}");
    }
    assert!(
        metrics.contains("kvfleet_worker_running{worker=\"worker-"),
        "{metrics}"
    );
}
