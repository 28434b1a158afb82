// A small Markdown renderer for untrusted text (model output). It builds DOM nodes with
// createElement / createTextNode only: no HTML string is ever parsed, so markup in the text
// (`<script>`, `<img onerror>`) stays literal text. This module parses the blocks (fences,
// headings, quotes, lists, tables, paragraphs); markdown_inline.js the text inside them, where
// links are made only for http:, https: and mailto: URLs and images are never loaded.

import { copyText } from "./clipboard.js";
import { MAX_DEPTH, inline, node } from "./markdown_inline.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
const TABLE_RULE = /^ {0,3}\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

/** Render `text` as Markdown into a DocumentFragment (DOM nodes only, never parsed HTML). */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  fragment.append(...blocks(lines, 0));
  return fragment;
}

// ---- blocks -------------------------------------------------------------------------------

/** Block elements for `lines` (nested quotes and lists recurse with `depth`). */
function blocks(lines, depth) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    const parsed =
      fencedCode(lines, i) ||
      heading(lines, i, depth) ||
      rule(lines, i) ||
      (depth < MAX_DEPTH && (quote(lines, i, depth) || list(lines, i, depth))) ||
      table(lines, i, depth) ||
      paragraph(lines, i, depth);
    out.push(parsed.element);
    i = parsed.next;
  }
  return out;
}

/** Whether `line` starts a block other than a paragraph (it ends a running paragraph). */
function startsBlock(line) {
  return (
    FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    /^ {0,3}([-*+]|1[.)])[ \t]+\S/.test(line)
  );
}

function fencedCode(lines, start) {
  const open = FENCE.exec(lines[start]);
  if (!open) return null;
  const marker = open[1];
  const indent = lines[start].length - lines[start].trimStart().length;
  const body = [];
  let i = start + 1;
  for (; i < lines.length; i++) {
    const close = lines[i].trim();
    if (close.startsWith(marker[0].repeat(marker.length)) && /^(`+|~+)$/.test(close)) {
      i++;
      break;
    }
    body.push(lines[i].replace(new RegExp(`^ {0,${indent}}`), ""));
  }
  return { element: codeBlock(body.join("\n"), open[2]), next: i };
}

/** A code block: a header with the language and a copy button over `<pre><code>`. */
export function codeBlock(code, language = "") {
  const lang = String(language).replace(/[^\w+#.-]/g, "").slice(0, 32);
  const codeEl = node("code", lang ? `language-${lang}` : "", code);
  const copy = node("button", "copy-code", "Copy");
  copy.type = "button";
  copy.setAttribute("aria-label", "Copy code");
  copy.addEventListener("click", async () => {
    const ok = await copyText(codeEl.textContent);
    copy.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  const head = node("div", "code-head", node("span", "code-lang", lang || "text"), copy);
  return node("div", "code-block", head, node("pre", "", codeEl));
}

function heading(lines, start, depth) {
  const match = HEADING.exec(lines[start]);
  if (!match) return null;
  const element = node(`h${match[1].length}`, "", ...inline(match[2] || "", depth));
  return { element, next: start + 1 };
}

function rule(lines, start) {
  if (!RULE.test(lines[start])) return null;
  return { element: document.createElement("hr"), next: start + 1 };
}

function quote(lines, start, depth) {
  if (!QUOTE.test(lines[start])) return null;
  const body = [];
  let i = start;
  for (; i < lines.length; i++) {
    const match = QUOTE.exec(lines[i]);
    if (match) body.push(match[1]);
    else if (lines[i].trim() && !startsBlock(lines[i]) && body.at(-1)?.trim()) body.push(lines[i]);
    else break;
  }
  return { element: node("blockquote", "", ...blocks(body, depth + 1)), next: i };
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

/** A bullet or numbered list: items at the first item's indent; deeper lines belong to the item
 * above (nested lists included); a blank line ends the list unless the list goes on after it. */
function list(lines, start, depth) {
  const first = LIST_ITEM.exec(lines[start]);
  if (!first || (indentOf(lines[start]) > 3 && depth === 0)) return null;
  const ordered = /\d/.test(first[2]);
  const base = first[1].length;
  const element = document.createElement(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) element.setAttribute("start", String(parseInt(first[2], 10)));
  let i = start;
  while (i < lines.length) {
    const match = LIST_ITEM.exec(lines[i]);
    if (!match || match[1].length > base + 1 || /\d/.test(match[2]) !== ordered) break;
    const contentIndent = match[1].length + match[2].length + 1;
    const body = [match[3] || ""];
    i++;
    for (; i < lines.length; i++) {
      const line = lines[i];
      if (!line.trim()) {
        const nextLine = lines[i + 1];
        if (nextLine !== undefined && nextLine.trim() && indentOf(nextLine) >= contentIndent) {
          body.push("");
          continue;
        }
        break;
      }
      if (indentOf(line) >= Math.min(contentIndent, base + 2)) {
        body.push(line.slice(Math.min(indentOf(line), contentIndent)));
      } else if (!startsBlock(line) && !LIST_ITEM.test(line)) {
        body.push(line.trim());
      } else {
        break;
      }
    }
    element.append(listItem(body, depth));
    if (i < lines.length && !lines[i].trim()) {
      const after = lines.slice(i).findIndex((l) => l.trim());
      const next = after < 0 ? -1 : i + after;
      const resumes = next >= 0 && LIST_ITEM.exec(lines[next]);
      if (!resumes || resumes[1].length > base + 1) break;
      i = next;
    }
  }
  return { element, next: i };
}

function listItem(body, depth) {
  const children = blocks(body, depth + 1);
  const li = document.createElement("li");
  if (children.length === 1 && children[0].tagName === "P") li.append(...children[0].childNodes);
  else if (children.length && children[0].tagName === "P") {
    li.append(...children[0].childNodes, ...children.slice(1));
  } else li.append(...children);
  return li;
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

/** A pipe table: a header row, a `|---|---|` rule, then rows (until a blank or non-table line). */
function table(lines, start, depth) {
  if (!lines[start].includes("|") || !TABLE_RULE.test(lines[start + 1] || "")) return null;
  if (!lines[start + 1].includes("|")) return null;
  const header = splitRow(lines[start]);
  const align = splitRow(lines[start + 1]).map((c) =>
    c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : c.startsWith(":") ? "left" : "",
  );
  const row = (cells, tag) =>
    node("tr", "", ...header.map((_, k) => {
      const cell = node(tag, "", ...inline(cells[k] || "", depth));
      if (align[k]) cell.className = `align-${align[k]}`;
      return cell;
    }));
  const tbody = document.createElement("tbody");
  let i = start + 2;
  for (; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
    tbody.append(row(splitRow(lines[i]), "td"));
  }
  const element = node("div", "table-wrap", node("table", "", node("thead", "", row(header, "th")), tbody));
  return { element, next: i };
}

function paragraph(lines, start, depth) {
  const body = [lines[start].trim()];
  let i = start + 1;
  for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) {
    if (TABLE_RULE.test(lines[i + 1] || "") && lines[i].includes("|")) break;
    body.push(lines[i].trim());
  }
  const element = document.createElement("p");
  body.forEach((line, k) => {
    if (k) element.append(document.createElement("br"));
    element.append(...inline(line, depth));
  });
  return { element, next: i };
}
