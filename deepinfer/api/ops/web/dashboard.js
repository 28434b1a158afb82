// The live operations dashboard: reads the `v1/stats/stream` snapshots (see stats_schema.py),
// derives rates from consecutive snapshots (dashboard_rates.js), and updates the cards
// (dashboard_render.js) and charts (dashboard_charts.js) in place. This module keeps the
// stream going: reconnecting with backoff, pausing, and restarting on a new API key.

import { ApiError, apiFetch, apiKey, askForKey, sseData } from "./common.js";
import { makeCharts } from "./dashboard_charts.js";
import { setAttr, setText, show } from "./dashboard_dom.js";
import { SnapshotRates } from "./dashboard_rates.js";
import { makeTables, renderSnapshot } from "./dashboard_render.js";

const STREAM_PATH = "v1/stats/stream?interval_s=1";
const STALL_MS = 6000; // no snapshot for this long: reconnect
const BACKOFF_MS = [1000, 2000, 4000, 8000, 15000];

const $ = (id) => document.getElementById(id);

const derived = new SnapshotRates();
let tables = null; // the keyed table bodies, see makeTables
let charts = null;

/** Apply one snapshot to the page. */
function onSnapshot(s) {
  const { r, hits } = derived.next(s);
  renderSnapshot(s, r, hits, tables);
  charts.record(s, r);
}

// ---------------------------------------------------------------- the stream

let paused = false;
let restart = false; // reconnect at once (a new key)
let controller = null;
let wake = null; // resolves the current wait early

/** Wait `ms` (Infinity: until woken), or less when `wakeUp()` is called. */
function pause(ms) {
  return new Promise((resolve) => {
    const timer = Number.isFinite(ms) ? setTimeout(resolve, ms) : 0;
    wake = () => {
      clearTimeout(timer);
      resolve();
    };
  });
}

function wakeUp() {
  const w = wake;
  wake = null;
  if (w) w();
}

const STATUS_TEXT = { connecting: "connecting…", live: "live", reconnecting: "reconnecting…", paused: "paused" };

function setStatus(state) {
  const node = $("stream-status");
  setAttr(node, "data-state", state);
  setText(node, STATUS_TEXT[state]);
  document.body.dataset.stream = state;
}

function showError(message) {
  const node = $("error");
  setText(node, message);
  show(node, Boolean(message));
}

/** Read the stream until it ends, fails, stalls or is paused. */
async function readStream() {
  controller = new AbortController();
  const mine = controller;
  let stall = 0;
  const armStall = () => {
    clearTimeout(stall);
    stall = setTimeout(() => mine.abort(new Error("no snapshot for a while")), STALL_MS);
  };
  armStall();
  try {
    const response = await apiFetch(STREAM_PATH, {
      headers: { accept: "text/event-stream" },
      cache: "no-store",
      signal: mine.signal,
    });
    for await (const data of sseData(response)) {
      armStall();
      const snapshot = JSON.parse(data);
      if (snapshot.error) throw new Error(snapshot.error.message || "the server reported an error");
      if (paused) return;
      setStatus("live");
      showError("");
      onSnapshot(snapshot);
    }
    throw new Error("the stream ended");
  } catch (err) {
    throw mine.signal.aborted && mine.signal.reason instanceof Error ? mine.signal.reason : err;
  } finally {
    clearTimeout(stall);
    mine.abort();
  }
}

async function run() {
  let attempt = 0;
  for (;;) {
    if (paused) {
      setStatus("paused");
      await pause(Infinity);
      continue;
    }
    setStatus(attempt === 0 && !derived.previous ? "connecting" : "reconnecting");
    const started = Date.now();
    restart = false;
    try {
      await readStream();
    } catch (err) {
      if (paused) continue;
      if (restart) {
        restart = false;
        continue;
      }
      if (Date.now() - started > 10000) attempt = 0; // it was live for a while
      if (err instanceof ApiError && err.status === 401) {
        setStatus("reconnecting");
        showError("The stats need an API key: press Key to enter it.");
        await pause(Infinity);
        continue;
      }
      const delay = BACKOFF_MS[Math.min(attempt, BACKOFF_MS.length - 1)];
      attempt++;
      setStatus("reconnecting");
      showError(`Stats stream: ${err.message || err}. Retrying in ${Math.round(delay / 1000)} s.`);
      await pause(delay * (0.8 + Math.random() * 0.4));
      continue;
    }
    attempt = 0;
  }
}

function togglePause() {
  paused = !paused;
  const button = $("pause");
  button.setAttribute("aria-pressed", String(paused));
  button.textContent = paused ? "Resume" : "Pause";
  if (paused) {
    controller?.abort();
    setStatus("paused");
  }
  wakeUp();
}

async function changeKey() {
  const before = apiKey();
  if ((await askForKey()) || apiKey() !== before) {
    restart = true;
    controller?.abort();
    wakeUp();
  }
}

function init() {
  tables = makeTables();
  charts = makeCharts();
  $("pause").addEventListener("click", togglePause);
  $("key-button").addEventListener("click", changeKey);
  $("key-cancel").addEventListener("click", () => $("key-dialog").dispatchEvent(new Event("cancel")));
  window.addEventListener("storage", (e) => {
    if (e.key === null || e.key.endsWith("apiKey")) wakeUp();
  });
  run();
}

init();
