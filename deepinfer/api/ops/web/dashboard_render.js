// The dashboard's cards, updated in place from one stats snapshot (see stats_schema.py) and
// the rates derived from the snapshots before it (dashboard_rates.js).

import { formatBytes } from "./common.js";
import { KeyedRows, buildRow, meter, setAttr, setMeter, setText, setValue, show } from "./dashboard_dom.js";
import {
  formatCount,
  formatDays,
  formatMs,
  formatRate,
  formatRelative,
  formatShare,
  formatUptime,
  hitsText,
} from "./dashboard_format.js";

const $ = (id) => document.getElementById(id);

/** The keyed table bodies (workers, prefill buckets, disk classes), made once per page. */
export function makeTables() {
  return { workers: workerRows(), buckets: bucketRows(), classes: classRows() };
}

/** Apply snapshot `s` to every card: `r` the token rates (null after a gap), `hits` the cached
 * shares of recent prompt tokens (null when none), `tables` from makeTables(). */
export function renderSnapshot(s, r, hits, tables) {
  setText($("model"), s.model);
  setText($("uptime"), `up ${formatUptime(s.uptime_s)}`);
  renderHeadline(s, r, hits);
  renderWorkers(s, tables.workers);
  renderPrefill(s, tables.buckets);
  renderKv(s);
  renderHost(s);
  renderDisk(s, tables.classes);
  renderFailures(s);
}

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
function renderWorkers(s, workers) {
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
function renderPrefill(s, buckets) {
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
function renderDisk(s, classes) {
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
