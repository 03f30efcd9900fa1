"""Stop strings over a delta stream (runtime/engine/stop.py): caught across deltas, cut exactly, and the
emitted text never depends on how the text was split into deltas."""

from __future__ import annotations

import random

import pytest

from lowbit.runtime.engine.detokenizer import StreamDetokenizer
from lowbit.runtime.engine.stop import StopMatcher


def run(stop, deltas):
    """Feed deltas until a stop; → (emitted pieces, stopped)."""
    m = StopMatcher(stop)
    out = []
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def reference(stop, text):
    """Brute force over the full text: the match with the smallest end, then the smallest start."""
    ends = [(i + len(s), i) for s in stop for i in range(len(text)) if text.startswith(s, i)]
    return (text[:min(ends)[1]], True) if ends else (text, False)


@pytest.mark.parametrize("deltas", [
    ["Hello wor", "ld\n\nUs", "er: hi"],  # split across 2 deltas
    ["Hello world\n", "\nU", "ser: hi"],  # across 3
    ["Hello world", "\n", "\n", "U", "s", "e", "r", ":", " hi"],  # one character at a time
    ["Hello world\n\nUser: hi"],  # whole
])
def test_split_stop_string_is_caught_and_cut(deltas):
    out, stopped = run(("\n\nUser:",), deltas)
    assert stopped
    assert "".join(out) == "Hello world"
    assert all("\n" not in piece for piece in out)  # no part of the stop string was ever emitted


def test_text_before_the_stop_is_emitted_as_soon_as_it_is_safe():
    m = StopMatcher(("END",))
    assert m.feed("abc") == ("abc", False)  # no suffix of "abc" starts "END"
    assert m.feed("xE") == ("x", False)  # "E" could start "END": held
    assert m.feed("N") == ("", False)  # "EN" still could
    assert m.feed("Dtail") == ("", True)  # the stop string and what follows it are cut
    assert m.feed("more") == ("", True)  # after a stop nothing more comes out
    assert m.flush() == ""


def test_false_partial_match_is_released_unchanged():
    m = StopMatcher(("END",))
    assert m.feed("wE") == ("w", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)  # "ENx" is no prefix of "END": all of it goes out
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN"  # the stream ended on a partial match: it was text after all


def test_held_tail_can_restart_inside_itself():
    # "aab": after "aa" the held "aa" is not a prefix of "ab", but its tail "a" is
    out, stopped = run(("ab",), ["a", "a", "b", "c"])
    assert stopped and "".join(out) == "a"


def test_multiple_stop_strings():
    out, stopped = run(("###", "\nQ:"), ["answer is 4", "\n", "Q", ": next"])
    assert stopped and "".join(out) == "answer is 4"
    out, stopped = run(("###", "\nQ:"), ["answer", " #", "## rest"])
    assert stopped and "".join(out) == "answer "


@pytest.mark.parametrize("deltas", [["x", "a", "b", "c"], ["xab", "c"], ["xabc"]])
def test_overlapping_prefixes_first_to_complete_wins(deltas):
    out, stopped = run(("abc", "ab"), deltas)  # "ab" completes first, both start at the same place
    assert stopped and "".join(out) == "x"


@pytest.mark.parametrize("deltas", [["x", "a", "b", "c", "d"], ["xabcd"], ["xa", "bcd"]])
def test_a_later_starting_stop_that_completes_first_wins(deltas):
    # "bc" ends at 3, "abcd" at 4: "bc" completes first in any stream, so the text is cut at "b"
    out, stopped = run(("abcd", "bc"), deltas)
    assert stopped and "".join(out) == "xa"


def test_same_end_earliest_start_wins():
    out, stopped = run(("b", "ab"), ["x", "a", "b"])
    assert stopped and "".join(out) == "x"  # not "xa": none of "ab" may be emitted


def test_unicode_stop_strings_across_deltas():
    out, stopped = run(("世界",), ["héllo 🤖 ", "世", "界 after"])
    assert stopped and "".join(out) == "héllo 🤖 "
    out, stopped = run(("🤖!",), ["é🤖", "🤖", "!x"])
    assert stopped and "".join(out) == "é🤖"


def test_with_the_utf8_detokenizer_one_byte_per_token():
    """Bytes → whole characters → stop matching: the stop string "界." is split across 4 tokens."""
    full = "héllo 🤖 世界. more"
    data = full.encode()

    class Bytes:
        special_ids = frozenset()

        def token_bytes(self, i):
            return data[i:i + 1]

    detok, m = StreamDetokenizer(Bytes()), StopMatcher(("界.",))
    out = []
    for i in range(len(data)):
        text, stopped = m.feed(detok.push(i))
        out.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(out) == "héllo 🤖 世"
    assert all("\ufffd" not in p for p in out)


def test_no_stop_strings_passes_everything_through():
    m = StopMatcher(())
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_bad_stop_strings_raise():
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(("ok", ""))
    assert StopMatcher("ab").stop == ("ab",)


def test_emitted_text_is_the_full_text_up_to_the_stop_whatever_the_split():
    rng = random.Random(0)
    alphabet = "ab\nc世🤖"
    for _ in range(400):
        stop = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        out, stopped = run(stop, deltas)
        assert ("".join(out), stopped) == reference(stop, text), (stop, deltas)
