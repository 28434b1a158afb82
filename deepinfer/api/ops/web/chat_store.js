// Chat conversations kept in this browser's local storage: an index of {id, title, updated},
// one item per conversation, and the id of the open one; plus the settings fields and their
// defaults, which every conversation carries.

const PREFIX = "deepinfer.chat.";
const INDEX_KEY = `${PREFIX}index`;
const CURRENT_KEY = `${PREFIX}current`;
const TITLE_LENGTH = 48;

/** Settings controls: element id -> settings key, with defaults (kept as the typed strings). */
export const FIELDS = [
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

export function defaultSettings() {
  return Object.fromEntries(FIELDS.map((f) => [f.key, f.value]));
}

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

/** @returns {{id: string, title: string, created: number, updated: number,
 *             settings: Object<string, string>, messages: Object[]}} */
export function newConversation(settings = defaultSettings()) {
  const now = Date.now();
  return { id: newId(), title: "", created: now, updated: now, settings: { ...settings }, messages: [] };
}

/** A conversation's title: the first prompt on one line, shortened. */
export function titleOf(text) {
  const line = text.replace(/\s+/g, " ").trim();
  return line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line;
}

/** The conversation store; `onSaveError(message)` is told when the browser refuses a save. */
export function conversationStore(onSaveError) {
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
        onSaveError(`Could not save the conversation in this browser: ${error.message}`);
      }
    },
    remove(id) {
      localStorage.removeItem(store.key(id));
      localStorage.setItem(INDEX_KEY, JSON.stringify(store.index().filter((x) => x.id !== id)));
    },
    /** The id of the conversation open last (null when none). */
    currentId() {
      return localStorage.getItem(CURRENT_KEY);
    },
    setCurrentId(id) {
      localStorage.setItem(CURRENT_KEY, id);
    },
  };
  return store;
}
