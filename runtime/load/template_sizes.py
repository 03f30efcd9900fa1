"""How big a template's values may get, and the predicted size of each operation that can make
its result much larger than its inputs.

A deadline stops template code between two of its steps, never inside one C call, and one C call
can take minutes or allocate gigabytes: `'x' * 10**10`, `2 ** 10**9`, `'a'.ljust(10**10)`,
`s.replace('', s)`, or printing a list that holds itself twice, 60 levels deep (2**60 items in a
few KB of memory). template_sandbox.py asks these predictions before such a call and refuses it
with TemplateTooLarge when the result would pass the bounds. A prediction is exact or an upper
bound where the call's arithmetic says (`*`, `ljust`, `replace`, `join`), and within a small
factor where a value is printed (escapes can add to what `measure` counts); real prompts sit
orders of magnitude below the bounds.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, MappingView, Set, Sized
from dataclasses import dataclass
from typing import Any

from jinja2.utils import Namespace

# 32 Mi characters in one string (128 MiB at most, 4 bytes a character): a prompt 4x the server's
# default 8 MiB request body, or 8x a 1M-token context at ~4 characters a token.
MAX_CHARS = 1 << 25
# 1 Mi items in one list, or values inside one printed value: a request's messages, tools and
# schemas are thousands. Sizing a value walks it, and the walk stops here (0.2-0.3 s at worst).
MAX_ITEMS = 1 << 20
# 65,536 bits in one int: CPython refuses to print one of more than 4300 digits (~14,300 bits)
# anyway, and products of ints this size take microseconds, where a loop of squarings would
# reach gigabit ints whose multiplications take seconds each.
MAX_INT_BITS = 1 << 16

CONTAINERS = (Mapping, list, tuple, Set, MappingView, Namespace)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class TemplateTooLarge(Exception):
    """A template asked for more than the bounds allow. Not a ValueError: several filters catch
    those (`int`, `float`) and would turn the refusal into a default value."""


@dataclass(frozen=True)
class Bounds:
    max_chars: int = MAX_CHARS
    max_items: int = MAX_ITEMS

    def chars(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateTooLarge(f"{what} would make a string of {n} characters "
                                   f"(a template may make {self.max_chars})")

    def items(self, n: int, what: str) -> None:
        if n > self.max_items:
            raise TemplateTooLarge(f"{what} would make {n} items (a template may make {self.max_items})")

    def bits(self, n: int, what: str) -> None:
        if n > MAX_INT_BITS:
            raise TemplateTooLarge(f"{what} would make an integer of {n} bits "
                                   f"(a template may make {MAX_INT_BITS})")

    def length(self, seq: Any, n: int, what: str) -> None:
        """`n` characters of a str or bytes like `seq`, else `n` items."""
        (self.chars if isinstance(seq, (str, bytes)) else self.items)(n, what)

    def checked(self, value: Any, what: str) -> Any:
        """`value`, once its length is within the bounds (O(1): the value exists already)."""
        if isinstance(value, (str, bytes)):
            self.chars(len(value), what)
        elif isinstance(value, (list, tuple, dict, Set)):
            self.items(len(value), what)
        return value

    def measure(self, value: Any) -> tuple[int, int, int]:
        """(characters, items, depth) of `value` printed by str() or tojson, at least: a string
        counts its length, an int its digits, a container its items (each at least a separator's
        character). Shared items count each time they would be printed; the walk stops with
        TemplateTooLarge past max_items items or max_chars characters."""
        if isinstance(value, str):
            return len(value), 1, 0
        chars, items, depth, level = 0, 1, 0, [value]
        while level:  # level by level: the depth is the number of levels
            below: list = []
            for v in level:
                t = type(v)
                if t is str or t is bytes:
                    chars += len(v)
                elif t is int:
                    chars += v.bit_length() // 4 + 1  # log10(2) > 1/4: at most its digits
                elif t is dict or t is list or t is tuple or isinstance(v, CONTAINERS):
                    if isinstance(v, Namespace):  # printed as <Namespace {attrs}>
                        v = v._Namespace__attrs
                    if isinstance(v, Mapping):
                        items += 2 * len(v)
                        self.items(items, "printing a value")
                        below += v.keys()
                        below += v.values()
                    else:
                        items += len(v)
                        self.items(items, "printing a value")
                        below += v
                    chars += len(v) + 2
                else:
                    chars += 1
            self.chars(chars, "printing a value")
            depth += bool(below)
            level = below
        return chars, items, depth

    def text(self, value: Any) -> int:
        return len(value) if isinstance(value, str) else self.measure(value)[0]


def predict(size: Callable[..., int], *args: Any, **kwargs: Any) -> int:
    """A predicted size; 0 when the arguments do not fit the call, which then raises its own
    error (a TypeError for `'a'.ljust('x')`) instead of one from here."""
    try:
        return size(*args, **kwargs)
    except (TypeError, ValueError, AttributeError):
        return 0


def _int(x: Any) -> int:
    return x if isinstance(x, int) else 0


def _values(args: Any) -> list:
    if isinstance(args, tuple):
        return list(args)
    return list(args.values()) if isinstance(args, Mapping) else [args]


def percent_size(b: Bounds, fmt: str, args: Any) -> int:
    """`fmt % args`: each conversion prints at most the largest argument, padded to its width
    and precision (a `*` takes one from the arguments: at most the largest int among them)."""
    values = _values(args)
    biggest = max(map(b.text, values), default=0)
    widest = max((v for v in values if isinstance(v, int)), default=0)
    specs = _PERCENT_SPEC.findall(fmt)
    pads = sum(widest if x == "*" else int(x or 0) for spec in specs for x in spec)
    return len(fmt) + len(specs) * biggest + pads


def _format_size(b: Bounds, fmt: str, values: list) -> int:
    """`fmt.format(*values)`, the same way: each field prints at most the largest value, padded
    to the numbers in its spec (a nested `{}` in a spec: at most the largest int value)."""
    biggest = max(map(b.text, values), default=0)
    widest = max((v for v in values if isinstance(v, int)), default=0)
    size = len(fmt)
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None:
            spec = spec or ""
            size += biggest + sum(map(int, _DIGITS.findall(spec))) + (widest if "{" in spec else 0)
    return size


def _replaced(length: int, hits: int, old: int, new: int, count: Any) -> int:
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return length + hits * max(new - old, 0)


def _translated(b, s, table) -> int:
    widest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1)
    return len(s) * max(widest, 1)


# str (and bytes) methods: predicted result length, from the method's own arguments, the string
# (or, for join, the separator) first
STR_METHODS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("ljust", "rjust", "center", "zfill"),
                    lambda b, s, width, *_: max(len(s), _int(width))),
    "expandtabs": lambda b, s, tabsize=8: (
        len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(_int(tabsize), 0)),
    "replace": lambda b, s, old, new, count=-1: _replaced(
        len(s), s.count(old) if old else len(s) + 1, len(old), len(new), count),
    "translate": _translated,
    "join": lambda b, sep, items: (sum(len(x) for x in items if isinstance(x, (str, bytes)))
                                   + len(sep) * max(len(items) - 1, 0)),
    "format": lambda b, s, *args, **kwargs: _format_size(b, s, [*args, *kwargs.values()]),
    "format_map": lambda b, s, mapping: _format_size(b, s, _values(mapping)),
}


def _items(b, value) -> int:
    return len(value) if isinstance(value, Sized) else 0


def _json_size(b, value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> int:
    # transformers' tojson takes json.dumps's arguments; each item gets its separators and, with
    # an indent, a line indented by its depth
    chars, items, depth = b.measure(value)
    seps = sum(map(len, separators)) if isinstance(separators, (list, tuple)) else 3
    step = len(indent) if isinstance(indent, str) else _int(indent)
    return chars + items * (seps + (1 + step * depth if indent is not None else 0))


def _pprint_size(b, value) -> int:
    chars, items, depth = b.measure(value)
    return chars + items * (depth + 4)  # a line for each item, indented by its depth


def _indent_size(b, s, width=4, first=False, blank=False) -> int:
    step = len(width) if isinstance(width, str) else _int(width)
    n = b.text(s)
    return n + (s.count("\n") + 1 if isinstance(s, str) else n + 1) * step


def _wordwrap_size(b, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> int:
    n = b.text(s)
    lines = n // max(_int(width), 1) + (s.count("\n") if isinstance(s, str) else n) + 1
    return n + lines * (len(wrapstring) if isinstance(wrapstring, str) else 2)


def _replace_size(b, s, old, new, count=None) -> int:
    n, old, new = b.text(s), str(old), str(new)
    hits = (s.count(old) if old else n + 1) if isinstance(s, str) else n + 1
    return _replaced(n, hits, len(old), len(new), count)


def _format_filter_size(b, value, *args, **kwargs) -> int:
    if not isinstance(value, str):
        return b.text(value) + b.text(kwargs or args)
    return percent_size(b, value, kwargs or args)


def _sum_size(b, iterable, attribute=None, start=0) -> int:
    if not isinstance(start, (int, float)):
        # sum() adds lists one at a time, copying the total each time: quadratic, in C
        raise TemplateTooLarge(f"the sum filter adds numbers, not {type(start).__name__}s")
    return _items(b, iterable)


# Filters that print their value (str() of it, or less): "text", sized as the value printed.
# Filters that walk their value item by item in Python: "items", sized by its length. The rest:
# (unit, predicted size from the filter's arguments, the value first). Unlisted filters return
# a part of their value, a number, or a lazy iterator, and are not wrapped.
FILTERS: dict[str, tuple[str, Callable[..., int] | None]] = {
    **dict.fromkeys(("string", "e", "escape", "forceescape", "safe", "upper", "lower", "title",
                     "capitalize", "trim", "striptags", "truncate", "urlencode", "urlize",
                     "wordcount", "xmlattr"), ("text", None)),
    **dict.fromkeys(("list", "sort", "unique", "dictsort", "groupby", "map", "select", "reject",
                     "selectattr", "rejectattr", "min", "max"), ("items", None)),
    "pprint": ("chars", _pprint_size),
    "center": ("chars", lambda b, value, width=80: max(b.text(value), _int(width))),
    "indent": ("chars", _indent_size),
    "wordwrap": ("chars", _wordwrap_size),
    "replace": ("chars", _replace_size),
    "format": ("chars", _format_filter_size),
    "join": ("chars", lambda b, value, d="", attribute=None: (
        b.text(value) + b.text(d) * max(len(value) - 1, 0))),
    "tojson": ("chars", _json_size),
    "batch": ("item count", lambda b, value, linecount, fill_with=None: max(_int(linecount), _items(b, value))),
    "slice": ("item count", lambda b, value, slices, fill_with=None: max(_int(slices), _items(b, value))),
    "sum": ("item count", _sum_size),
}
