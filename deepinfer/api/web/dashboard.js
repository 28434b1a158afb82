// The live operations dashboard: reads the `v1/stats/stream` snapshots (see stats_schema.py),
// derives rates from consecutive snapshots, and updates the page in place.

import { ApiError, apiKey, askForKey, compact, formatBytes, sseData, apiFetch } from "./common.js";
import { RingSeries, TimeChart } from "./charts.js";

const STREAM_PATH = "v1/stats/stream?interval_s=1";
const WINDOW_S = 300; // seconds of history in the charts
const CAPACITY = 360; // samples kept per chart (1 per second, with slack)
const HIT_WINDOW_S = 10; // window of the cache hit share
const GAP_S = 5; // a longer step between snapshots restarts the rates
const STALL_MS = 6000; // no snapshot for this long: reconnect
const BACKOFF_MS = [1000, 2000, 4000, 8000, 15000];

const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- formatting

const integer = new Intl.NumberFormat(undefined, { maximumFractionDigits: 0 });

function isMissing(v) {
  return v === null || v === undefined || Number.isNaN(v);
}

/** A count with grouping: "12,345". */
function formatCount(n) {
  return isMissing(n) ? "–" : integer.format(n);
}

/** Tokens per second: "8.4", "356", "12.3k". */
function formatRate(v) {
  if (isMissing(v)) return "–";
  if (v === 0) return "0";
  if (v >= 10000) return compact(v);
  if (v >= 100) return integer.format(v);
  return v.toFixed(1);
}

/** A duration in ms: "4.2 ms", "123 ms", "1.25 s". */
function formatMs(ms) {
  if (isMissing(ms)) return "–";
  if (ms >= 1000) return `${Number((ms / 1000).toPrecision(3))} s`;
  if (ms >= 10) return `${Math.round(ms)} ms`;
  return `${ms.toFixed(ms < 1 ? 2 : 1)} ms`;
}

/** A share 0..1 as "87.3%". */
function formatShare(v) {
  return isMissing(v) ? "–" : `${(v * 100).toFixed(1)}%`;
}

/** A length of time: "42 s", "5.2 min", "3.1 h", "6.9 days". */
function formatSpan(seconds) {
  const s = Math.abs(seconds);
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${(s / 60).toFixed(1)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  const days = s / 86400;
  return `${days.toFixed(1)} ${days.toFixed(1) === "1.0" ? "day" : "days"}`;
}

/** A time relative to `now` (Unix seconds): "in 6.9 days", "3.0 h ago". */
function formatRelative(at, now) {
  if (isMissing(at)) return "–";
  const delta = at - now;
  if (Math.abs(delta) < 1) return "now";
  return delta > 0 ? `in ${formatSpan(delta)}` : `${formatSpan(delta)} ago`;
}

/** Uptime: "42 s", "12 min", "3 h 05 min", "2 d 4 h". */
function formatUptime(s) {
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function formatDays(seconds) {
  const days = seconds / 86400;
  const text = Number.isInteger(days) ? String(days) : days.toFixed(1);
  return `${text} ${text === "1" ? "day" : "days"}`;
}

// ---------------------------------------------------------------- DOM updates in place

function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

/** A number element: raw value in `data-value` (removed when missing), friendly text. */
function setValue(node, value, format) {
  if (isMissing(value)) {
    if (node.hasAttribute("data-value")) node.removeAttribute("data-value");
    setText(node, "–");
    return;
  }
  const raw = String(Number.isInteger(value) ? value : Number(value.toFixed(6)));
  if (node.dataset.value !== raw) node.dataset.value = raw;
  setText(node, format(value));
}

function show(node, visible) {
  if (node.hidden === visible) node.hidden = !visible;
}

function setAttr(node, name, value) {
  if (node.getAttribute(name) !== value) node.setAttribute(name, value);
}

/** A bar (`.meter` with a `.fill`): fraction 0..1 of its width. */
function setMeter(node, fraction, text) {
  const f = isMissing(fraction) ? 0 : Math.min(1, Math.max(0, fraction));
  const width = `${(f * 100).toFixed(2)}%`;
  const fill = node.firstElementChild;
  if (fill.style.width !== width) fill.style.width = width;
  setAttr(node, "aria-valuenow", (f * 100).toFixed(1));
  if (text) setAttr(node, "aria-valuetext", text);
}

function meter(tierClass, label) {
  const node = document.createElement("span");
  node.className = `meter ${tierClass}`;
  node.setAttribute("role", "meter");
  node.setAttribute("aria-label", label);
  node.setAttribute("aria-valuemin", "0");
  node.setAttribute("aria-valuemax", "100");
  const fill = document.createElement("span");
  fill.className = "fill";
  node.append(fill);
  return node;
}

/**
 * Rows of a table body kept by key: `make(key)` builds a row's cells once, later snapshots
 * only update them; rows whose key disappeared are removed, order follows the snapshot.
 */
class KeyedRows {
  constructor(tbody, make) {
    this.tbody = tbody;
    this.make = make;
    this.rows = new Map();
  }

  /** @returns {object[]} the row handles, in `keys` order */
  sync(keys) {
    const wanted = new Set(keys);
    for (const [key, row] of this.rows) {
      if (!wanted.has(key)) {
        row.tr.remove();
        this.rows.delete(key);
      }
    }
    let previous = null;
    return keys.map((key) => {
      let row = this.rows.get(key);
      if (!row) {
        row = this.make(key);
        this.rows.set(key, row);
      }
      const expected = previous ? previous.nextSibling : this.tbody.firstChild;
      if (expected !== row.tr) this.tbody.insertBefore(row.tr, expected);
      previous = row.tr;
      return row;
    });
  }
}

/** A row of `cells` (class names: "n" right-aligns) whose tds are returned by name. */
function buildRow(cells) {
  const tr = document.createElement("tr");
  const row = { tr };
  for (const [name, className, header] of cells) {
    const td = document.createElement(header ? "th" : "td");
    if (header) td.scope = "row";
    if (className) td.className = className;
    tr.append(td);
    row[name] = td;
  }
  return row;
}

// ---------------------------------------------------------------- charts

const throughput = new RingSeries(CAPACITY, 2);
const bySource = new RingSeries(CAPACITY, 4);
const latency = new RingSeries(CAPACITY, 4);
let charts = [];

function makeCharts() {
  charts = [
    new TimeChart($("chart-throughput"), {
      title: "Throughput in tokens per second over the last 5 minutes",
      data: throughput,
      windowS: WINDOW_S,
      format: (v) => compact(v),
      formatValue: (v) => `${formatRate(v)} tok/s`,
      series: [
        { label: "Generated", color: "var(--series-out)" },
        { label: "Prompt", color: "var(--series-in)" },
      ],
    }),
    new TimeChart($("chart-cache"), {
      title: "Prompt tokens per second by source over the last 5 minutes",
      data: bySource,
      windowS: WINDOW_S,
      stacked: true,
      format: (v) => compact(v),
      formatValue: (v) => `${formatRate(v)} tok/s`,
      series: [
        { label: "Device cache", color: "var(--device)" },
        { label: "Host cache", color: "var(--host)" },
        { label: "Disk cache", color: "var(--disk)" },
        { label: "Computed", color: "var(--computed)" },
      ],
    }),
    new TimeChart($("chart-latency"), {
      title: "Latency percentiles in milliseconds over the last 5 minutes",
      data: latency,
      windowS: WINDOW_S,
      scale: "log",
      format: (v) => formatMs(v).replace(".0 ", " "),
      formatValue: formatMs,
      series: [
        { label: "TTFT p50", color: "var(--series-ttft)" },
        { label: "TTFT p99", color: "var(--series-ttft)", dash: [5, 4] },
        { label: "ITL p50", color: "var(--series-itl)" },
        { label: "ITL p99", color: "var(--series-itl)", dash: [5, 4] },
      ],
    }),
  ];
}

// ---------------------------------------------------------------- derived numbers

let previous = null; // the last snapshot
const recent = []; // {time, tokens} of the last ~10 s, oldest first

/** Per-second rates of the token counters between two snapshots. */
function rates(a, b) {
  const dt = b.time_s - a.time_s;
  const per = (key) => Math.max(0, b.tokens[key] - a.tokens[key]) / dt;
  return {
    generated: per("generated"),
    prompt: per("prompt"),
    computed: per("computed"),
    device: per("cached_device"),
    host: per("cached_host"),
    disk: per("cached_disk"),
  };
}

/** Cached shares of the prompt tokens over the last ~10 s (null: no prompt tokens then). */
function hitShares(now, tokens) {
  recent.push({ time: now, tokens });
  while (recent.length > 2 && recent[1].time <= now - HIT_WINDOW_S) recent.shift();
  if (recent.length < 2) return null;
  const base = recent[0].tokens;
  const prompt = tokens.prompt - base.prompt;
  if (prompt <= 0) return null;
  const share = (key) => Math.min(1, Math.max(0, (tokens[key] - base[key]) / prompt));
  const device = share("cached_device");
  const host = share("cached_host");
  const disk = share("cached_disk");
  const total = Math.min(1, device + host + disk);
  return { device, host, disk, total };
}

// ---------------------------------------------------------------- sections

function renderHeadline(s, r, hits) {
  setValue($("running"), s.running, formatCount);
  setValue($("waiting"), s.waiting, formatCount);
  setValue($("tokens-out-rate"), r?.generated, formatRate);
  setValue($("tokens-in-rate"), r?.prompt, formatRate);
  setValue($("computed-rate"), r?.computed, formatRate);
  setValue($("cache-hit-share"), hits?.total, formatShare);
  const bar = $("cache-hit-tiers");
  const parts = hits ? [hits.device, hits.host, hits.disk, 1 - hits.total] : [0, 0, 0, 0];
  [...bar.children].forEach((seg, i) => {
    const width = `${(parts[i] * 100).toFixed(2)}%`;
    if (seg.style.width !== width) seg.style.width = width;
  });
  setAttr(
    bar,
    "aria-label",
    hits
      ? `Last 10 s of prompt tokens: device ${formatShare(hits.device)}, host ${formatShare(hits.host)}, ` +
          `disk ${formatShare(hits.disk)}, computed ${formatShare(1 - hits.total)}`
      : "No prompt tokens in the last 10 s",
  );
  const kvUse = s.kv.blocks_total > 0 ? s.kv.blocks_used / s.kv.blocks_total : null;
  setValue($("kv-use"), kvUse, formatShare);
  setMeter($("kv-use-bar"), kvUse, formatShare(kvUse));
  setValue($("ttft-p50"), s.latency.ttft.p50_ms, formatMs);
  setValue($("ttft-p99"), s.latency.ttft.p99_ms, formatMs);
  setValue($("itl-p50"), s.latency.itl.p50_ms, formatMs);
  setValue($("itl-p99"), s.latency.itl.p99_ms, formatMs);
}

const workerRows = () =>
  new KeyedRows($("workers").tBodies[0], (name) => {
    const row = buildRow([
      ["name", "name", true],
      ["device", "mono"],
      ["threads", "n"],
      ["busy", "busy-col"],
      ["steps", "n"],
      ["step", "n"],
      ["predicted", "n"],
      ["last", "n"],
    ]);
    row.name.textContent = name;
    row.meter = meter("meter-busy", `${name} busy`);
    row.busyText = document.createElement("span");
    row.busyText.className = "num";
    const wrap = document.createElement("span");
    wrap.className = "bar-cell";
    wrap.append(row.meter, row.busyText);
    row.busy.append(wrap);
    return row;
  });
let workers;

function renderWorkers(s) {
  const rows = workers.sync(s.workers.map((w) => w.name));
  s.workers.forEach((w, i) => {
    const row = rows[i];
    setText(row.device, w.device);
    setText(row.threads, w.threads === null ? "–" : String(w.threads));
    setMeter(row.meter, w.busy_fraction, formatShare(w.busy_fraction));
    setText(row.busyText, `${Math.round(w.busy_fraction * 100)}%`);
    setText(row.steps, formatCount(w.steps));
    setText(row.step, formatMs(w.step_ms));
    setText(row.predicted, w.predicted_step_ms === null ? "" : formatMs(w.predicted_step_ms));
    setText(row.last, formatMs(w.last_step_ms));
  });
  show($("workers-empty"), s.workers.length === 0);
}

const bucketRows = () =>
  new KeyedRows($("prefill-buckets").tBodies[0], (label) => {
    const row = buildRow([
      ["label", "mono", true],
      ["requests", "n"],
      ["tokens", "bar-col"],
    ]);
    row.label.textContent = label;
    row.meter = meter("meter-computed", `Tokens queued, ${label}`);
    row.tokenText = document.createElement("span");
    row.tokenText.className = "num";
    const wrap = document.createElement("span");
    wrap.className = "bar-cell";
    wrap.append(row.meter, row.tokenText);
    row.tokens.append(wrap);
    return row;
  });
let buckets;

function renderPrefill(s) {
  const p = s.prefill;
  show($("prefill-off"), !p);
  show($("prefill-on"), Boolean(p));
  if (!p) return;
  const rows = buckets.sync(p.buckets.map((b) => b.label));
  const most = Math.max(1, ...p.buckets.map((b) => b.tokens));
  p.buckets.forEach((b, i) => {
    const row = rows[i];
    setText(row.requests, formatCount(b.requests));
    setMeter(row.meter, b.tokens / most, `${formatCount(b.tokens)} tokens`);
    setText(row.tokenText, formatCount(b.tokens));
    row.tr.classList.toggle("idle", b.requests === 0 && b.tokens === 0);
  });
  setValue($("planner-predicted"), p.predicted_ms, formatMs);
  setValue($("planner-measured"), p.measured_ms, formatMs);
  setValue($("planner-error"), p.cost_model_error, formatShare);
  setValue($("planner-over-budget"), p.steps_over_budget, formatCount);
}

function renderKv(s) {
  const kv = s.kv;
  const split = kv.decode_blocks_total > 0;
  setText($("kv-pool-name"), split ? "Prefill pool" : "Blocks");
  setText($("kv-blocks"), `${formatCount(kv.blocks_used)} / ${formatCount(kv.blocks_total)}`);
  setMeter($("kv-bar"), kv.blocks_total ? kv.blocks_used / kv.blocks_total : 0, `${kv.blocks_used} of ${kv.blocks_total}`);
  show($("kv-decode-pool"), split);
  if (split) {
    setText($("kv-decode-blocks"), `${formatCount(kv.decode_blocks_used)} / ${formatCount(kv.decode_blocks_total)}`);
    setMeter(
      $("kv-decode-bar"),
      kv.decode_blocks_used / kv.decode_blocks_total,
      `${kv.decode_blocks_used} of ${kv.decode_blocks_total}`,
    );
  }
}

/** "1,234 / 5,678" */
function hitsText(hits, lookups) {
  return `${formatCount(hits)} / ${formatCount(lookups)}`;
}

function renderHost(s) {
  const h = s.host;
  show($("host-off"), !h);
  show($("host-on"), Boolean(h));
  if (!h) return;
  setValue($("host-bytes"), h.bytes, formatBytes);
  setValue($("host-capacity"), h.capacity_bytes, formatBytes);
  setMeter($("host-bar"), h.capacity_bytes ? h.bytes / h.capacity_bytes : 0, formatBytes(h.bytes));
  setValue($("host-blocks"), h.blocks, formatCount);
  setText($("host-hits"), hitsText(h.hits, h.lookups));
  setValue($("host-hit-rate"), h.lookups > 0 ? h.hits / h.lookups : null, formatShare);
}

const classRows = () =>
  new KeyedRows($("disk-classes").tBodies[0], (name) => {
    const row = buildRow([
      ["name", "", true],
      ["blocks", "n"],
      ["tokens", "n"],
      ["bytes", "n"],
      ["retention", "n"],
      ["next", "n"],
      ["last", "n"],
    ]);
    row.name.textContent = name;
    return row;
  });
let classes;

function renderDisk(s) {
  const d = s.disk;
  show($("disk-off"), !d);
  show($("disk-on"), Boolean(d));
  if (!d) return;
  setValue($("disk-bytes"), d.bytes, formatBytes);
  setValue($("disk-max-bytes"), d.max_bytes, formatBytes);
  setMeter($("disk-bar"), d.max_bytes ? d.bytes / d.max_bytes : 0, formatBytes(d.bytes));
  show($("disk-degraded"), d.degraded);
  setValue($("disk-live-bytes"), d.live_bytes, formatBytes);
  setValue($("disk-pending-bytes"), d.pending_bytes, formatBytes);
  setValue($("disk-blocks"), d.blocks, formatCount);
  setValue($("disk-segments"), d.segments, formatCount);
  setText($("disk-hits"), hitsText(d.hits, d.lookups));
  setValue($("disk-hit-rate"), d.lookups > 0 ? d.hits / d.lookups : null, formatShare);
  setValue($("disk-writes"), d.writes, formatCount);
  setValue($("disk-evictions"), d.evictions, formatCount);
  setValue($("disk-expirations"), d.expirations, formatCount);
  const rows = classes.sync(d.classes.map((c) => c.name));
  d.classes.forEach((c, i) => {
    const row = rows[i];
    setText(row.blocks, formatCount(c.blocks));
    setText(row.tokens, formatCount(c.tokens));
    setText(row.bytes, formatBytes(c.bytes));
    setText(row.retention, formatDays(c.retention_s));
    setText(row.next, formatRelative(c.next_expiry_s, s.time_s));
    setText(row.last, formatRelative(c.last_expiry_s, s.time_s));
  });
}

function renderFailures(s) {
  setValue($("failed-steps"), s.failed_steps, formatCount);
  setValue($("failed-requests"), s.failed_requests, formatCount);
  $("failed-steps").classList.toggle("bad", s.failed_steps > 0);
  $("failed-requests").classList.toggle("bad", s.failed_requests > 0);
  $("failures").classList.toggle("alert", s.failed_steps > 0 || s.failed_requests > 0);
}

/** Apply one snapshot to the page. */
function onSnapshot(s) {
  if (
    previous &&
    (s.time_s <= previous.time_s || s.uptime_s < previous.uptime_s || s.time_s - previous.time_s > GAP_S)
  ) {
    previous = null; // a restart or a gap: rates start over
    recent.length = 0;
  }
  const r = previous ? rates(previous, s) : null;
  const hits = hitShares(s.time_s, s.tokens);

  setText($("model"), s.model);
  setText($("uptime"), `up ${formatUptime(s.uptime_s)}`);
  renderHeadline(s, r, hits);
  renderWorkers(s);
  renderPrefill(s);
  renderKv(s);
  renderHost(s);
  renderDisk(s);
  renderFailures(s);

  if (r) {
    throughput.push(s.time_s, [r.generated, r.prompt]);
    bySource.push(s.time_s, [r.device, r.host, r.disk, r.computed]);
  }
  const { ttft, itl } = s.latency;
  latency.push(s.time_s, [ttft.p50_ms, ttft.p99_ms, itl.p50_ms, itl.p99_ms]);
  for (const chart of charts) chart.update();
  previous = s;
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
    setStatus(attempt === 0 && !previous ? "connecting" : "reconnecting");
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
  workers = workerRows();
  buckets = bucketRows();
  classes = classRows();
  makeCharts();
  $("pause").addEventListener("click", togglePause);
  $("key-button").addEventListener("click", changeKey);
  $("key-cancel").addEventListener("click", () => $("key-dialog").dispatchEvent(new Event("cancel")));
  window.addEventListener("storage", (e) => {
    if (e.key === null || e.key.endsWith("apiKey")) wakeUp();
  });
  run();
}

init();
