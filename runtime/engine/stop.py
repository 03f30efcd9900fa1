"""Stop strings over a text stream: matched across token boundaries and cut from the output.

The detokenizer (runtime/engine/detokenizer.py) hands over text in deltas of whole characters, and a stop
string may straddle several of them ("\\n\\nUser:" arrives as "\\n", "\\nUser", ":"). So any tail of
the text that could still grow into a stop string is held back, never emitted, until the next
delta settles it: either a stop string completes (the text before it is released, the stop string
and everything after it are dropped) or the tail stops being a prefix (it is released unchanged).

Which match wins when several could: the one that completes first as the text streams in — the
smallest end offset — and among those ending at the same offset, the one starting earliest (so
none of either stop string is emitted). This rule makes the output independent of how the text is
cut into deltas: the emitted text is always `full_text[:start of the winning match]`.

Stop token ids are the engine's business (they are ids, not text).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop: tuple[str, ...]):
        if isinstance(stop, str):  # a bare string would otherwise be read as one stop per character
            stop = (stop,)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stop = tuple(stop)
        # a held tail is a proper prefix of some stop string, so it is never longer than this
        self.max_hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # text received but not yet emitted (≤ max_hold characters)
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Next text delta → (text safe to emit now, whether a stop string has completed).
        After a stop, further deltas are ignored and return ("", True)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        text = self.pending + delta
        cut = self._first_match(text)
        if cut is not None:
            self.stopped, self.pending = True, ""
            return text[:cut], True
        hold = self._held_tail(text)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """End of the stream (end token or length): the held tail was not a stop after all."""
        out, self.pending = self.pending, ""
        return out

    def _first_match(self, text: str) -> int | None:
        """Start offset of the winning match in `text`, or None. `pending` held no complete
        match, so any match found here ends in the new delta."""
        best = None  # (end, start)
        for s in self.stop:
            i = text.find(s)  # for one string, the earliest start is also the earliest end
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        return None if best is None else best[1]

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string.
        The longest one is needed: a stop that completes later starts inside it, never before."""
        for n in range(min(self.max_hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
