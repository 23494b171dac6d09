#!/usr/bin/env python3
"""Side-by-side benchmark of kvfleet against llama.cpp and torch (transformers) on the same
GGUF, on the same machine, in one run: every contender is measured in every round, rounds
alternate, and the report gives medians. Run by scripts/bench/vs-llamacpp.sh; not run in CI.

Measured (tokens/s unless noted):
  pp512, pp2048      prompt processing (one prompt, nothing cached)
  tg128              decode at batch 1
  agg4, agg8         aggregate decode over 4 / 8 concurrent streams (HTTP servers)
  ttft_cold_s, ttft_cached_s   TTFT of a ~1,900-token prompt, first and repeated (HTTP)
  fork_*             five children sharing a ~1,800-token prefix with ~50-token tails, sent at
                     once: prompt tokens computed in all, each child's TTFT (HTTP)
"""
import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

# --- prompts as token ids: identical bytes for every contender ------------------------------

def token_prompt(rng, n, vocab_lo=300, vocab_hi=40000):
    return [rng.randrange(vocab_lo, vocab_hi) for _ in range(n)]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_http(url, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {timeout}s")


def sse_lines(resp):
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


class Server:
    """An HTTP server under test; `complete` streams one completion of `ids` and returns
    (ttft_s, total_s, generated_tokens, prompt_tokens_computed)."""

    def __init__(self, name, cmd, health, env=None):
        self.name, self.cmd, self.health = name, cmd, health
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        wait_http(health)

    def rss_mib(self):
        """Resident memory of the server process (kvfleet up: router and worker in one)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return None

    def stop(self):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)


class LlamaServer(Server):
    def __init__(self, bin_dir, gguf, slots, threads, ctx_per_slot=2600):
        self.port = free_port()
        super().__init__("llama.cpp", [
            os.path.join(bin_dir, "llama-server"), "-m", gguf, "--host", "127.0.0.1",
            "--port", str(self.port), "-np", str(slots), "-t", str(threads),
            "-c", str(slots * ctx_per_slot), "--no-webui"],
            f"http://127.0.0.1:{self.port}/health",
            env={**os.environ, "LD_LIBRARY_PATH": bin_dir})

    def complete(self, ids, max_tokens):
        body = {"prompt": ids, "n_predict": max_tokens, "stream": True, "cache_prompt": True,
                "ignore_eos": True, "temperature": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        ttft, n, computed = None, 0, None
        with urllib.request.urlopen(req, timeout=600) as resp:
            for ev in sse_lines(resp):
                if ev.get("content") or ev.get("tokens"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    n += max(1, len(ev.get("tokens") or []))
                if ev.get("stop"):
                    # A lone token that decodes to no text (a partial UTF-8 sequence of
                    # random ids) arrives with the final event only.
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    computed = ev.get("timings", {}).get("prompt_n")
                    n = ev.get("timings", {}).get("predicted_n", n)
                    break
        return ttft, time.perf_counter() - t0, n, computed


class KvfleetServer(Server):
    def __init__(self, kvfleet_bin, model, workers, extra=()):
        self.port = free_port()
        super().__init__("kvfleet", [
            kvfleet_bin, "up", "--workers", str(workers), "--model", model,
            "--http", f"127.0.0.1:{self.port}", *extra],
            f"http://127.0.0.1:{self.port}/health")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=10) as r:
            self.model_id = json.load(r)["data"][0]["id"]

    def complete(self, ids, max_tokens):
        body = {"model": self.model_id, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        ttft, n, computed = None, 0, None
        with urllib.request.urlopen(req, timeout=600) as resp:
            for ev in sse_lines(resp):
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                usage = ev.get("usage")
                if usage and ttft is None:
                    ttft = time.perf_counter() - t0
                if usage:
                    n = usage["completion_tokens"]
                    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        return ttft, time.perf_counter() - t0, n, computed


def concurrent(server, prompts, max_tokens):
    results = [None] * len(prompts)

    def run(i):
        results[i] = server.complete(prompts[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def http_cases(server, rng):
    out = {}
    for streams in (4, 8):
        prompts = [token_prompt(rng, 32) for _ in range(streams)]
        res, wall = concurrent(server, prompts, 128)
        out[f"agg{streams}"] = sum(r[2] for r in res) / wall
    long = token_prompt(rng, 1900)
    out["ttft_cold_s"] = server.complete(long, 1)[0]
    out["ttft_cached_s"] = server.complete(long, 1)[0]
    prefix = token_prompt(rng, 1800)
    kids = [prefix + token_prompt(rng, 50) for _ in range(5)]
    res, _ = concurrent(server, kids, 1)
    out["fork_ttft_s"] = [r[0] for r in res]
    out["fork_max_ttft_s"] = max(r[0] for r in res)
    out["fork_prompt_tokens_computed"] = sum((r[3] or 0) for r in res)
    # One cold request of a child's length, for the fork ratio.
    out["fork_cold_ttft_s"] = server.complete(token_prompt(rng, 1850), 1)[0]
    out["fork_slowest_over_cold"] = out["fork_max_ttft_s"] / out["fork_cold_ttft_s"]
    out["rss_mib"] = server.rss_mib()
    return out


def llama_bench(bin_dir, gguf, threads):
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "512,2048",
           "-n", "128", "-r", "2", "-o", "json"]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                    env={**os.environ, "LD_LIBRARY_PATH": bin_dir}).stdout)
    out = {}
    for r in res:
        if r["n_gen"] == 0:
            out[f"pp{r['n_prompt']}"] = r["avg_ts"]
        else:
            out[f"tg{r['n_gen']}"] = r["avg_ts"]
    return out


def kvfleet_engine_bench(kvfleet_bin, model):
    res = subprocess.run([kvfleet_bin, "bench", "model", "--model", model, "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout)


def torch_bench(python, gguf, threads):
    here = os.path.dirname(os.path.abspath(__file__))
    res = subprocess.run([python, os.path.join(here, "torch_bench.py"), gguf, str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def median_of(rounds):
    keys = {k for r in rounds for k, v in r.items() if isinstance(v, (int, float))}
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in sorted(keys)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvfleet", required=True)
    ap.add_argument("--llamacpp", required=True, help="folder with llama-bench, llama-server")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--model", default=None, help="kvfleet --model (default: --gguf)")
    ap.add_argument("--torch-python", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = args.model or args.gguf
    rng = random.Random(1234)
    rounds = {"llama.cpp": [], "kvfleet": [], "torch": []}
    for rnd in range(args.rounds):
        order = ["llama.cpp", "kvfleet", "torch"]
        if rnd % 2:
            order.reverse()
        for who in order:
            t0 = time.time()
            if who == "llama.cpp":
                r = llama_bench(args.llamacpp, args.gguf, args.threads)
                srv = LlamaServer(args.llamacpp, args.gguf, slots=8, threads=args.threads)
                try:
                    r.update(http_cases(srv, rng))
                finally:
                    srv.stop()
            elif who == "kvfleet":
                r = kvfleet_engine_bench(args.kvfleet, model)
                srv = KvfleetServer(args.kvfleet, model, workers=1)
                try:
                    r.update(http_cases(srv, rng))
                finally:
                    srv.stop()
            else:
                if not args.torch_python:
                    continue
                r = torch_bench(args.torch_python, args.gguf, args.threads)
            rounds[who].append(r)
            print(f"round {rnd} {who} ({time.time() - t0:.0f}s): {json.dumps(r)}", file=sys.stderr,
                  flush=True)
    report = {"gguf": os.path.basename(args.gguf), "threads": args.threads, "rounds": rounds,
              "median": {k: median_of(v) for k, v in rounds.items() if v}}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    med = report["median"]
    keys = ["pp512", "pp2048", "tg128", "agg4", "agg8", "ttft_cold_s", "ttft_cached_s",
            "fork_max_ttft_s", "fork_cold_ttft_s", "fork_slowest_over_cold",
            "fork_prompt_tokens_computed", "rss_mib"]
    print("| metric | " + " | ".join(med) + " | kvfleet / llama.cpp |")
    print("|---|" + "---|" * (len(med) + 1))
    for k in keys:
        vals = [med[w].get(k) for w in med]
        ratio = ""
        if med.get("kvfleet", {}).get(k) and med.get("llama.cpp", {}).get(k):
            ratio = f"{med['kvfleet'][k] / med['llama.cpp'][k]:.2f}"
        print(f"| {k} | " + " | ".join("" if v is None else f"{v:.3g}" for v in vals) + f" | {ratio} |")


if __name__ == "__main__":
    main()
