#!/usr/bin/env python3
"""Lints and renders helm/kvfleet with a real Helm, then validates what it renders.

Helm is Helm v4's Go SDK as a C library (`libhelm_c`), from the PyPI wheel
`helm-python-sdk`: `helm lint` and `helm template` run in-process, offline. Every
rendered object is validated against the Kubernetes JSON schemas of the
`kubernetes-validate` package (strict: unknown fields fail) for the oldest and newest
Kubernetes the chart supports; ServiceMonitor and PrometheusRule against the strict
CRD subsets in tests/schemas/. Negative cases prove each stage can fail: values the
chart must refuse, and a corrupted object the schemas must reject.

Prints one JSON report on stdout; exits non-zero if any check failed.
Run by tests/e2e_deploy_assets.rs (`cargo test --test e2e_deploy_assets`).
"""

import copy
import json
import os
import sys

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CHART = os.path.join(ROOT, "helm", "kvfleet")
EXAMPLES = ["values-single-node", "values-2routers-8gpu", "values-external"]
# The chart's own defaults (direct mode: no etcd, the router gets --workers) are checked
# like an example.
DEFAULTS = "defaults"
KUBE_VERSIONS = ["1.25.0", "1.37.0"]
CRD_SCHEMAS = os.path.join(ROOT, "tests", "schemas", "monitoring.coreos.com-v1.json")


def crd_validator(kind):
    with open(CRD_SCHEMAS) as f:
        root = json.load(f)
    schema = dict(root, **{"$ref": f"#/$defs/{kind}"})
    return jsonschema.Draft202012Validator(schema)


CRDS = {k: crd_validator(k) for k in ["ServiceMonitor", "PrometheusRule"]}


def validate(obj):
    """Errors of one object against its schema(s), [] when valid."""
    errors = []
    kind = obj.get("kind")
    if kind in CRDS:
        errors += [f"{kind}: {'.'.join(map(str, e.path))}: {e.message}"
                   for e in CRDS[kind].iter_errors(obj)]
        return errors
    for v in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{kind} {obj['metadata']['name']} (k8s {v}): {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"no schema for {kind} {obj.get('apiVersion')} (k8s {v})")
    return errors


def render(values):
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="kvfleet", namespace="llm", is_install=True)
    objs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objs.append((path, doc))
    return objs


def wants_gpu(values):
    """Whether the values give a worker `nvidia.com/gpu` (limits or requests)."""
    res = (values.get("worker") or {}).get("resources") or {}
    return any(int((res.get(k) or {}).get("nvidia.com/gpu", 0) or 0) > 0
               for k in ("limits", "requests"))


def gpu_flag_problems(values, worker_args):
    """What is wrong with the worker's CUDA flags for these values ([] when right)."""
    engine = (values.get("worker") or {}).get("engine") or {}
    util = engine.get("gpuMemoryUtilization", 0.9)
    blocks = engine.get("numBlocks")
    problems = []
    if wants_gpu(values):
        for flag in ["--device=cuda:0", f"--gpu-memory-utilization={util}"]:
            if flag not in worker_args:
                problems.append(f"GPU worker lacks {flag}")
    else:
        problems += [f"CPU worker has {a}" for a in worker_args
                     if a.startswith(("--device", "--gpu-memory-utilization"))]
    want_blocks = [f"--num-blocks={blocks}"] if blocks else []
    got_blocks = [a for a in worker_args if a.startswith("--num-blocks")]
    if got_blocks != want_blocks:
        problems.append(f"--num-blocks: want {want_blocks}, got {got_blocks}")
    return problems


def worker_args_of(values):
    objs = render(values)
    sts = [o for _, o in objs if o["kind"] == "StatefulSet" and "worker" in o["metadata"]["name"]][0]
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


def load_values(name):
    if name == DEFAULTS:
        return {}
    with open(os.path.join(CHART, "examples", f"{name}.yaml")) as f:
        return yaml.safe_load(f)


def main():
    report = {"helm_sdk": helm.helm_sdk_version(), "helm_c": helm.helm_c_version(),
              "kubernetes_validate": kubernetes_validate.__version__
              if hasattr(kubernetes_validate, "__version__") else "?",
              "kube_versions": KUBE_VERSIONS, "examples": {}, "negative": {}, "ok": True}
    for name in EXAMPLES + [DEFAULTS]:
        values = load_values(name)
        lint = helm.lint(CHART, values, strict=True, namespace="llm")
        # Severity 2 = warning, 3 = error; strict treats warnings as failures too.
        lint_problems = [m for m in lint["messages"] if m["severity"] >= 2] + lint["errors"]
        objs = render(values)
        kinds = {}
        errors = []
        for _, obj in objs:
            kinds[obj["kind"]] = kinds.get(obj["kind"], 0) + 1
            errors += validate(obj)
        entry = {"lint_problems": lint_problems, "objects": len(objs), "kinds": kinds,
                 "validation_errors": errors,
                 "ok": not lint_problems and not errors and len(objs) > 0}
        # What each example must show.
        deploy = [o for _, o in objs if o["kind"] == "Deployment"][0]
        sts = [o for _, o in objs if o["kind"] == "StatefulSet" and "worker" in o["metadata"]["name"]][0]
        entry["router_args"] = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        entry["worker_args"] = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        entry["config"] = [o for _, o in objs if o["kind"] == "ConfigMap"
                           and o["metadata"]["name"].endswith("-config")][0]["data"]
        entry["worker_replicas"] = sts["spec"]["replicas"]
        entry["worker_limits"] = sts["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        # A worker that asks for a GPU runs on it, sized from its memory; one that does
        # not gets no CUDA flags.
        entry["gpu_flags"] = gpu_flag_problems(values, entry["worker_args"])
        if entry["gpu_flags"]:
            entry["ok"] = False
        # Dashboards ship as sidecar-labelled ConfigMaps holding the JSON unchanged.
        shipped = {}
        for _, o in objs:
            if o["kind"] == "ConfigMap" and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1":
                for fname, text in o["data"].items():
                    with open(os.path.join(CHART, "dashboards", fname)) as f:
                        same = json.loads(text) == json.load(f)
                    shipped[fname] = same
        entry["dashboards"] = shipped
        dash_files = sorted(f for f in os.listdir(os.path.join(CHART, "dashboards")) if f.endswith(".json"))
        if sorted(shipped) != dash_files or not all(shipped.values()):
            entry["ok"] = False
        report["examples"][name] = entry
        report["ok"] &= entry["ok"]

    # GPU flags beyond the examples: a GPU in requests only, an explicit block count on
    # a GPU worker, another fraction.
    gpu = {"nvidia.com/gpu": 1}
    gpu_cases = {
        "gpu_in_requests_only": {"worker": {"resources": {"requests": gpu}}},
        "gpu_with_num_blocks": {"worker": {"resources": {"limits": gpu},
                                           "engine": {"numBlocks": 1000}}},
        "gpu_at_0_75": {"worker": {"resources": {"limits": gpu},
                                   "engine": {"gpuMemoryUtilization": 0.75}}},
        "cpu_with_num_blocks": {"worker": {"engine": {"numBlocks": 512}}},
    }
    report["gpu_cases"] = {}
    for case, values in gpu_cases.items():
        args = worker_args_of(values)
        problems = gpu_flag_problems(values, args)
        report["gpu_cases"][case] = {"worker_args": args, "problems": problems}
        report["ok"] &= not problems
    # The flag check itself fails on a wrong rendering (it is not vacuous).
    cpu_args = worker_args_of({})
    report["gpu_cases"]["check_catches_missing_device"] = {
        "caught": bool(gpu_flag_problems({"worker": {"resources": {"limits": gpu}}}, cpu_args))}
    report["ok"] &= report["gpu_cases"]["check_catches_missing_device"]["caught"]

    # KV tiers: flags and the disk tier's volume only when asked for; an emptyDir by
    # default, a shared claim, or a claim per worker.
    tier_cases = {
        "tiers_off": {},
        "host_only": {"worker": {"kvTiers": {"hostCacheGiB": 4}}},
        "disk_emptydir": {"worker": {"kvTiers": {"hostCacheGiB": 4,
                                                 "disk": {"enabled": True, "sizeGiB": 2.5}}}},
        "disk_existing_claim": {"worker": {"kvTiers": {"hostCacheGiB": 1.5, "disk": {
            "enabled": True, "existingClaim": "kv-cache"}}}},
        "disk_storage_class": {"worker": {"kvTiers": {"hostCacheGiB": 4, "disk": {
            "enabled": True, "sizeGiB": 100, "storageClass": "fast-ssd"}}}},
        "disk_enabled_host_off": {"worker": {"kvTiers": {"disk": {"enabled": True}}}},
    }
    report["tier_cases"] = {}
    for case, values in tier_cases.items():
        if case == "disk_enabled_host_off":
            continue
        objs = render(values)
        errors = [e for _, o in objs for e in validate(o)]
        sts = [o for _, o in objs if o["kind"] == "StatefulSet" and "worker" in o["metadata"]["name"]][0]
        pod = sts["spec"]["template"]["spec"]
        report["tier_cases"][case] = {
            "worker_args": pod["containers"][0]["args"],
            "mounts": [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kv-disk"],
            "volumes": [v for v in pod["volumes"] if v["name"] == "kv-disk"],
            "claim_templates": sts["spec"].get("volumeClaimTemplates", []),
            "validation_errors": errors,
        }
        report["ok"] &= not errors

    # Peer pulls: the router flag only when set, and while pulls are on (the router's
    # default) the NetworkPolicy lets workers reach each other's gRPC port (FetchBlocks).
    pull_cases = {"pulls_default": ({}, None, True),
                  "pulls_off": ({"peerPullMinBlocks": 0}, "--peer-pull-min-blocks=0", False),
                  "pulls_at_8": ({"peerPullMinBlocks": 8}, "--peer-pull-min-blocks=8", True)}
    report["pull_cases"] = {}
    for case, (router, flag, peers) in pull_cases.items():
        objs = render({"router": router, "networkPolicy": {"enabled": True}})
        errors = [e for _, o in objs for e in validate(o)]
        args = [o for _, o in objs if o["kind"] == "Deployment"][0][
            "spec"]["template"]["spec"]["containers"][0]["args"]
        flags = [a for a in args if a.startswith("--peer-pull-min-blocks")]
        policy = [o for _, o in objs if o["kind"] == "NetworkPolicy"
                  and o["metadata"]["name"].endswith("-worker")][0]
        grpc_from = [f["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                     for f in policy["spec"]["ingress"][0]["from"]]
        ok = (not errors and flags == ([flag] if flag else [])
              and grpc_from == (["router", "worker"] if peers else ["router"]))
        report["pull_cases"][case] = {"router_flags": flags, "grpc_from": grpc_from,
                                      "validation_errors": errors, "ok": ok}
        report["ok"] &= ok

    # `cache-aware` weights: one flag holding them as JSON, none when left empty.
    weight_cases = {"weights_default": ({}, []),
                    "weights_set": ({"cacheAwareConfig": {"idle_prefill_weight": 1.2}},
                                    ['--cache-aware-config={"idle_prefill_weight":1.2}'])}
    report["weight_cases"] = {}
    for case, (router, want) in weight_cases.items():
        objs = render({"router": router})
        errors = [e for _, o in objs for e in validate(o)]
        args = [o for _, o in objs if o["kind"] == "Deployment"][0][
            "spec"]["template"]["spec"]["containers"][0]["args"]
        flags = [a for a in args if a.startswith("--cache-aware-config")]
        ok = not errors and flags == want
        report["weight_cases"][case] = {"router_flags": flags, "validation_errors": errors,
                                        "ok": ok}
        report["ok"] &= ok

    # The chart refuses combinations that cannot work.
    bad_values = {
        "two_routers_without_etcd": ({"router": {"replicas": 2}}, "more than one router"),
        "kafka_without_etcd": ({"kafka": {"brokers": ["k:9092"]}}, "needs etcd"),
        "model_dir_without_volume": ({"config": {"model": "/models/x"}}, "modelVolume"),
        "two_gpus_per_worker": ({"worker": {"resources": {"limits": {"nvidia.com/gpu": 2}}}},
                                "one GPU"),
        "gpu_utilization_above_1": ({"worker": {"engine": {"gpuMemoryUtilization": 1.5}}},
                                    "gpuMemoryUtilization"),
        "gpu_utilization_0": ({"worker": {"engine": {"gpuMemoryUtilization": 0}}},
                              "gpuMemoryUtilization"),
        "disk_tier_without_host_tier": (tier_cases["disk_enabled_host_off"],
                                        "needs a host tier above it"),
        "negative_host_cache": ({"worker": {"kvTiers": {"hostCacheGiB": -1}}}, "hostCacheGiB"),
    }
    for case, (values, why) in bad_values.items():
        try:
            render(values)
            refused = False
        except helm.HelmError as e:
            refused = why in str(e)
        report["negative"][case] = {"refused": refused}
        report["ok"] &= refused

    # The schemas reject a broken object (proves validation is not vacuous).
    objs = render(load_values("values-2routers-8gpu"))
    deploy = copy.deepcopy([o for _, o in objs if o["kind"] == "Deployment"][0])
    deploy["spec"]["replicas"] = "two"
    deploy["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    rule = copy.deepcopy([o for _, o in objs if o["kind"] == "PrometheusRule"][0])
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    monitor = copy.deepcopy([o for _, o in objs if o["kind"] == "ServiceMonitor"][0])
    monitor["spec"]["endpoints"][0]["intervall"] = "10s"
    for case, obj in [("deployment_bad_fields", deploy), ("prometheusrule_bad_duration", rule),
                      ("servicemonitor_unknown_field", monitor)]:
        errs = validate(obj)
        report["negative"][case] = {"rejected": bool(errs), "errors": errs[:2]}
        report["ok"] &= bool(errs)

    json.dump(report, sys.stdout, indent=2)
    print()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
