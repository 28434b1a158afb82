// Small canvas time-series charts: lines or stacked areas over a fixed time window, crisp on
// HiDPI screens, resized with their container, coloured from CSS variables, with nice ticks,
// a legend, a hover readout and a text summary for assistive technology.

import { TIME_STEPS, clockLabel, linearTicks, logTicks } from "./chart_axis.js";

/**
 * @typedef {object} SeriesSpec
 * @property {string} label legend text
 * @property {string} color a CSS colour or `var(--name)`
 * @property {number[]} [dash] line dash pattern in CSS pixels
 */

/**
 * A time-series chart in a container element. Data lives in a RingSeries owned by the caller;
 * `update()` schedules one redraw on the next animation frame.
 */
export class TimeChart {
  /**
   * @param {HTMLElement} container
   * @param {object} options
   * @param {RingSeries} options.data
   * @param {SeriesSpec[]} options.series one per data column, bottom-up when stacked
   * @param {boolean} [options.stacked] stacked areas instead of lines
   * @param {"linear"|"log"} [options.scale]
   * @param {number} options.windowS seconds shown once that much history is held
   * @param {number} [options.minWindowS] seconds shown at least (a young history grows into it)
   * @param {number} [options.gapS] a time step longer than this breaks the line
   * @param {(v: number) => string} options.format a value on the axis
   * @param {(v: number) => string} [options.formatValue] a value in the readout (default: format)
   * @param {string} options.title name used in the text summary
   */
  constructor(container, options) {
    this.container = container;
    this.options = { scale: "linear", stacked: false, gapS: 3, minWindowS: 60, ...options };
    this.data = options.data;
    this.dpr = 0;
    this.width = 0;
    this.height = 0;
    this.hoverX = null;
    this.frame = 0;
    this.colors = null;

    container.classList.add("timechart");
    this.plot = document.createElement("div");
    this.plot.className = "timechart-plot";
    this.canvas = document.createElement("canvas");
    this.canvas.setAttribute("aria-hidden", "true");
    this.tooltip = document.createElement("div");
    this.tooltip.className = "timechart-tooltip";
    this.tooltip.hidden = true;
    this.plot.append(this.canvas, this.tooltip);
    this.legend = this.buildLegend();
    this.summary = document.createElement("p");
    this.summary.className = "visually-hidden";
    this.summary.textContent = `${this.options.title}: no data yet.`;
    container.append(this.legend, this.plot, this.summary);
    container.setAttribute("role", "figure");
    container.setAttribute("aria-label", this.options.title);

    this.ctx = this.canvas.getContext("2d");
    new ResizeObserver(() => this.resize()).observe(this.plot);
    this.plot.addEventListener("pointermove", (e) => this.hover(e));
    this.plot.addEventListener("pointerleave", () => this.hover(null));
    matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
      this.colors = null;
      this.update();
    });
  }

  buildLegend() {
    const legend = document.createElement("ul");
    legend.className = "timechart-legend";
    for (const s of this.options.series) {
      const item = document.createElement("li");
      const key = document.createElement("i");
      key.className = this.options.stacked ? "key area" : s.dash ? "key dashed" : "key";
      key.style.setProperty("--key-color", s.color);
      item.append(key, s.label);
      legend.append(item);
    }
    return legend;
  }

  /** Resolve the series and axis colours from CSS (again after a colour-scheme change). */
  resolveColors() {
    const style = getComputedStyle(this.container);
    const probe = (value) => {
      const m = /^var\((--[\w-]+)\)$/.exec(value.trim());
      return m ? style.getPropertyValue(m[1]).trim() || "#888" : value;
    };
    this.colors = {
      series: this.options.series.map((s) => probe(s.color)),
      text: style.getPropertyValue("--muted").trim() || "#6b7280",
      grid: style.getPropertyValue("--grid").trim() || style.getPropertyValue("--border").trim(),
      cursor: style.getPropertyValue("--text").trim() || "#000",
      font: `11px ${style.fontFamily}`,
    };
  }

  resize() {
    const rect = this.plot.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(rect.width));
    const height = Math.max(1, Math.round(rect.height));
    if (width === this.width && height === this.height && dpr === this.dpr) return;
    this.width = width;
    this.height = height;
    this.dpr = dpr;
    this.canvas.width = Math.round(width * dpr);
    this.canvas.height = Math.round(height * dpr);
    this.canvas.style.width = `${width}px`;
    this.canvas.style.height = `${height}px`;
    this.draw();
  }

  /** Redraw on the next frame (many calls in one frame draw once). */
  update() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      if ((window.devicePixelRatio || 1) !== this.dpr) this.resize();
      this.draw();
    });
  }

  hover(event) {
    this.hoverX = event ? event.clientX - this.plot.getBoundingClientRect().left : null;
    this.update();
  }

  /** Stacked (cumulative) value of series k at sample i, or the plain value for lines. */
  plotted(k, i) {
    if (!this.options.stacked) return this.data.value(k, i);
    let sum = 0;
    for (let j = 0; j <= k; j++) {
      const v = this.data.value(j, i);
      if (Number.isNaN(v)) return NaN;
      sum += v;
    }
    return sum;
  }

  /** Y domain and ticks for the visible samples. */
  yAxis(first, tickCount) {
    const { data, options } = this;
    let max = 0;
    let min = Infinity;
    for (let i = first; i < data.length; i++) {
      for (let k = 0; k < data.width; k++) {
        const v = this.plotted(k, i);
        if (Number.isNaN(v)) continue;
        if (v > max) max = v;
        if (v > 0 && v < min) min = v;
      }
    }
    if (options.scale === "log") {
      if (!(max > 0)) return { ...logTicks(1, 100, tickCount), log: true };
      return { ...logTicks(Math.min(min, max), max, tickCount), log: true };
    }
    return { ...linearTicks(max, tickCount), log: false };
  }

  draw() {
    const { ctx, width, height, dpr, data, options } = this;
    if (!width || !height) return;
    if (!this.colors) this.resolveColors();
    const colors = this.colors;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = colors.font;

    const tEnd = data.length ? data.time(data.length - 1) : Date.now() / 1000;
    const held = data.length ? tEnd - data.time(0) : 0;
    const span = Math.min(options.windowS, Math.max(options.minWindowS, held));
    const tStart = tEnd - span;
    let first = 0;
    while (first < data.length - 1 && data.time(first + 1) < tStart) first++;

    const tickCount = Math.max(2, Math.floor(height / 45));
    const y = this.yAxis(first, tickCount);
    const labels = y.ticks.map((v) => options.format(v));
    const labelWidth = Math.max(...labels.map((s) => ctx.measureText(s).width));
    const left = Math.ceil(labelWidth) + 8;
    const right = 6;
    const top = 6;
    const bottom = 18;
    const plotW = Math.max(1, width - left - right);
    const plotH = Math.max(1, height - top - bottom);

    const xOf = (t) => left + ((t - tStart) / span) * plotW;
    const yOf = y.log
      ? (v) => {
          const c = Math.min(Math.max(v, y.min), y.max);
          return top + plotH - (Math.log(c / y.min) / Math.log(y.max / y.min)) * plotH;
        }
      : (v) => top + plotH - ((v - y.min) / (y.max - y.min)) * plotH;

    // Grid and axis labels.
    ctx.lineWidth = 1;
    ctx.strokeStyle = colors.grid;
    ctx.fillStyle = colors.text;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    y.ticks.forEach((v, i) => {
      const py = Math.round(yOf(v)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(left, py);
      ctx.lineTo(left + plotW, py);
      ctx.stroke();
      ctx.fillText(labels[i], left - 6, py);
    });
    const spacing = (s) => (s / span) * plotW;
    const step = TIME_STEPS.find((s) => spacing(s) >= (s < 60 ? 90 : 56)) || 600;
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let t = Math.ceil(tStart / step) * step; t <= tEnd; t += step) {
      const px = Math.round(xOf(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(px, top + plotH);
      ctx.lineTo(px, top + plotH + 4);
      ctx.stroke();
      const label = clockLabel(t, step < 60);
      const half = ctx.measureText(label).width / 2;
      if (px - half >= left - 4 && px + half <= width) ctx.fillText(label, px, top + plotH + 5);
    }

    // Series, clipped to the plot area.
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top - 1, plotW, plotH + 2);
    ctx.clip();
    const segments = this.segments(first);
    if (options.stacked) this.drawAreas(segments, xOf, yOf, y);
    this.drawLines(segments, xOf, yOf);
    ctx.restore();

    this.drawHover(first, xOf, left, plotW, top, plotH);
    this.summarize();
  }

  /** Runs of consecutive sample indices without a time gap. */
  segments(first) {
    const { data, options } = this;
    const runs = [];
    let run = [];
    for (let i = first; i < data.length; i++) {
      if (run.length && data.time(i) - data.time(i - 1) > options.gapS) {
        runs.push(run);
        run = [];
      }
      run.push(i);
    }
    if (run.length) runs.push(run);
    return runs;
  }

  drawLines(segments, xOf, yOf) {
    const { ctx, data, options, colors } = this;
    ctx.lineJoin = "round";
    ctx.lineCap = "round";
    for (let k = data.width - 1; k >= 0; k--) {
      ctx.strokeStyle = colors.series[k];
      ctx.lineWidth = options.stacked ? 1 : 1.75;
      ctx.setLineDash(options.series[k].dash || []);
      ctx.beginPath();
      for (const run of segments) {
        let pen = false;
        for (const i of run) {
          const v = this.plotted(k, i);
          if (Number.isNaN(v)) {
            pen = false;
            continue;
          }
          const px = xOf(data.time(i));
          const py = yOf(v);
          if (pen) ctx.lineTo(px, py);
          else ctx.moveTo(px, py);
          pen = true;
        }
      }
      ctx.stroke();
    }
    ctx.setLineDash([]);
  }

  drawAreas(segments, xOf, yOf, y) {
    const { ctx, data, colors } = this;
    const base = y.min;
    for (let k = 0; k < data.width; k++) {
      ctx.fillStyle = colors.series[k];
      ctx.globalAlpha = 0.55;
      for (const run of segments) {
        const points = run.filter((i) => !Number.isNaN(this.plotted(k, i)));
        if (!points.length) continue;
        ctx.beginPath();
        points.forEach((i, j) => {
          const px = xOf(data.time(i));
          const py = yOf(this.plotted(k, i));
          if (j === 0) ctx.moveTo(px, py);
          else ctx.lineTo(px, py);
        });
        for (let j = points.length - 1; j >= 0; j--) {
          const i = points[j];
          ctx.lineTo(xOf(data.time(i)), yOf(k === 0 ? base : this.plotted(k - 1, i)));
        }
        ctx.closePath();
        ctx.fill();
      }
    }
    ctx.globalAlpha = 1;
  }

  /** A cursor line and a readout of the sample nearest the pointer. */
  drawHover(first, xOf, left, plotW, top, plotH) {
    const { ctx, data, options, colors, tooltip } = this;
    if (this.hoverX === null || data.length === 0 || this.hoverX < left) {
      tooltip.hidden = true;
      return;
    }
    let best = -1;
    let bestDist = Infinity;
    for (let i = first; i < data.length; i++) {
      const d = Math.abs(xOf(data.time(i)) - this.hoverX);
      if (d < bestDist) {
        bestDist = d;
        best = i;
      }
    }
    if (best < 0 || bestDist > 24) {
      tooltip.hidden = true;
      return;
    }
    const px = Math.round(xOf(data.time(best))) + 0.5;
    ctx.strokeStyle = colors.cursor;
    ctx.globalAlpha = 0.35;
    ctx.beginPath();
    ctx.moveTo(px, top);
    ctx.lineTo(px, top + plotH);
    ctx.stroke();
    ctx.globalAlpha = 1;

    const rows = [clockLabel(data.time(best), true)];
    const format = options.formatValue || options.format;
    const order = options.series.map((_, k) => k);
    if (options.stacked) order.reverse(); // top band first, as drawn
    for (const k of order) {
      const v = data.value(k, best);
      rows.push(`${options.series[k].label}: ${Number.isNaN(v) ? "–" : format(v)}`);
    }
    tooltip.textContent = rows.join("\n");
    tooltip.hidden = false;
    const tipWidth = tooltip.offsetWidth;
    const x = px + 10 + tipWidth > left + plotW ? px - 10 - tipWidth : px + 10;
    tooltip.style.transform = `translate(${Math.round(x)}px, ${top}px)`;
  }

  /** The latest values as text, for screen readers (changed at most once a redraw). */
  summarize() {
    const { data, options } = this;
    if (!data.length) return;
    const i = data.length - 1;
    const format = options.formatValue || options.format;
    const parts = options.series.map((s, k) => {
      const v = data.value(k, i);
      return `${s.label} ${Number.isNaN(v) ? "no data" : format(v)}`;
    });
    const text = `${options.title}, latest: ${parts.join(", ")}.`;
    if (this.summary.textContent !== text) this.summary.textContent = text;
  }
}
