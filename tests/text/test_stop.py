"""Stop strings: streamed matching equals matching on the whole text, however it is split."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from deepinfer.errors import InvalidRequestError
from deepinfer.text.stop import StopResult, StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Scan the text one character at a time; the first stop to appear wins (longest on ties)."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text[:end].endswith(s)]
        if found:
            stop = max(found, key=len)
            return text[: end - len(stop)], stop
    return text, None


def run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    out, matched = [], None
    for chunk in chunks:
        result = matcher.push(chunk)
        matcher.check_integrity()
        out.append(result.text_to_emit)
        if result.matched is not None:
            matched = result.matched
            assert matcher.push("more") == StopResult("", matched)
            break
    out.append(matcher.flush())
    return "".join(out), matched


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_split_across_many_pushes() -> None:
    assert run(["STOP"], ["ab", "S", "T", "O", "Pcd"]) == ("ab", "STOP")
    assert run(["STOP"], ["abS", "TO", "x"]) == ("abSTOx", None)


def test_nothing_of_the_stop_is_emitted_early() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42</ans") == StopResult("42")
    assert matcher.push("wer> tail") == StopResult("", "</answer>")


def test_stop_at_start_and_multiple_stops() -> None:
    assert run(["\n\n", "User:"], ["User: hi"]) == ("", "User:")
    assert run(["\n\n", "User:"], ["a\n", "\nUser:"]) == ("a", "\n\n")
    assert run(["abc", "bcd"], ["abcd"]) == ("", "abc")
    assert run(["xbcd", "bc"], ["xbcd"]) == ("x", "bc")  # "bc" ends first
    assert run(["bc", "abc"], ["zabc"]) == ("z", "abc")  # same end: the longest


def test_overlapping_stops_random() -> None:
    rng = random.Random(0)
    alphabet = "ab\n日"
    for _ in range(2000):
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 25)))
        assert run(stops, split(text, rng)) == reference(text, stops), (stops, text)


def test_no_stops_passes_through() -> None:
    assert run([], ["a", "b"]) == ("ab", None)
    with pytest.raises(InvalidRequestError):
        StopStringMatcher(["ok", ""])


def held_reference(text: str, stops: list[str]) -> int:
    """Brute force: the longest suffix of `text` that is a proper prefix of some stop."""
    return max(
        (
            k
            for s in stops
            for k in range(1, min(len(s) - 1, len(text)) + 1)
            if text.endswith(s[:k])
        ),
        default=0,
    )


def test_each_push_emits_all_but_the_longest_possible_stop_start() -> None:
    """Periodic stops (many candidate starts per tail), random splits: after every push the text
    shown is exactly the text so far minus the longest tail that could begin a stop."""
    rng = random.Random(1)
    for _ in range(1500):
        unit = "".join(rng.choices("ab", k=rng.randint(1, 3)))
        stops = [unit * rng.randint(1, 6) + rng.choice(["", "a", "b", "c"])]
        stops += [
            "".join(rng.choices("abc", k=rng.randint(1, 12))) for _ in range(rng.randint(0, 2))
        ]
        text = "".join(rng.choices("aab" if rng.random() < 0.7 else "abc", k=rng.randint(1, 60)))
        expected, matched = reference(text, stops)
        matcher, seen, shown = StopStringMatcher(stops), "", ""
        for chunk in split(text, rng):
            result = matcher.push(chunk)
            matcher.check_integrity()
            seen, shown = seen + chunk, shown + result.text_to_emit
            if result.matched is not None:
                assert (shown, result.matched) == (expected, matched), (stops, text)
                break
            assert shown == seen[: len(seen) - held_reference(seen, stops)], (stops, seen)
        else:
            assert (shown + matcher.flush(), None) == (expected, matched), (stops, text)


def test_long_stop_string_costs_memory_linear_in_its_length() -> None:
    """Set-up and pushes hold no table over a stop's prefixes: a 1,000,000-character stop string
    (allowed only with the server's limits raised) needs a few of its own sizes, not its square."""
    for length in (20_000, 1_000_000):
        stop = "y" * length
        tracemalloc.start()
        try:
            matcher = StopStringMatcher([stop, "x" * 1000 + "z"])
            shown = []
            for chunk in ("ab", "y" * 1000, "x" * 1500, "y" * (length // 2), "y" * 10_000):
                shown.append(matcher.push(chunk).text_to_emit)
                matcher.check_integrity()
            assert matcher.push("y" * length).matched == stop
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert "".join(shown) == "ab" + "y" * 1000 + "x" * 1500
        assert peak_bytes < 50 << 20, (length, peak_bytes)
