// The chat sidebar: the list of conversations, and opening and closing the sidebar (a drawer
// on narrow screens).

import { el } from "./common.js";

const $ = (id) => document.getElementById(id);

/** Narrow screens: the sidebar is a drawer and the prompt is not focused on its own. */
export const NARROW = window.matchMedia("(max-width: 799.98px)");

/** List `conversations` ({id, title}), marking `currentId`; `onOpen(c)` and `onDelete(c)` are
 * called by each entry's buttons. */
export function renderConversationList(conversations, currentId, { onOpen, onDelete }) {
  $("conversations").replaceChildren(
    ...conversations.map((c) => {
      const title = c.title || "New chat";
      const open = el("button", { type: "button", class: "open", title }, title);
      open.addEventListener("click", () => onOpen(c));
      const label = `Delete “${title}”`;
      const remove = el("button", { type: "button", class: "delete", "aria-label": label }, "×");
      remove.addEventListener("click", () => onDelete(c));
      const current = c.id === currentId ? "true" : null;
      return el("li", { class: "conversation", "data-id": c.id, "aria-current": current }, open, remove);
    }),
  );
}

export function isSidebarOpen() {
  return document.body.classList.contains("sidebar-open");
}

function openSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("sidebar-toggle").setAttribute("aria-expanded", String(open));
  $("scrim").hidden = !open;
  if (open) $("new-chat").focus();
}

export function closeSidebar() {
  if (isSidebarOpen()) openSidebar(false);
}

/** Wire the toggle, scrim and close buttons; `onNewChat` runs on the New chat button. */
export function bindSidebar(onNewChat) {
  $("sidebar-toggle").addEventListener("click", () => openSidebar(!isSidebarOpen()));
  $("scrim").addEventListener("click", closeSidebar);
  $("sidebar-close").addEventListener("click", () => {
    closeSidebar();
    $("sidebar-toggle").focus();
  });
  NARROW.addEventListener("change", () => closeSidebar());
  $("new-chat").addEventListener("click", onNewChat);
}
