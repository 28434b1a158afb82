// The chat transcript: user and assistant messages as DOM nodes (Markdown or pretty JSON, tool
// calls, errors), each finished answer with a footer of stats, finish reason and actions.

import { el } from "./common.js";
import { copyText } from "./clipboard.js";
import { codeBlock, renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);

/** Show `messages` in the transcript; `onRegenerate` is the last answer's Regenerate action. */
export function renderMessages(messages, modelId, onRegenerate) {
  const box = $("messages");
  if (!messages.length) {
    box.replaceChildren(emptyState(modelId));
    return;
  }
  const lastAssistant = messages.findLastIndex((m) => m.role === "assistant");
  box.replaceChildren(
    ...messages.map((m, i) =>
      m.role === "user" ? userNode(m) : assistantNode(m, { last: i === lastAssistant, onRegenerate }),
    ),
  );
  scrollToEnd(true);
}

function emptyState(modelId) {
  return el(
    "div",
    { class: "empty" },
    el("h1", {}, "Chat with ", el("span", { class: "empty-model" }, modelId || "the model")),
    el("p", {}, "Answers stream from this server's OpenAI-compatible API, with time to first " +
      "token, throughput and prefix-cache hits per answer."),
    el("p", { class: "keys" },
      el("kbd", {}, "Enter"), " send · ",
      el("kbd", {}, "Shift"), "+", el("kbd", {}, "Enter"), " new line · ",
      el("kbd", {}, "Esc"), " stop"),
  );
}

function userNode(m) {
  return el("article", { class: "message user" }, el("div", { class: "bubble" }, m.content));
}

/** An assistant message: content, tool calls, error, then (once finished) a footer with stats
 * and actions; the last answer gets a Regenerate button calling `onRegenerate`. */
export function assistantNode(m, { last = false, streaming = false, onRegenerate = null } = {}) {
  const node = el(
    "article",
    { class: "message assistant", "aria-busy": streaming ? "true" : null },
    el("div", { class: "content" }),
    el("div", { class: "tool-calls" }),
  );
  renderBody(node, m, streaming);
  if (m.error) node.append(el("p", { class: "error", role: "alert" }, m.error));
  if (!streaming) node.append(footer(m, last, onRegenerate));
  return node;
}

/** (Re)render the parts of an answer that grow while it streams. */
export function renderBody(node, m, streaming) {
  const content = node.querySelector(".content");
  if (m.format === "json_object") content.replaceChildren(jsonBlock(m.content));
  else content.replaceChildren(renderMarkdown(m.content));
  if (streaming && !m.content && !m.tool_calls?.length) {
    const dots = [el("span"), el("span"), el("span")];
    content.replaceChildren(el("span", { class: "typing", "aria-label": "Generating" }, ...dots));
  }
  content.hidden = !streaming && !m.content;
  node.querySelector(".tool-calls").replaceChildren(...(m.tool_calls || []).map(toolCallNode));
}

/** A JSON answer pretty-printed when it parses (raw while it does not yet). */
function jsonBlock(text) {
  if (!text) return document.createDocumentFragment();
  let shown = text;
  try {
    shown = JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    // partial or invalid JSON: shown as written
  }
  return codeBlock(shown, "json");
}

function toolCallNode(call) {
  let args = call.function?.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // partial arguments while streaming: shown as written
  }
  return el(
    "div",
    { class: "tool-call" },
    el("div", { class: "tool-head" }, el("span", { class: "tool-label" }, "Tool call"), " ",
      el("code", { class: "tool-name" }, call.function?.name || "…"),
      call.id ? el("span", { class: "tool-id" }, call.id) : null),
    el("pre", { class: "tool-args" }, args),
  );
}

function footer(m, last, onRegenerate) {
  const foot = el("footer", { class: "message-foot" });
  if (m.stats) foot.append(statsNode(m.stats));
  if (m.finish_reason && m.finish_reason !== "stop") {
    const kind = `finish-reason finish-${m.finish_reason.replace(/\W/g, "")}`;
    foot.append(el("span", { class: kind, title: "Finish reason" }, m.finish_reason));
  }
  const actions = el("div", { class: "message-actions" });
  const copy = el("button", { type: "button", class: "copy", title: "Copy the answer's text" }, "Copy");
  copy.addEventListener("click", async () => {
    const ok = await copyText(m.content || toolCallsText(m));
    flash(copy, ok ? "Copied" : "Copy failed", "Copy");
  });
  if (m.content || m.tool_calls?.length) actions.append(copy);
  if (last) {
    const title = "Drop this answer and ask again";
    const again = el("button", { type: "button", class: "regenerate", title }, "Regenerate");
    again.addEventListener("click", onRegenerate);
    actions.append(again);
  }
  foot.append(actions);
  return foot;
}

function toolCallsText(m) {
  return (m.tool_calls || []).map((t) => `${t.function?.name}(${t.function?.arguments || ""})`).join("\n");
}

function flash(button, text, back) {
  button.textContent = text;
  setTimeout(() => (button.textContent = back), 1500);
}

/** The stats line; its data-* attributes carry the raw figures. */
function statsNode(stats) {
  const node = el("div", { class: "answer-stats" });
  const parts = [];
  if (stats.ttft_ms !== undefined) {
    node.dataset.ttftMs = String(stats.ttft_ms);
    const title = "Time to first token, measured in this page";
    parts.push(el("span", { title }, `TTFT ${stats.ttft_ms} ms`));
  }
  if (stats.tokens_per_second) {
    const title = "Completion tokens per second, from the first token to the last";
    parts.push(el("span", { title }, `${stats.tokens_per_second.toFixed(1)} tok/s`));
  }
  if (stats.usage) parts.push(...usageParts(node, stats.usage));
  parts.forEach((part, i) => {
    if (i) node.append(el("span", { class: "sep", "aria-hidden": "true" }, "·"));
    node.append(part);
  });
  return node;
}

/** The token counts (also set as data-* attributes of `node`), with cache tier chips. */
function usageParts(node, usage) {
  const cached = usage.prompt_tokens_details?.cached_tokens || 0;
  const tiers = usage.prompt_tokens_details?.cached_tokens_details || {};
  Object.assign(node.dataset, {
    promptTokens: String(usage.prompt_tokens ?? 0),
    completionTokens: String(usage.completion_tokens ?? 0),
    cached: String(cached),
    cachedDevice: String(tiers.device || 0),
    cachedHost: String(tiers.host || 0),
    cachedDisk: String(tiers.disk || 0),
  });
  const title = "Prompt tokens, of which read from the prefix cache";
  const parts = [
    el("span", {}, `${usage.completion_tokens ?? 0} tokens`),
    el("span", { title }, `prompt ${usage.prompt_tokens ?? 0} tokens, ${cached} cached`),
  ];
  if (cached) {
    const chip = (tier) =>
      el("span", { class: `chip ${tier}`, title: `Cached tokens found in ${tier} memory` },
        `${tier} ${tiers[tier] || 0}`);
    parts.push(el("span", { class: "tiers" }, chip("device"), chip("host"), chip("disk")));
  }
  return parts;
}

/** Scroll the transcript to its end when it is near there already (always with `force`). */
export function scrollToEnd(force = false) {
  const box = $("messages");
  const near = box.scrollHeight - box.scrollTop - box.clientHeight < 120;
  if (force || near) box.scrollTop = box.scrollHeight;
}
