"""A request body's bytes → its JSON value, or a 400 naming what is wrong with it.

Python's `json.loads` takes more than a client may send: on bytes it decodes UTF-8 with
'surrogatepass' (the raw bytes ED A0 80 become a lone surrogate), it turns "\\ud800" escapes into
lone surrogates too, it accepts NaN and Infinity (and reads 1e999 as inf), and deep nesting raises
RecursionError. Each of those would fail later — a surrogate when the tokenizer or the response
encodes it, a recursion in the template — as a 500, after which uvicorn drops the keep-alive
connection. Here they are all a 400 before anything else reads the body.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from lowbit.runtime.server.errors import bad_request

# Nesting a real request needs: a tool's JSON schema nests a few levels per property level
# (OpenAI documents at most 5 levels of nested objects in structured outputs); 64 leaves room for
# the deepest schemas and keeps every later walk over the body (templates, grammars) far from
# Python's recursion limit (1000).
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:32]} is out of range")
    return v


def decode_json(raw: bytes) -> Any:
    """The body's JSON value; a 400 for bad UTF-8, lone surrogates, NaN/Infinity, numbers beyond
    float range, nesting deeper than MAX_DEPTH, or invalid JSON."""
    try:
        text = raw.decode("utf-8")  # strict: surrogates' 3-byte forms are invalid UTF-8
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8: byte {e.start}: {e.reason}") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite)
    except RecursionError:
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError is one
        raise bad_request(f"request body is not valid JSON: {e}") from None
    _check(value)
    return value


def _check(value: Any) -> None:
    """Depth and strings, iteratively (a recursive walk would itself hit the recursion limit)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise bad_request("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels")
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)
