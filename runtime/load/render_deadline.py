"""A time limit on rendering a template, checked by the template's own code.

A chat template is Jinja source compiled to Python; a `{% for %}` over `range(100000)` nested in
another is 10**10 iterations, and nothing in Jinja stops it. CPython cannot kill a thread from
outside, so the check runs inside: the sandbox (template_sandbox.py) compiles a call to
`Deadline.check` into the start of every loop iteration, macro, block and call-block body (the
only ways template code repeats), and calls it from each call, operator and filter the template
runs, which also covers loops in the library code that call back into the template. Past the
deadline the check raises, and the render unwinds and frees its thread.

Why not a trace function (sys.settrace, which would see every line): measured on CPython 3.11
with SmolLM2, Llama 3.1 and Qwen2.5 templates over 20 messages, it made a 140-230 µs render
2.5-3x slower (every Python call under tracing pays for a trace call), and it has to suspend a
debugger's or coverage's tracer for the render. These checks cost a few µs a render and leave
sys.gettrace() alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceeded(BaseException):
    """Raised inside the running template. A BaseException, so that no `except Exception` in
    the library code between the template and the caller catches it and lets the loop go on."""


class _End(threading.local):
    at: float | None = None  # time.monotonic() past which this thread's render stops; None: no limit


class Deadline:
    """One deadline per thread: renders of one template in several threads (a server's worker
    threads) each stop on their own clock."""

    def __init__(self):
        self._end = _End()

    def run(self, seconds: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)`, whose `check()` calls raise DeadlineExceeded once `seconds`
        have passed."""
        end = self._end
        previous, end.at = end.at, time.monotonic() + seconds
        try:
            return fn(*args, **kwargs)
        finally:
            end.at = previous

    def check(self) -> None:
        at = self._end.at
        if at is not None and time.monotonic() > at:
            raise DeadlineExceeded
