// Number, duration and date formatting for the dashboard ("–" stands for a missing value).

import { compact } from "./common.js";

const integer = new Intl.NumberFormat(undefined, { maximumFractionDigits: 0 });

export function isMissing(v) {
  return v === null || v === undefined || Number.isNaN(v);
}

/** A count with grouping: "12,345". */
export function formatCount(n) {
  return isMissing(n) ? "–" : integer.format(n);
}

/** Tokens per second: "8.4", "356", "12.3k". */
export function formatRate(v) {
  if (isMissing(v)) return "–";
  if (v === 0) return "0";
  if (v >= 10000) return compact(v);
  if (v >= 100) return integer.format(v);
  return v.toFixed(1);
}

/** A duration in ms: "4.2 ms", "123 ms", "1.25 s". */
export function formatMs(ms) {
  if (isMissing(ms)) return "–";
  if (ms >= 1000) return `${Number((ms / 1000).toPrecision(3))} s`;
  if (ms >= 10) return `${Math.round(ms)} ms`;
  return `${ms.toFixed(ms < 1 ? 2 : 1)} ms`;
}

/** A share 0..1 as "87.3%". */
export function formatShare(v) {
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
export function formatRelative(at, now) {
  if (isMissing(at)) return "–";
  const delta = at - now;
  if (Math.abs(delta) < 1) return "now";
  return delta > 0 ? `in ${formatSpan(delta)}` : `${formatSpan(delta)} ago`;
}

/** Uptime: "42 s", "12 min", "3 h 05 min", "2 d 4 h". */
export function formatUptime(s) {
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

/** Whole or fractional days: "7 days", "1 day", "0.5 days". */
export function formatDays(seconds) {
  const days = seconds / 86400;
  const text = Number.isInteger(days) ? String(days) : days.toFixed(1);
  return `${text} ${text === "1" ? "day" : "days"}`;
}

/** Cache hits over lookups: "1,234 / 5,678". */
export function hitsText(hits, lookups) {
  return `${formatCount(hits)} / ${formatCount(lookups)}`;
}
