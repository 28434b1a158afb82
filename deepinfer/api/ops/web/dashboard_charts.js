// The dashboard's three charts (throughput, prompt tokens by source, latency percentiles) and
// the sample history behind them.

import { compact } from "./common.js";
import { TimeChart } from "./charts.js";
import { formatMs, formatRate } from "./dashboard_format.js";
import { RingSeries } from "./ring_series.js";

const WINDOW_S = 300; // seconds of history in the charts
const CAPACITY = 360; // samples kept per chart (1 per second, with slack)

const $ = (id) => document.getElementById(id);

/** Build the charts; `record(s, r)` adds snapshot `s` and its rates `r` (null: none) to them. */
export function makeCharts() {
  const throughput = new RingSeries(CAPACITY, 2);
  const bySource = new RingSeries(CAPACITY, 4);
  const latency = new RingSeries(CAPACITY, 4);
  const charts = [throughputChart(throughput), sourceChart(bySource), latencyChart(latency)];
  return {
    record(s, r) {
      if (r) {
        throughput.push(s.time_s, [r.generated, r.prompt]);
        bySource.push(s.time_s, [r.device, r.host, r.disk, r.computed]);
      }
      const { ttft, itl } = s.latency;
      latency.push(s.time_s, [ttft.p50_ms, ttft.p99_ms, itl.p50_ms, itl.p99_ms]);
      for (const chart of charts) chart.update();
    },
  };
}

function throughputChart(data) {
  return new TimeChart($("chart-throughput"), {
    title: "Throughput in tokens per second over the last 5 minutes",
    data,
    windowS: WINDOW_S,
    format: (v) => compact(v),
    formatValue: (v) => `${formatRate(v)} tok/s`,
    series: [
      { label: "Generated", color: "var(--series-out)" },
      { label: "Prompt", color: "var(--series-in)" },
    ],
  });
}

function sourceChart(data) {
  return new TimeChart($("chart-cache"), {
    title: "Prompt tokens per second by source over the last 5 minutes",
    data,
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
  });
}

function latencyChart(data) {
  return new TimeChart($("chart-latency"), {
    title: "Latency percentiles in milliseconds over the last 5 minutes",
    data,
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
  });
}
