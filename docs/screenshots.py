"""Take the screenshots of the web pages shown in docs/operations.md (docs/chat.png,
docs/dashboard.png, docs/chat-phone.png): the default model served from this tree, the pages in
headless Chromium.

    python docs/screenshots.py                  # needs /usr/bin/chromium and playwright

The chat page gets a two-turn conversation (greedy, so the answers are the model's own and
repeatable); the dashboard is taken after a minute of streaming load whose requests share a
long system prompt, so the prefix cache is seen at work.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PORT = 8765
URL = f"http://127.0.0.1:{PORT}"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
SYSTEM = "You are a concise assistant for a team of travel writers. " * 12
QUESTIONS = ["Name a city in Spain.", "Suggest a quiet beach.", "What should I pack?",
             "Name a mountain in Italy.", "Recommend a museum in Paris."]  # fmt: skip


def start_server(cache_dir: str) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(
        [sys.executable, "server.py", "--port", str(PORT), "--cache-dir", cache_dir],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(600):
        try:
            if httpx.get(f"{URL}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start")


def chat(page: Page, path: Path) -> None:
    page.goto(URL + "/")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "160")
    for i, question in enumerate(
        ["Write a short Python function that reverses a string, with a brief explanation.",
         "Why does the slice with step -1 work?"]
    ):  # fmt: skip
        page.fill("#prompt", question)
        page.click("#send")
        page.locator(".answer-stats[data-completion-tokens]").nth(i).wait_for(timeout=120_000)
    page.screenshot(path=str(path))


def load(stop: threading.Event) -> None:
    with httpx.Client(timeout=120) as http:
        for question in itertools.cycle(QUESTIONS):
            if stop.is_set():
                return
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            body = {"model": "any", "messages": messages, "max_tokens": 48, "stream": True}
            with http.stream("POST", f"{URL}/v1/chat/completions", json=body) as r:
                for _ in r.iter_bytes():
                    pass


def main() -> None:
    with tempfile.TemporaryDirectory() as cache_dir:
        server = start_server(cache_dir)
        stop = threading.Event()
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
                context = browser.new_context()  # one local storage: the phone sees the chat
                desktop = context.new_page()
                desktop.set_viewport_size({"width": 1280, "height": 800})
                chat(desktop, DOCS / "chat.png")
                phone = context.new_page()
                phone.set_viewport_size({"width": 390, "height": 844})
                phone.emulate_media(color_scheme="dark")
                phone.goto(URL + "/")
                phone.locator(".answer-stats[data-completion-tokens]").nth(1).wait_for()
                phone.screenshot(path=str(DOCS / "chat-phone.png"))
                dashboard = context.new_page()
                dashboard.set_viewport_size({"width": 1440, "height": 900})
                dashboard.goto(URL + "/dashboard")
                clients = [threading.Thread(target=load, args=(stop,)) for _ in range(6)]
                for t in clients:
                    t.start()
                time.sleep(60)
                dashboard.screenshot(path=str(DOCS / "dashboard.png"), full_page=True)
                stop.set()
                for t in clients:
                    t.join()
                browser.close()
        finally:
            stop.set()
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
