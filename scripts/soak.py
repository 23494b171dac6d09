#!/usr/bin/env python3
"""Soak client for scripts/soak.sh: calibrates the sustainable rate of a running
`kvfleet up` with a short closed loop, then replays an open loop at RATE_FACTOR x that
rate for SOAK_SECONDS, sampling the server's RSS every second from /proc/PID/status.

Every request is accounted for: ok (200), refused (429), failed (other status, error or
timeout: each request has a deadline, none can hang). lost = sent - ok - refused - failed
must be 0. Writes docs/soak.json and docs/plots/soak-rss.svg.
"""
import concurrent.futures as cf
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request

URL = os.environ["SOAK_URL"]
PID = int(os.environ["SOAK_PID"])
SECONDS = float(os.environ.get("SOAK_SECONDS", "600"))
FACTOR = float(os.environ.get("RATE_FACTOR", "2"))
CALIBRATE_S = float(os.environ.get("CALIBRATE_SECONDS", "15"))
TIMEOUT_S = float(os.environ.get("REQUEST_TIMEOUT", "60"))
MAX_INFLIGHT = int(os.environ.get("MAX_INFLIGHT", "1024"))
OUT_JSON = os.environ.get("SOAK_JSON", "docs/soak.json")
OUT_SVG = os.environ.get("SOAK_SVG", "docs/plots/soak-rss.svg")

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()


def body(i):
    rng = random.Random(i)
    # 16 shared prefixes (sessions), each turn a new tail: the cache-aware path runs.
    prefix = " ".join(random.Random(i % 16).choice(WORDS) for _ in range(60))
    tail = " ".join(rng.choice(WORDS) for _ in range(20))
    return json.dumps({
        "model": "tiny",
        "messages": [{"role": "user", "content": prefix + " " + tail}],
        "max_tokens": 16,
        "temperature": 0,
    }).encode()


def one(i):
    req = urllib.request.Request(URL + "/v1/chat/completions", data=body(i),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            r.read()
            return "ok" if r.status == 200 else "failed"
    except urllib.error.HTTPError as e:
        return "refused" if e.code == 429 else "failed"
    except Exception:
        return "failed"


def rss_kb():
    try:
        with open(f"/proc/{PID}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def calibrate():
    done = 0
    stop = time.time() + CALIBRATE_S
    lock = threading.Lock()

    def worker(k):
        nonlocal done
        i = k * 1_000_000
        while time.time() < stop:
            if one(i) == "ok":
                with lock:
                    done += 1
            i += 1

    t0 = time.time()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return done / (time.time() - t0)


def svg(samples, path):
    if not samples:
        return
    w, h, pad = 720, 300, 50
    t_max = max(s[0] for s in samples) or 1
    r_max = max(s[1] for s in samples) / 1024 or 1
    pts = " ".join(f"{pad + (t / t_max) * (w - 2 * pad):.1f},{h - pad - (r / 1024 / r_max) * (h - 2 * pad):.1f}"
                   for t, r in samples)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">\n'
                f'<rect width="{w}" height="{h}" fill="white"/>\n'
                f'<text x="{w/2}" y="20" text-anchor="middle">kvfleet up RSS during the soak (MiB)</text>\n'
                f'<line x1="{pad}" y1="{h-pad}" x2="{w-pad}" y2="{h-pad}" stroke="black"/>\n'
                f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h-pad}" stroke="black"/>\n'
                f'<text x="{pad}" y="{h-pad+15}">0 s</text><text x="{w-pad}" y="{h-pad+15}" text-anchor="end">{t_max:.0f} s</text>\n'
                f'<text x="{pad-5}" y="{pad}" text-anchor="end">{r_max:.0f}</text><text x="{pad-5}" y="{h-pad}" text-anchor="end">0</text>\n'
                f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>\n</svg>\n')


def main():
    sustainable = calibrate()
    rate = max(sustainable * FACTOR, 0.5)
    print(f"calibration: {sustainable:.2f} req/s sustainable; open loop at {rate:.2f} req/s for {SECONDS:.0f} s", flush=True)
    counts = {"ok": 0, "refused": 0, "failed": 0}
    lock = threading.Lock()
    samples = []
    sent = 0
    shed = 0  # never sent: the client's own in-flight cap (reported, not hidden)
    stop_sampling = threading.Event()
    t0 = time.time()

    def sampler():
        while not stop_sampling.is_set():
            r = rss_kb()
            if r is not None:
                samples.append((time.time() - t0, r))
            stop_sampling.wait(1.0)

    def record(fut):
        with lock:
            counts[fut.result()] += 1

    st = threading.Thread(target=sampler)
    st.start()
    pool = cf.ThreadPoolExecutor(max_workers=MAX_INFLIGHT)
    rng = random.Random(7)
    next_t = t0
    i = 0
    while time.time() - t0 < SECONDS:
        next_t += rng.expovariate(rate)
        delay = next_t - time.time()
        if delay > 0:
            time.sleep(delay)
        with lock:
            inflight = sent - sum(counts.values())
        if inflight >= MAX_INFLIGHT:
            shed += 1
            continue
        sent += 1
        pool.submit(one, i).add_done_callback(record)
        i += 1
    pool.shutdown(wait=True)
    stop_sampling.set()
    st.join()
    alive = rss_kb() is not None
    rss = [r for _, r in samples]
    answered = sum(counts.values())
    out = {
        "seconds": SECONDS,
        "sustainable_rps": round(sustainable, 3),
        "offered_rps": round(rate, 3),
        "sent": sent,
        "ok": counts["ok"],
        "refused_429": counts["refused"],
        "failed": counts["failed"],
        "lost": sent - answered,
        "client_shed": shed,
        "rss_mib": {
            "min": round(min(rss) / 1024, 1) if rss else None,
            "max": round(max(rss) / 1024, 1) if rss else None,
            "last": round(rss[-1] / 1024, 1) if rss else None,
        },
        "rss_samples": [[round(t, 1), r] for t, r in samples],
        "server_alive_at_end": alive,
    }
    os.makedirs(os.path.dirname(OUT_JSON), exist_ok=True)
    with open(OUT_JSON, "w") as f:
        json.dump(out, f)
    svg(samples, OUT_SVG)
    summary = {k: v for k, v in out.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=1))
    ok = out["lost"] == 0 and alive
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
