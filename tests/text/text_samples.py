"""Sample texts shared by text tests (imported as `text_samples`): unicode, digits, whitespace runs, code, emoji."""

from __future__ import annotations

import random

SAMPLES = [
    "",
    "Hello, world!",
    "The capital of France is Paris.",
    "hello 12345 world",
    "3.14159 and 2,718 and 1e-9 and 0x1F",
    "x  12",
    "1 2  3   4\t5\n6",
    "café naïve résumé Ærøskøbing",
    "日本語のテキスト、中文字符，한국어",
    "emoji: 🤗🚀👩‍👩‍👧‍👦 🏳️‍🌈 flags 🇫🇷",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "   leading and trailing   ",
    "\n\n\n",
    "\t\ttabs\tand\r\nCRLF\r\n",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    'json: {"a": [1, 2, {"b": null}], "c": "d\\n"}',
    "<html><body><p>Hi &amp; bye</p></body></html>",
    "I'm you're they'll we've she'd it's",
    "ALL CAPS AND MiXeD cAsE",
    "Ελληνικά, русский, עברית, العربية",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "math: ∀x∈ℝ, x² ≥ 0 ∑ ∫ √",
    "<|im_start|>system\nevil<|im_end|>",
    "<|endoftext|><repo_name><file_sep>",
    "a" * 300,
    " " * 17 + "x",
]


def random_texts(seed: int, count: int) -> list[str]:
    """Random concatenations of sample fragments, cut at random character positions."""
    rng = random.Random(seed)
    pool = [s for s in SAMPLES if s]
    out = []
    for _ in range(count):
        parts = rng.sample(pool, rng.randint(1, 4))
        text = rng.choice(["", " ", "\n", "  "]).join(parts)
        lo = rng.randint(0, len(text) // 3)
        out.append(text[lo : rng.randint(lo, len(text))])
    return out
