// The chat playground: conversations kept in local storage (chat_store.js), answers streamed
// from this server's OpenAI endpoint (chat_request.js) and rendered as Markdown (chat_view.js),
// with the per-answer latency, throughput and prefix-cache figures from `usage`. This module
// holds the page's state and wires the composer, sidebar, settings and key dialog together.

import { apiFetch, askForKey } from "./common.js";
import { conversationStore, newConversation, titleOf } from "./chat_store.js";
import { parseTools, requestBody, settleAnswer, streamAnswer } from "./chat_request.js";
import { bindSettings, fillSettings, setToolsError } from "./chat_settings.js";
import { NARROW, bindSidebar, closeSidebar, isSidebarOpen, renderConversationList } from "./chat_sidebar.js";
import { assistantNode, renderBody, renderMessages, scrollToEnd } from "./chat_view.js";

const $ = (id) => document.getElementById(id);

const store = conversationStore(showComposerError);
/** The open conversation (see newConversation in chat_store.js). */
let conv;
/** The answer being streamed: {conv, msg, node, controller, sent, first, last, frame}. */
let running = null;
let modelId = null;
let saveTimer = 0;

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

/** Switch to conversation `next`; an empty conversation left behind is dropped. */
function openConversation(next) {
  stopAnswer();
  if (conv && conv.id !== next.id && conv.messages.length === 0) store.remove(conv.id);
  conv = next;
  store.setCurrentId(conv.id);
  fillSettings(conv.settings);
  renderConversations();
  showMessages();
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
  renderConversationList(list, conv.id, {
    onOpen: (c) => {
      if (c.id !== conv.id) openConversation(store.load(c.id) || freshConversation());
      else closeSidebar();
    },
    onDelete: (c) => deleteConversation(c.id, c.title),
  });
}

function showMessages() {
  renderMessages(conv.messages, modelId, regenerate);
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
  const body = requestBody(conv, modelId);
  const msg = { role: "assistant", content: "" };
  if (conv.settings.response_format === "json_object") msg.format = "json_object";
  conv.messages.push(msg);
  saveNow();
  renderConversations();
  showMessages();
  const node = assistantNode(msg, { last: true, streaming: true });
  $("messages").lastElementChild.replaceWith(node);
  const controller = new AbortController();
  const run = { conv, msg, node, controller, sent: performance.now(), first: 0, last: 0, frame: 0 };
  running = run;
  setRunning(true);
  try {
    await streamAnswer(run, body, scheduleRender);
  } catch (error) {
    if (run.controller.signal.aborted) msg.finish_reason = "stopped";
    else msg.error = error.message || String(error);
  }
  finishAnswer(run);
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
  settleAnswer(run);
  if (running === run) running = null;
  if (!run.conv.deleted) saveNow(run.conv);
  if (run.conv === conv) {
    const last = conv.messages.at(-1) === msg;
    const node = assistantNode(msg, { last, onRegenerate: regenerate });
    if (run.node.isConnected) run.node.replaceWith(node);
    scrollToEnd();
    const stopped = msg.finish_reason === "stopped";
    announce(msg.error ? "The answer failed." : stopped ? "Answer stopped." : "Answer complete.");
  }
  renderConversations();
  setRunning(false);
  if (!modelId && !msg.error) loadModel();
}

function stopAnswer() {
  running?.controller.abort();
}

// ---- composer, model, key -----------------------------------------------------------------

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
    } else if (isSidebarOpen()) {
      closeSidebar();
      $("sidebar-toggle").focus();
    }
  });
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
  conv = store.load(store.currentId()) || store.load(index[0]?.id) || newConversation();
  bindSettings((key, value) => {
    conv.settings[key] = value;
    saveSoon();
  });
  bindComposer();
  bindSidebar(newChat);
  bindKey();
  fillSettings(conv.settings);
  renderConversations();
  showMessages();
  setRunning(false);
  autosize();
  loadModel();
  if (!NARROW.matches) $("prompt").focus();
}

start();
