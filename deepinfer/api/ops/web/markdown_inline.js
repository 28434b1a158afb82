// Inline Markdown for untrusted text: code spans, emphasis, links, autolinks and escapes, built
// as DOM nodes (never parsed HTML). Links are made only for http:, https: and mailto: URLs;
// images are never loaded (their source shows as text).

/** Nesting bound for quotes and lists (inline emphasis goes twice as deep). */
export const MAX_DEPTH = 6;
const LINK_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);
const MAX_LABEL = 500;
const MAX_URL = 2048;
const ESCAPABLE = /[!-/:-@[-`{-~]/;

/** An element with an optional class and children (nodes or strings, as text). */
export function node(tag, className, ...children) {
  const element = document.createElement(tag);
  if (className) element.className = className;
  element.append(...children);
  return element;
}

const EMPHASIS = [
  { mark: "**", tag: "strong" },
  { mark: "__", tag: "strong", word: true },
  { mark: "~~", tag: "del" },
  { mark: "*", tag: "em" },
  { mark: "_", tag: "em", word: true },
];

const BARE_URL = /^(?:https?:\/\/|mailto:)[^\s<>"'`]*[^\s<>"'`.,;:!?)\]*_~]/i;

/** Inline nodes for one line of text: code spans, emphasis, links, autolinks, escapes. */
export function inline(text, depth, noLinks = false) {
  const out = [];
  let plain = "";
  const flush = () => {
    if (plain) out.push(document.createTextNode(plain));
    plain = "";
  };
  const failed = {};
  let i = 0;
  while (i < text.length) {
    const ch = text[i];
    let hit = null;
    if (ch === "\\" && ESCAPABLE.test(text[i + 1] || "")) hit = { nodes: [text[i + 1]], next: i + 2 };
    else if (ch === "`") hit = codeSpan(text, i);
    else if (ch === "!" && text[i + 1] === "[") hit = image(text, i);
    else if (ch === "[" && !noLinks) hit = link(text, i, depth);
    else if (ch === "<" && !noLinks) hit = angleLink(text, i);
    else if ((ch === "h" || ch === "H" || ch === "m" || ch === "M") && !noLinks) hit = bareLink(text, i);
    if (!hit && "*_~".includes(ch) && depth < MAX_DEPTH * 2) hit = emphasis(text, i, depth, noLinks, failed);
    if (hit) {
      flush();
      for (const n of hit.nodes) out.push(typeof n === "string" ? document.createTextNode(n) : n);
      i = hit.next;
    } else {
      plain += ch;
      i++;
    }
  }
  flush();
  return out;
}

function codeSpan(text, start) {
  let run = 0;
  while (text[start + run] === "`") run++;
  const ticks = "`".repeat(run);
  let search = start + run;
  for (;;) {
    const end = text.indexOf(ticks, search);
    if (end < 0) return { nodes: [ticks], next: start + run };
    if (text[end + run] === "`") {
      search = end + run;
      while (text[search] === "`") search++;
      continue;
    }
    let code = text.slice(start + run, end);
    if (/^ .*\S.* $/.test(code)) code = code.slice(1, -1);
    return { nodes: [node("code", "", code)], next: end + run };
  }
}

/** `[label](destination)` at `start`: its label, URL and end, or null (labels and URLs are
 * bounded so that text full of brackets stays fast). */
function linkParts(text, start) {
  let level = 0;
  let close = -1;
  const labelEnd = Math.min(text.length, start + MAX_LABEL);
  for (let i = start; i < labelEnd; i++) {
    if (text[i] === "\\") i++;
    else if (text[i] === "[") level++;
    else if (text[i] === "]" && --level === 0) {
      close = i;
      break;
    }
  }
  if (close < 0 || text[close + 1] !== "(") return null;
  let parens = 0;
  const urlEnd = Math.min(text.length, close + 2 + MAX_URL);
  for (let i = close + 2; i < urlEnd; i++) {
    if (text[i] === "(") parens++;
    else if (text[i] === ")" && parens-- === 0) {
      const inside = text.slice(close + 2, i).trim();
      const url = inside.replace(/\s+("[^"]*"|'[^']*')$/, "").replace(/^<(.*)>$/, "$1");
      return { label: text.slice(start + 1, close), url, end: i + 1 };
    }
  }
  return null;
}

/** The URL when it is an absolute http(s) or mailto URL, else null. */
export function safeUrl(url) {
  if (!/^\s*(https?:|mailto:)/i.test(url)) return null;
  try {
    const parsed = new URL(url.trim());
    return LINK_PROTOCOLS.has(parsed.protocol) ? parsed.href : null;
  } catch {
    return null;
  }
}

function anchor(href, children) {
  const a = node("a", "", ...children);
  a.setAttribute("href", href);
  a.setAttribute("target", "_blank");
  a.setAttribute("rel", "noopener noreferrer");
  return a;
}

function link(text, start, depth) {
  const parts = linkParts(text, start);
  if (!parts) return null;
  const href = safeUrl(parts.url);
  const source = text.slice(start, parts.end);
  if (!href) return { nodes: [source], next: parts.end };
  return { nodes: [anchor(href, inline(parts.label, depth + 1, true))], next: parts.end };
}

/** Images are not loaded: `![alt](url)` stays as its source text. */
function image(text, start) {
  const parts = linkParts(text, start + 1);
  return parts ? { nodes: [text.slice(start, parts.end)], next: parts.end } : null;
}

function angleLink(text, start) {
  const match = /^<((?:https?:\/\/|mailto:)[^\s<>]+)>/i.exec(text.slice(start));
  const href = match && safeUrl(match[1]);
  return href ? { nodes: [anchor(href, [match[1]])], next: start + match[0].length } : null;
}

function bareLink(text, start) {
  if (start > 0 && /[\w/.:@-]/.test(text[start - 1])) return null;
  const match = BARE_URL.exec(text.slice(start, start + 2048));
  const href = match && safeUrl(match[0]);
  return href ? { nodes: [anchor(href, [match[0]])], next: start + match[0].length } : null;
}

/** `**strong**`, `*em*`, `_em_`, `__strong__`, `~~del~~` at `start`. `failed` remembers, per
 * marker, a position after which no closing marker exists (keeps long unmatched text linear). */
function emphasis(text, start, depth, noLinks, failed) {
  for (const { mark, tag, word } of EMPHASIS) {
    if (!text.startsWith(mark, start)) continue;
    const after = text[start + mark.length];
    if (!after || /\s/.test(after) || after === mark[0]) continue;
    if (word && start > 0 && /[\p{L}\p{N}]/u.test(text[start - 1])) continue;
    if (failed[mark] !== undefined && start >= failed[mark]) continue;
    const end = closingMark(text, start + mark.length + 1, mark, word);
    if (end < 0) {
      failed[mark] = start;
      continue;
    }
    const inner = inline(text.slice(start + mark.length, end), depth + 1, noLinks);
    return { nodes: [node(tag, "", ...inner)], next: end + mark.length };
  }
  return null;
}

function closingMark(text, from, mark, word) {
  for (let i = text.indexOf(mark, from); i >= 0; i = text.indexOf(mark, i + 1)) {
    if (/\s/.test(text[i - 1]) || text[i - 1] === "\\") continue;
    if (text[i + mark.length] === mark[0] && mark.length === 1) {
      i += 1;
      continue;
    }
    if (word && /[\p{L}\p{N}]/u.test(text[i + mark.length] || "")) continue;
    return i;
  }
  return -1;
}
