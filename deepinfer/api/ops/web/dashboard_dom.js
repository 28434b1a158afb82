// In-place DOM updates for the dashboard: text, raw values in data-value, visibility, meter
// bars and table rows kept by key, each written only when it changed.

import { isMissing } from "./dashboard_format.js";

export function setText(node, text) {
  if (node.textContent !== text) node.textContent = text;
}

/** A number element: raw value in `data-value` (removed when missing), friendly text. */
export function setValue(node, value, format) {
  if (isMissing(value)) {
    if (node.hasAttribute("data-value")) node.removeAttribute("data-value");
    setText(node, "–");
    return;
  }
  const raw = String(Number.isInteger(value) ? value : Number(value.toFixed(6)));
  if (node.dataset.value !== raw) node.dataset.value = raw;
  setText(node, format(value));
}

export function show(node, visible) {
  if (node.hidden === visible) node.hidden = !visible;
}

export function setAttr(node, name, value) {
  if (node.getAttribute(name) !== value) node.setAttribute(name, value);
}

/** A bar (`.meter` with a `.fill`): fraction 0..1 of its width. */
export function setMeter(node, fraction, text) {
  const f = isMissing(fraction) ? 0 : Math.min(1, Math.max(0, fraction));
  const width = `${(f * 100).toFixed(2)}%`;
  const fill = node.firstElementChild;
  if (fill.style.width !== width) fill.style.width = width;
  setAttr(node, "aria-valuenow", (f * 100).toFixed(1));
  if (text) setAttr(node, "aria-valuetext", text);
}

/** A `.meter` bar (role meter, 0..100) for `setMeter`, with an accessible label. */
export function meter(tierClass, label) {
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
export class KeyedRows {
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
export function buildRow(cells) {
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
