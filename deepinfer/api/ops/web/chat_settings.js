// The chat settings form: filled from a conversation's settings, reporting each edit, and
// marking an invalid tools definition.

import { FIELDS } from "./chat_store.js";

const $ = (id) => document.getElementById(id);

/** Show `settings` in the form (defaults where a key is missing). */
export function fillSettings(settings) {
  for (const f of FIELDS) $(f.id).value = settings[f.key] ?? f.value;
  setToolsError("");
}

/** Call `onChange(key, value)` on every edit of a settings control. */
export function bindSettings(onChange) {
  for (const f of FIELDS) {
    const control = $(f.id);
    const update = () => {
      onChange(f.key, control.value);
      if (f.key === "tools") setToolsError("");
    };
    control.addEventListener("input", update);
    control.addEventListener("change", update);
  }
}

/** Show (or, with "", clear) the error under the tools field. */
export function setToolsError(message) {
  const box = $("tools-error");
  box.textContent = message;
  box.hidden = !message;
  if (message) $("tools").setAttribute("aria-invalid", "true");
  else $("tools").removeAttribute("aria-invalid");
}
