from __future__ import annotations

import random

import pytest

from runtime.stop_strings import StopStringMatcher


def stream(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """Push every delta, then flush; return everything emitted and whether a stop hit."""
    matcher = StopStringMatcher(stops)
    out, hit = [], False
    for delta in deltas:
        text, hit = matcher.push(delta)
        out.append(text)
    out.append(matcher.flush())
    return "".join(out), hit


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """Brute force: cut at the stop occurrence that ends first (longer one on a tie)."""
    hits = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not hits:
        return text, False
    end, neg_length = min(hits)
    return text[: end + neg_length], True


def test_no_stops_passes_text_through_unchanged() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("Hello") == ("Hello", False)
    assert matcher.flush() == ""


def test_stop_across_token_boundary() -> None:
    matcher = StopStringMatcher(["Hello"])
    assert matcher.push("say Hel") == ("say ", False)  # "Hel" could start "Hello"
    assert matcher.push("lo world") == ("", True)
    assert matcher.matched == "Hello"
    assert matcher.push("more") == ("", True)  # nothing after a stop, ever
    assert matcher.flush() == ""


def test_stop_split_over_many_single_character_deltas() -> None:
    assert stream(["</s>"], list("abc</s>def")) == ("abc", True)


def test_partial_prefix_released_when_it_turns_out_not_to_be_a_stop() -> None:
    matcher = StopStringMatcher(["Hello"])
    assert matcher.push("Hel") == ("", False)
    assert matcher.push("p") == ("Help", False)


def test_partial_prefix_at_end_released_by_flush() -> None:
    matcher = StopStringMatcher(["Hello"])
    assert matcher.push("oh Hell") == ("oh ", False)
    assert matcher.flush() == "Hell"
    assert not matcher.stopped


def test_stop_at_very_start() -> None:
    assert stream(["STOP"], ["STOP", "after"]) == ("", True)
    assert stream(["S"], ["Sx"]) == ("", True)


def test_multiple_stops_earliest_wins_in_one_delta() -> None:
    assert stream(["bar", "foo"], ["xx foo yy bar"]) == ("xx ", True)
    matcher = StopStringMatcher(["bar", "foo"])
    matcher.push("xx foo yy bar")
    assert matcher.matched == "foo"


def test_overlapping_stops_resolve_the_same_for_any_split() -> None:
    # "b" completes before "abc"; on equal ends the longer stop ("abc" vs "bc") wins.
    for deltas in (["abc"], list("abc"), ["a", "bc"]):
        assert stream(["abc", "b"], deltas) == ("a", True)
        assert stream(["bc", "abc"], deltas) == ("", True)


def test_stop_string_within_repeated_characters() -> None:
    assert stream(["aab"], list("aaaab")) == ("aa", True)
    assert stream(["aab"], list("aaaa")) == ("aaaa", False)


def test_unicode_stop_strings() -> None:
    assert stream(["日本"], ["こんにちは日", "本語"]) == ("こんにちは", True)
    assert stream(["🙂!"], ["hi 🙂", "?", "🙂", "!"]) == ("hi 🙂?", True)
    assert stream(["é"], ["caf", "e\u0301"]) == ("cafe\u0301", False)  # different code points


def test_rejects_empty_stop_string() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


def test_held_back_text_is_bounded_by_longest_stop() -> None:
    # Emitted text lags the input by less than the longest stop string: per-call work is
    # bounded by that window plus the delta, not by the output length.
    stops = ["abcabd", "xyz"]
    matcher = StopStringMatcher(stops)
    pushed = emitted = 0
    for delta in ["abca", "bca", "ab", "c", "abcabca"] * 200:
        text, hit = matcher.push(delta)
        assert not hit
        pushed += len(delta)
        emitted += len(text)
        assert pushed - emitted <= max(map(len, stops)) - 1


@pytest.mark.parametrize("seed", range(300))
def test_matches_brute_force_for_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc"
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert stream(stops, deltas) == reference(stops, text)
