// Chart axes: nice value ticks on linear and log scales, time steps and wall-clock labels.

/** A "nice" step (1, 2 or 5 times a power of ten) near `span / count`. */
export function niceStep(span, count) {
  const raw = span / Math.max(1, count);
  const power = 10 ** Math.floor(Math.log10(raw));
  const fraction = raw / power;
  const nice = fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10;
  return nice * power;
}

/** Ticks 0..top for a linear axis holding `max`, about `count` of them. */
export function linearTicks(max, count) {
  if (!(max > 0)) max = 1;
  const step = niceStep(max, count);
  const top = Math.ceil(max / step - 1e-9) * step;
  const ticks = [];
  for (let v = 0; v <= top + step / 2; v += step) ticks.push(Number(v.toPrecision(12)));
  return { ticks, min: 0, max: top };
}

/** Ticks at 1-2-5 multiples of powers of ten covering [min, max] (both > 0). */
export function logTicks(min, max, count) {
  let lo = 10 ** Math.floor(Math.log10(min));
  let hi = 10 ** Math.ceil(Math.log10(max));
  if (hi / lo < 10) hi = lo * 10;
  const decades = Math.round(Math.log10(hi / lo));
  const mantissas = decades * 3 <= count ? [1, 2, 5] : decades <= count ? [1] : null;
  const ticks = [];
  for (let d = lo; d <= hi * 1.0001; d *= 10) {
    if (mantissas) {
      for (const m of mantissas) if (d * m <= hi * 1.0001) ticks.push(Number((d * m).toPrecision(6)));
    } else if (Math.round(Math.log10(d)) % 2 === 0) {
      ticks.push(Number(d.toPrecision(6)));
    }
  }
  return { ticks, min: lo, max: hi };
}

/** Steps of the time axis in seconds, finest first. */
export const TIME_STEPS = [5, 10, 15, 30, 60, 120, 300, 600];

function pad2(n) {
  return String(n).padStart(2, "0");
}

/** A wall-clock label: "14:05" on whole minutes, else "14:05:30". */
export function clockLabel(seconds, withSeconds) {
  const d = new Date(seconds * 1000);
  const hm = `${pad2(d.getHours())}:${pad2(d.getMinutes())}`;
  return withSeconds ? `${hm}:${pad2(d.getSeconds())}` : hm;
}
