// The chat request and its answer stream: the v1/chat/completions body built from a
// conversation and its settings, and the folding of streamed chunks into the answer message,
// with the answer's timing figures.

import { apiFetch, sseData } from "./common.js";

/** A number field's value, or undefined when empty or not a number. */
function numberOf(text, integer = false) {
  if (String(text ?? "").trim() === "") return undefined;
  const n = Number(text);
  if (!Number.isFinite(n)) return undefined;
  return integer ? Math.trunc(n) : n;
}

/** The tools setting as a list, or an Error's message thrown when it is not a JSON array. */
export function parseTools(text) {
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
export function requestBody(c, modelId) {
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

/**
 * Send `body` and fold the streamed chunks into `run.msg`; `onGrow(run)` is called whenever the
 * answer's content or tool calls grew. `run` holds {msg, controller, sent, first, last, usage}.
 */
export async function streamAnswer(run, body, onGrow) {
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
    applyChunk(run, chunk, onGrow);
  }
}

/** Fold one chat.completion.chunk into the answer (choice 0 only). */
function applyChunk(run, chunk, onGrow) {
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
      onGrow(run);
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

/** Tidy a finished answer: drop missing tool-call slots, attach its stats when any. */
export function settleAnswer(run) {
  const { msg } = run;
  msg.tool_calls = msg.tool_calls?.filter(Boolean);
  if (!msg.tool_calls?.length) delete msg.tool_calls;
  msg.stats = answerStats(run);
  if (!msg.stats) delete msg.stats;
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
