// Shared by the chat playground and the dashboard: the API key, authenticated fetch, an SSE
// reader over fetch (EventSource cannot send a key), and a DOM builder that never parses HTML.

const KEY_ITEM = "deepinfer.apiKey";

/** The API key the user typed, kept in this browser's local storage ("" when none). */
export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

/** Build an element: `el("a", {href: u, class: "x"}, "text", child)`. Strings become text nodes,
 * never markup; `on*` attributes are refused (handlers are attached with addEventListener). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.toLowerCase().startsWith("on")) throw new Error(`el: refused attribute ${name}`);
    node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** An API error with the server's message (OpenAI or Anthropic error body). */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body?.error?.message || message;
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message);
}

/** fetch() a path of this server (relative to the page, so a mounted app works) with the key.
 * A 401 asks for the key (the page's key dialog) and tries once more. */
export async function apiFetch(path, options = {}) {
  for (let attempt = 0; ; attempt++) {
    const headers = new Headers(options.headers || {});
    const key = apiKey();
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers });
    if (response.ok) return response;
    if (response.status === 401 && attempt === 0 && !options.signal?.aborted) {
      if (await askForKey()) continue;
    }
    throw await errorOf(response);
  }
}

/** Async iterator of the `data:` payloads of a server-sent event stream (a fetch Response). */
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        const data = block
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

let pendingKey = null;

/** Show the page's key dialog (`<dialog id="key-dialog">` with a form holding
 * `<input name="key">`); resolves true once a key was entered, false when cancelled. */
export function askForKey() {
  if (pendingKey) return pendingKey;
  const dialog = document.getElementById("key-dialog");
  if (!dialog) return Promise.resolve(false);
  pendingKey = new Promise((resolve) => {
    const form = dialog.querySelector("form");
    const input = form.querySelector("input[name=key]");
    input.value = apiKey();
    const done = (ok) => {
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("cancel", onCancel);
      dialog.close();
      pendingKey = null;
      resolve(ok);
    };
    const onSubmit = (event) => {
      event.preventDefault();
      setApiKey(input.value.trim());
      done(Boolean(input.value.trim()));
    };
    const onCancel = () => done(false);
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("cancel", onCancel);
    dialog.showModal();
    input.focus();
  });
  return pendingKey;
}

/** "1.2k", "3.4M": compact counts for tight spaces. */
export function compact(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  const abs = Math.abs(n);
  if (abs >= 1e9) return `${(n / 1e9).toFixed(1)}G`;
  if (abs >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  if (abs >= 1e4) return `${(n / 1e3).toFixed(1)}k`;
  return Number.isInteger(n) ? String(n) : n.toFixed(1);
}

export function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
}
