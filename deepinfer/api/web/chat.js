// The chat playground: conversations kept in local storage, answers streamed from this server's
// OpenAI endpoint (v1/chat/completions) and rendered as Markdown (markdown.js builds DOM nodes,
// never HTML), with the per-answer latency, throughput and prefix-cache figures from `usage`.

import { apiFetch, askForKey, el, sseData } from "./common.js";
import { codeBlock, copyText, renderMarkdown } from "./markdown.js";

const PREFIX = "deepinfer.chat.";
const INDEX_KEY = `${PREFIX}index`;
const CURRENT_KEY = `${PREFIX}current`;
const TITLE_LENGTH = 48;
const NARROW = window.matchMedia("(max-width: 799.98px)");

/** Settings controls: element id -> settings key, with defaults (kept as the typed strings). */
const FIELDS = [
  { id: "system", key: "system", value: "" },
  { id: "temperature", key: "temperature", value: "0.7" },
  { id: "top-p", key: "top_p", value: "1" },
  { id: "max-tokens", key: "max_tokens", value: "512" },
  { id: "seed", key: "seed", value: "" },
  { id: "reasoning-effort", key: "reasoning_effort", value: "" },
  { id: "retention", key: "retention", value: "" },
  { id: "response-format", key: "response_format", value: "text" },
  { id: "tools", key: "tools", value: "" },
  { id: "tool-choice", key: "tool_choice", value: "" },
];

const $ = (id) => document.getElementById(id);

/** @type {{id: string, title: string, created: number, updated: number,
 *          settings: Object<string, string>, messages: Object[]}} */
let conv;
/** The answer being streamed: {conv, msg, node, controller, sent, first, last, frame}. */
let running = null;
let modelId = null;
let saveTimer = 0;

// ---- storage ------------------------------------------------------------------------------

const store = {
  key: (id) => `${PREFIX}conversation.${id}`,
  read(key, fallback) {
    try {
      return JSON.parse(localStorage.getItem(key)) ?? fallback;
    } catch {
      return fallback;
    }
  },
  /** [{id, title, updated}], most recently updated first. */
  index() {
    const list = store.read(INDEX_KEY, []);
    return Array.isArray(list) ? list.filter((c) => c && typeof c.id === "string") : [];
  },
  load(id) {
    const c = id && store.read(store.key(id), null);
    if (!c || !Array.isArray(c.messages)) return null;
    c.settings = { ...defaultSettings(), ...(c.settings || {}) };
    return c;
  },
  save(c) {
    const entry = { id: c.id, title: c.title, updated: c.updated };
    const list = [entry, ...store.index().filter((x) => x.id !== c.id)];
    list.sort((a, b) => b.updated - a.updated);
    try {
      localStorage.setItem(store.key(c.id), JSON.stringify(c));
      localStorage.setItem(INDEX_KEY, JSON.stringify(list));
      localStorage.setItem(CURRENT_KEY, c.id);
    } catch (error) {
      showComposerError(`Could not save the conversation in this browser: ${error.message}`);
    }
  },
  remove(id) {
    localStorage.removeItem(store.key(id));
    localStorage.setItem(INDEX_KEY, JSON.stringify(store.index().filter((x) => x.id !== id)));
  },
};

function defaultSettings() {
  return Object.fromEntries(FIELDS.map((f) => [f.key, f.value]));
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function newConversation(settings = defaultSettings()) {
  const now = Date.now();
  return { id: newId(), title: "", created: now, updated: now, settings: { ...settings }, messages: [] };
}

function saveSoon() {
  clearTimeout(saveTimer);
  saveTimer = setTimeout(() => store.save(conv), 300);
}

function saveNow(c = conv) {
  clearTimeout(saveTimer);
  c.updated = Date.now();
  store.save(c);
}

// ---- conversations ------------------------------------------------------------------------

function titleOf(text) {
  const line = text.replace(/\s+/g, " ").trim();
  return line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line;
}

/** Switch to conversation `next`; an empty conversation left behind is dropped. */
function openConversation(next) {
  stopAnswer();
  if (conv && conv.id !== next.id && conv.messages.length === 0) store.remove(conv.id);
  conv = next;
  localStorage.setItem(CURRENT_KEY, conv.id);
  fillSettings();
  renderConversations();
  renderMessages();
  showComposerError("");
  closeSidebar();
}

function newChat() {
  if (conv.messages.length === 0) {
    closeSidebar();
    $("prompt").focus();
    return;
  }
  const next = newConversation(conv.settings);
  store.save(next);
  openConversation(next);
  $("prompt").focus();
}

function deleteConversation(id, title) {
  if (!confirm(`Delete the conversation “${title || "New chat"}”?`)) return;
  if (running?.conv.id === id) {
    running.conv.deleted = true;
    stopAnswer();
  }
  store.remove(id);
  if (conv.id !== id) {
    renderConversations();
    return;
  }
  const settings = conv.settings;
  conv = null;
  openConversation(store.load(store.index()[0]?.id) || freshConversation(settings));
}

function freshConversation(settings = conv.settings) {
  const c = newConversation(settings);
  store.save(c);
  return c;
}

function renderConversations() {
  const list = store.index();
  if (!list.some((c) => c.id === conv.id)) list.unshift(conv);
  $("conversations").replaceChildren(
    ...list.map((c) => {
      const title = c.title || "New chat";
      const open = el("button", { type: "button", class: "open", title }, title);
      open.addEventListener("click", () => {
        if (c.id !== conv.id) openConversation(store.load(c.id) || freshConversation());
        else closeSidebar();
      });
      const label = `Delete “${title}”`;
      const remove = el("button", { type: "button", class: "delete", "aria-label": label }, "×");
      remove.addEventListener("click", () => deleteConversation(c.id, c.title));
      const current = c.id === conv.id ? "true" : null;
      return el("li", { class: "conversation", "data-id": c.id, "aria-current": current }, open, remove);
    }),
  );
}

// ---- settings -----------------------------------------------------------------------------

function fillSettings() {
  for (const f of FIELDS) $(f.id).value = conv.settings[f.key] ?? f.value;
  setToolsError("");
}

function bindSettings() {
  for (const f of FIELDS) {
    const control = $(f.id);
    const update = () => {
      conv.settings[f.key] = control.value;
      if (f.key === "tools") setToolsError("");
      saveSoon();
    };
    control.addEventListener("input", update);
    control.addEventListener("change", update);
  }
}

function setToolsError(message) {
  const box = $("tools-error");
  box.textContent = message;
  box.hidden = !message;
  if (message) $("tools").setAttribute("aria-invalid", "true");
  else $("tools").removeAttribute("aria-invalid");
}

/** A number field's value, or undefined when empty or not a number. */
function numberOf(text, integer = false) {
  if (String(text ?? "").trim() === "") return undefined;
  const n = Number(text);
  if (!Number.isFinite(n)) return undefined;
  return integer ? Math.trunc(n) : n;
}

/** The tools setting as a list, or an Error's message thrown when it is not a JSON array. */
function parseTools(text) {
  if (!String(text ?? "").trim()) return undefined;
  let tools;
  try {
    tools = JSON.parse(text);
  } catch (error) {
    throw new Error(`Tools: not valid JSON (${error.message}).`);
  }
  if (!Array.isArray(tools)) throw new Error("Tools: expected a JSON array of tool definitions.");
  return tools.length ? tools : undefined;
}

/** The request body for the conversation's messages (throws on invalid tools JSON). */
function requestBody(c) {
  const s = c.settings;
  const body = { messages: history(c), stream: true, stream_options: { include_usage: true } };
  if (modelId) body.model = modelId;
  const fields = {
    temperature: numberOf(s.temperature),
    top_p: numberOf(s.top_p),
    max_tokens: numberOf(s.max_tokens, true),
    seed: numberOf(s.seed, true),
    reasoning_effort: s.reasoning_effort || undefined,
    cache_retention: s.retention || undefined,
    response_format: s.response_format === "json_object" ? { type: "json_object" } : undefined,
    tools: parseTools(s.tools),
  };
  if (fields.tools) fields.tool_choice = s.tool_choice || undefined;
  for (const [name, value] of Object.entries(fields)) if (value !== undefined) body[name] = value;
  return body;
}

/** The messages sent to the model: the system prompt, then each turn. Failed empty answers are
 * left out, and so are calls whose arguments are not JSON (an answer stopped mid-call). */
function history(c) {
  const out = [];
  if (c.settings.system?.trim()) out.push({ role: "system", content: c.settings.system });
  for (const m of c.messages) {
    if (m.role === "user") {
      out.push({ role: "user", content: m.content });
      continue;
    }
    const calls = (m.tool_calls || []).filter((t) => isJson(t.function?.arguments));
    if (!m.content && !calls.length) continue;
    const turn = { role: "assistant", content: m.content || "" };
    if (calls.length) turn.tool_calls = calls;
    out.push(turn);
  }
  return out;
}

function isJson(text) {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

// ---- messages -----------------------------------------------------------------------------

function renderMessages() {
  const box = $("messages");
  if (!conv.messages.length) {
    box.replaceChildren(emptyState());
    return;
  }
  const lastAssistant = conv.messages.findLastIndex((m) => m.role === "assistant");
  box.replaceChildren(
    ...conv.messages.map((m, i) =>
      m.role === "user" ? userNode(m) : assistantNode(m, i === lastAssistant),
    ),
  );
  scrollToEnd(true);
}

function emptyState() {
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

/** An assistant message: content, tool calls, error, then a footer with stats and actions. */
function assistantNode(m, last, streaming = false) {
  const node = el(
    "article",
    { class: "message assistant", "aria-busy": streaming ? "true" : null },
    el("div", { class: "content" }),
    el("div", { class: "tool-calls" }),
  );
  renderBody(node, m, streaming);
  if (m.error) node.append(el("p", { class: "error", role: "alert" }, m.error));
  if (!streaming) node.append(footer(m, last));
  return node;
}

/** (Re)render the parts of an answer that grow while it streams. */
function renderBody(node, m, streaming) {
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

function footer(m, last) {
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
    again.addEventListener("click", regenerate);
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

function scrollToEnd(force = false) {
  const box = $("messages");
  const near = box.scrollHeight - box.scrollTop - box.clientHeight < 120;
  if (force || near) box.scrollTop = box.scrollHeight;
}

// ---- asking -------------------------------------------------------------------------------

async function send() {
  if (running) return;
  const prompt = $("prompt");
  const text = prompt.value.trim();
  if (!text) return;
  if (!checkSettings()) return;
  conv.messages.push({ role: "user", content: text });
  if (!conv.title) conv.title = titleOf(text);
  prompt.value = "";
  autosize();
  await ask();
}

async function regenerate() {
  if (running) return;
  const last = conv.messages.findLastIndex((m) => m.role === "assistant");
  if (last < 0 || !checkSettings()) return;
  conv.messages.splice(last, 1);
  await ask();
}

/** Whether the settings make a valid request; shows why not. */
function checkSettings() {
  try {
    parseTools(conv.settings.tools);
  } catch (error) {
    setToolsError(error.message);
    showComposerError(error.message);
    return false;
  }
  setToolsError("");
  showComposerError("");
  return true;
}

/** Stream an answer to the conversation as it stands and append it. */
async function ask() {
  const body = requestBody(conv);
  const msg = { role: "assistant", content: "" };
  if (conv.settings.response_format === "json_object") msg.format = "json_object";
  conv.messages.push(msg);
  saveNow();
  renderConversations();
  renderMessages();
  const node = assistantNode(msg, true, true);
  $("messages").lastElementChild.replaceWith(node);
  const controller = new AbortController();
  const run = { conv, msg, node, controller, sent: performance.now(), first: 0, last: 0, frame: 0 };
  running = run;
  setRunning(true);
  try {
    await stream(run, body);
  } catch (error) {
    if (run.controller.signal.aborted) msg.finish_reason = "stopped";
    else msg.error = error.message || String(error);
  }
  finishAnswer(run);
}

async function stream(run, body) {
  const response = await apiFetch("v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal: run.controller.signal,
  });
  for await (const data of sseData(response)) {
    if (data === "[DONE]") break;
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch {
      continue;
    }
    if (chunk.error) {
      run.msg.error = chunk.error.message || "The stream failed.";
      break;
    }
    applyChunk(run, chunk);
  }
}

/** Fold one chat.completion.chunk into the answer (choice 0 only). */
function applyChunk(run, chunk) {
  const msg = run.msg;
  if (chunk.usage) run.usage = chunk.usage;
  for (const choice of chunk.choices || []) {
    if (choice.index) continue;
    const delta = choice.delta || {};
    let grew = false;
    if (delta.content) {
      msg.content += delta.content;
      grew = true;
    }
    for (const part of delta.tool_calls || []) {
      mergeToolCall(msg, part);
      grew = true;
    }
    if (choice.finish_reason) msg.finish_reason = choice.finish_reason;
    if (grew) {
      const now = performance.now();
      if (!run.first) run.first = now;
      run.last = now;
      scheduleRender(run);
    }
  }
}

function mergeToolCall(msg, part) {
  msg.tool_calls ||= [];
  const i = part.index ?? 0;
  const call = (msg.tool_calls[i] ||= { id: "", type: "function", function: { name: "", arguments: "" } });
  if (part.id) call.id = part.id;
  if (part.type) call.type = part.type;
  if (part.function?.name) call.function.name += part.function.name;
  if (part.function?.arguments) call.function.arguments += part.function.arguments;
}

/** Re-render the streaming answer at most once per animation frame. */
function scheduleRender(run) {
  if (run.frame) return;
  run.frame = requestAnimationFrame(() => {
    run.frame = 0;
    if (running !== run) return;
    renderBody(run.node, run.msg, true);
    scrollToEnd();
  });
}

function finishAnswer(run) {
  cancelAnimationFrame(run.frame);
  const { msg } = run;
  msg.tool_calls = msg.tool_calls?.filter(Boolean);
  if (!msg.tool_calls?.length) delete msg.tool_calls;
  msg.stats = answerStats(run);
  if (!msg.stats) delete msg.stats;
  if (running === run) running = null;
  if (!run.conv.deleted) saveNow(run.conv);
  if (run.conv === conv) {
    const last = conv.messages.at(-1) === msg;
    const node = assistantNode(msg, last);
    if (run.node.isConnected) run.node.replaceWith(node);
    scrollToEnd();
    const stopped = msg.finish_reason === "stopped";
    announce(msg.error ? "The answer failed." : stopped ? "Answer stopped." : "Answer complete.");
  }
  renderConversations();
  setRunning(false);
  if (!modelId && !msg.error) loadModel();
}

/** TTFT (ms, sending to the first content or call delta), tokens/s (completion tokens over the
 * time from the first delta to the last) and the usage, as far as known. */
function answerStats(run) {
  const stats = {};
  if (run.first) stats.ttft_ms = Math.round(run.first - run.sent);
  if (run.usage) {
    stats.usage = run.usage;
    const seconds = (run.last - run.first) / 1000;
    if (run.first && seconds > 0) stats.tokens_per_second = run.usage.completion_tokens / seconds;
  }
  return Object.keys(stats).length ? stats : null;
}

function stopAnswer() {
  running?.controller.abort();
}

function setRunning(on) {
  const stop = $("stop");
  stop.hidden = !on;
  stop.disabled = !on;
  $("send").disabled = on;
  document.body.classList.toggle("streaming", on);
  if (!on && !NARROW.matches && document.activeElement === document.body) $("prompt").focus();
}

function showComposerError(message) {
  const box = $("composer-error");
  box.textContent = message;
  box.hidden = !message;
}

function announce(text) {
  $("status").textContent = text;
}

// ---- composer, sidebar, model, key --------------------------------------------------------

function autosize() {
  const prompt = $("prompt");
  prompt.style.height = "auto";
  prompt.style.height = `${Math.min(prompt.scrollHeight, window.innerHeight * 0.4)}px`;
}

function bindComposer() {
  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  prompt.addEventListener("input", autosize);
  $("stop").addEventListener("click", stopAnswer);
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Escape" || document.querySelector("dialog[open]")) return;
    if (running) {
      event.preventDefault();
      stopAnswer();
    } else if (document.body.classList.contains("sidebar-open")) {
      closeSidebar();
      $("sidebar-toggle").focus();
    }
  });
}

function openSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("sidebar-toggle").setAttribute("aria-expanded", String(open));
  $("scrim").hidden = !open;
  if (open) $("new-chat").focus();
}

function closeSidebar() {
  if (document.body.classList.contains("sidebar-open")) openSidebar(false);
}

function bindSidebar() {
  $("sidebar-toggle").addEventListener("click", () =>
    openSidebar(!document.body.classList.contains("sidebar-open")),
  );
  $("scrim").addEventListener("click", closeSidebar);
  $("sidebar-close").addEventListener("click", () => {
    closeSidebar();
    $("sidebar-toggle").focus();
  });
  NARROW.addEventListener("change", () => closeSidebar());
  $("new-chat").addEventListener("click", newChat);
}

async function loadModel() {
  const label = $("model");
  try {
    const response = await apiFetch("v1/models");
    const body = await response.json();
    modelId = body?.data?.[0]?.id || null;
    label.textContent = modelId || "no model";
    label.classList.remove("unavailable");
  } catch (error) {
    label.textContent = "model unavailable";
    label.title = error.message;
    label.classList.add("unavailable");
  }
  const name = document.querySelector(".empty-model");
  if (name && modelId) name.textContent = modelId;
}

function bindKey() {
  $("key-button").addEventListener("click", async () => {
    if (await askForKey()) loadModel();
  });
  $("key-cancel").addEventListener("click", () => $("key-dialog").dispatchEvent(new Event("cancel")));
}

function start() {
  const index = store.index();
  conv = store.load(localStorage.getItem(CURRENT_KEY)) || store.load(index[0]?.id) || newConversation();
  bindSettings();
  bindComposer();
  bindSidebar();
  bindKey();
  fillSettings();
  renderConversations();
  renderMessages();
  setRunning(false);
  autosize();
  loadModel();
  if (!NARROW.matches) $("prompt").focus();
}

start();
