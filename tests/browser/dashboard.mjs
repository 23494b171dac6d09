// Drives real headless Chromium (Debian's `chromium`) against a router's /dashboard for
// tests/e2e_dashboard.rs, which makes the assertions. Usage:
//
//   node dashboard.mjs URL SCREENSHOT.png SAMPLE_MS
//
// Phase 1 (traffic running): samples what the page shows every 500 ms for SAMPLE_MS,
// takes a full-page screenshot, prints `PHASE1 <json>`. Then it waits for a line on
// stdin (the test has stopped the router), samples for 3 s more and prints
// `PHASE2 <json>`. Each sample reads only the DOM: what a person would see.
import { chromium } from "playwright-core";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";

const [url, shot, sampleMsArg] = process.argv.slice(2);
const sampleMs = Number(sampleMsArg || 4000);
const executablePath = process.env.KVFLEET_CHROMIUM || "/usr/bin/chromium";
const profile = mkdtempSync(join(tmpdir(), "kvfleet-chromium-"));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function sample() {
  const b = document.body;
  const rows = [...document.querySelectorAll("#feed tr[data-seq]")];
  return {
    t: Date.now(),
    title: document.title,
    updates: Number(b.dataset.updates),
    state: b.dataset.state,
    lastSeq: Number(b.dataset.lastSeq),
    updatedText: document.getElementById("updated").textContent,
    feed: rows.map((r) => ({
      seq: Number(r.dataset.seq),
      requestId: r.dataset.requestId,
      worker: r.dataset.worker,
      group: r.dataset.group,
      forkGroup: r.dataset.forkGroup,
      cached: r.dataset.cached === "" ? null : Number(r.dataset.cached),
    })),
    workers: [...document.querySelectorAll(".wcard")].map((w) => ({
      id: w.dataset.workerId,
      hitRatio: Number(w.dataset.hitRatio),
      routed: Number(w.dataset.routed),
    })),
    // The KV tiers table: "on"/"off", and per row (the fleet's, then each worker's)
    // the raw counts it renders and the text shown for the bytes moved.
    tiers: document.getElementById("tiers").dataset.tiers,
    tiersText: document.getElementById("tiersbody").textContent,
    tierRows: [...document.querySelectorAll("#tiers tr[data-tier-row]")].map((r) => ({
      id: r.dataset.tierRow,
      tiered: Number(r.dataset.tiered),
      hits: {
        device: Number(r.dataset.hitsDevice),
        host: Number(r.dataset.hitsHost),
        disk: Number(r.dataset.hitsDisk),
        peer: Number(r.dataset.hitsPeer),
      },
      bytes: {
        demoted: Number(r.dataset.bytesDemoted),
        promoted: Number(r.dataset.bytesPromoted),
        peer: Number(r.dataset.bytesPeer),
      },
      promotedHostBlocks: Number(r.dataset.promotedHostBlocks),
      demotedBlocks: Number(r.dataset.demotedBlocks),
      hostHitsText: r.querySelector(".hits-host").textContent,
      bytesText: {
        demoted: r.querySelector(".bytes-demoted").textContent,
        promoted: r.querySelector(".bytes-promoted").textContent,
        peer: r.querySelector(".bytes-peer").textContent,
      },
    })),
    heat: [...document.querySelectorAll("#heat tr[data-group]")].map((r) => ({
      group: r.dataset.group,
      label: r.dataset.label,
      cells: Object.fromEntries(
        [...r.querySelectorAll("td[data-worker]")].map((c) => [c.dataset.worker, Number(c.dataset.held)]),
      ),
    })),
  };
}

async function samples(page, ms) {
  const out = [];
  const end = Date.now() + ms;
  do {
    out.push(await page.evaluate(sample));
    await sleep(500);
  } while (Date.now() < end);
  out.push(await page.evaluate(sample));
  return out;
}

// A fresh profile directory per run (playwright passes it as --user-data-dir).
const browser = await chromium.launchPersistentContext(profile, {
  executablePath,
  headless: true,
  args: [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
  ],
  viewport: { width: 1680, height: 1050 },
  colorScheme: "dark",
  timeout: 60_000,
});
try {
  const page = browser.pages()[0] || (await browser.newPage());
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(`${url}/dashboard`, { waitUntil: "load", timeout: 30_000 });
  await page.waitForFunction(() => Number(document.body.dataset.updates) >= 1, null, { timeout: 20_000 });
  const phase1 = await samples(page, sampleMs);
  await page.screenshot({ path: shot, fullPage: true });
  console.log("PHASE1 " + JSON.stringify({ samples: phase1, errors }));
  // Wait for the test to stop the router (or close our stdin).
  const rl = createInterface({ input: process.stdin });
  await new Promise((resolve) => { rl.once("line", resolve); rl.once("close", resolve); });
  rl.close();
  const phase2 = await samples(page, 3000);
  console.log("PHASE2 " + JSON.stringify({ samples: phase2, errors }));
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
