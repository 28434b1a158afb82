// A fixed-capacity ring of time-stamped samples, the data behind a TimeChart (charts.js).

/** Fixed-capacity store of samples: one time column and one column per series (NaN: no value). */
export class RingSeries {
  /** @param {number} capacity samples kept @param {number} width series per sample */
  constructor(capacity, width) {
    this.capacity = capacity;
    this.width = width;
    this.times = new Float64Array(capacity);
    this.values = Array.from({ length: width }, () => new Float64Array(capacity));
    this.start = 0;
    this.length = 0;
  }

  /** Append one sample; `values[k]` null or undefined is stored as a gap. */
  push(time, values) {
    const slot = (this.start + this.length) % this.capacity;
    this.times[slot] = time;
    for (let k = 0; k < this.width; k++) {
      const v = values[k];
      this.values[k][slot] = v === null || v === undefined || !Number.isFinite(v) ? NaN : v;
    }
    if (this.length < this.capacity) this.length++;
    else this.start = (this.start + 1) % this.capacity;
  }

  time(i) {
    return this.times[(this.start + i) % this.capacity];
  }

  value(k, i) {
    return this.values[k][(this.start + i) % this.capacity];
  }

  clear() {
    this.start = 0;
    this.length = 0;
  }
}
