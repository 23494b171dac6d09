#!/usr/bin/env python3
"""Cross-worker prefix transfer vs recompute, on the real default model.

Starts two `kvfleet worker` processes and a `kvfleet router` with its defaults (peer
pulls on), then for each size in TOKENS (comma-separated), REPS fresh prompts of about
that many tokens:
  1. sends it to one worker (cold: the whole prompt is computed there);
  2. sends it again, round-robin, so it lands on the other worker, which pulls the
     prefix blocks from the first over gRPC (FetchBlocks) instead of recomputing;
  3. sends it a third time: back on the first worker, a local cache hit;
and reports the latencies (max_tokens=1, so latency ~ TTFT) side by side in one run:
what the pull adds over a local hit (transfer and both engines' hand-offs) against
what recomputing adds, the ratio the router's default pull minimum rests on
(`DEFAULT_PEER_PULL_MIN_TOKENS`). Then the `idle-wait` trigger with `cache-aware`: a
fresh prompt is computed on one worker, that worker is given a long cold prompt
(BUSY_TOKENS), and the fresh prompt is sent again while the long one is in prefill; it
should go to the idle worker and pull its prefix there rather than queue behind the
long prefill.
Usage: scripts/bench_peer_pull.py [BIN] (default target/release/kvfleet).
"""
import json, os, subprocess, sys, threading, time, urllib.request

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/kvfleet"
# Prompt sizes in SmolLM2 tokens (about 1.3 per word).
SIZES = [int(x) for x in os.environ.get("TOKENS", "64,500,2070").split(",")]
TOKENS = SIZES[-1]
REPS = int(os.environ.get("REPS", "3"))
BUSY_TOKENS = int(os.environ.get("BUSY_TOKENS", "6000"))


def start(args, scheme):
    p = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    addr = next(w for w in line.split() if w.startswith(scheme))[len(scheme):]
    return p, addr


def words(seed, n):
    # About 1.3 tokens per word for SmolLM2's tokenizer; trimmed by the server's count.
    vocab = ["agent", "tool", "result", "prefix", "cache", "worker", "router", "block",
             "token", "stream", "fleet", "memory", "transfer", "compute", "request"]
    x = seed * 2654435761 + 7
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(vocab[(x >> 33) % len(vocab)])
    return " ".join(out)


MODEL = None


def ask(url, text, policy="round-robin"):
    global MODEL
    if MODEL is None:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            MODEL = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}],
                       "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"content-type": "application/json",
                                  "x-kvfleet-policy": policy})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        data = json.load(r)
        worker = r.headers.get("x-kvfleet-worker")
    return time.perf_counter() - t, worker, data["usage"]


def main():
    procs = []
    try:
        w0, a0 = start(["worker", "--grpc", "127.0.0.1:0", "--worker-id", "w0"], "grpc://")
        w1, a1 = start(["worker", "--grpc", "127.0.0.1:0", "--worker-id", "w1"], "grpc://")
        procs += [w0, w1]
        r, ra = start(["router", "--http", "127.0.0.1:0", "--workers", f"{a0},{a1}"],
                      "http://")
        procs.append(r)
        url = "http://" + ra
        ask(url, "warm up")
        ask(url, "warm up too")
        rows = []
        for k, size in enumerate(SIZES):
            for i in range(REPS):
                text = words(100 + 10 * k + i, max(1, int(size / 1.3)))
                cold_t, cw, cu = ask(url, text)
                time.sleep(1.0)  # the router's index learns the first worker's blocks
                pull_t, pw, pu = ask(url, text)
                time.sleep(0.3)
                hit_t, hw, _ = ask(url, text)
                if hw != cw:  # round-robin out of step: not a local hit
                    continue
                rows.append((cu["prompt_tokens"], cold_t, cw, pull_t, pw,
                             pu["prompt_tokens_details"]["cached_tokens"], hit_t))
        print("| prompt tokens | cold (s) | worker | pulled (s) | worker | cached | local hit (s) "
              "| pull adds (ms) | recompute adds (ms) | cold ÷ pulled |")
        print("|---:|---:|---|---:|---|---:|---:|---:|---:|---:|")
        for p, ct, cw, pt, pw, c, ht in rows:
            print(f"| {p} | {ct:.3f} | {cw} | {pt:.3f} | {pw} | {c} | {ht:.3f} | "
                  f"{(pt - ht) * 1000:.1f} | {(ct - ht) * 1000:.1f} | {ct / pt:.1f}× |")

        # The idle-wait trigger: the holder busy with a long cold prefill.
        text = words(900, int(TOKENS / 1.3))
        cold_t, holder, cu = ask(url, text)
        _, other, _ = ask(url, "advance round-robin to the holder")
        time.sleep(1.0)
        busy = {}
        long_text = words(901, int(BUSY_TOKENS / 1.3))
        t = threading.Thread(target=lambda: busy.update(r=ask(url, long_text)))
        t.start()
        time.sleep(0.3)
        moved_t, mw, mu = ask(url, text, "cache-aware")
        t.join()
        busy_t, bw, bu = busy["r"]
        print()
        print("| request | worker | prompt tokens | cached | latency (s) |")
        print("|---|---|---:|---:|---:|")
        print(f"| fresh prompt, cold | {holder} | {cu['prompt_tokens']} | 0 | {cold_t:.3f} |")
        print(f"| long cold prompt on the holder | {bw} | {bu['prompt_tokens']} | "
              f"{bu['prompt_tokens_details']['cached_tokens']} | {busy_t:.3f} |")
        print(f"| fresh prompt again, cache-aware, while the holder is busy | {mw} | "
              f"{mu['prompt_tokens']} | {mu['prompt_tokens_details']['cached_tokens']} | "
              f"{moved_t:.3f} |")
        ok = mw == other and bw == holder
        print(f"\nmoved to the idle worker and pulled: {'yes' if ok else 'no'}")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()
