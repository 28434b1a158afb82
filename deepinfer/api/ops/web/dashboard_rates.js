// Numbers derived from consecutive stats snapshots: per-second token rates, and the cached
// shares of the prompt tokens over the last few seconds.

const HIT_WINDOW_S = 10; // window of the cache hit share
const GAP_S = 5; // a longer step between snapshots restarts the rates

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

/** The snapshots seen so far, as far as the derived numbers need them. */
export class SnapshotRates {
  constructor() {
    this.previous = null; // the last snapshot
    this.recent = []; // {time, tokens} of the last ~10 s, oldest first
  }

  /** Take snapshot `s`: its rates since the previous one (null: none, or a restart or a gap)
   * and the cached shares of recent prompt tokens (see hitShares). */
  next(s) {
    const previous = this.previous;
    if (
      previous &&
      (s.time_s <= previous.time_s || s.uptime_s < previous.uptime_s || s.time_s - previous.time_s > GAP_S)
    ) {
      this.previous = null; // a restart or a gap: rates start over
      this.recent.length = 0;
    }
    const r = this.previous ? rates(this.previous, s) : null;
    const hits = this.hitShares(s.time_s, s.tokens);
    this.previous = s;
    return { r, hits };
  }

  /** Cached shares of the prompt tokens over the last ~10 s (null: no prompt tokens then). */
  hitShares(now, tokens) {
    const recent = this.recent;
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
}
