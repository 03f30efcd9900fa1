"""Jinja's immutable sandbox, with a time limit and bounds on the size of what a template builds.

Time (render_deadline.py): the generated code calls `environment.tick()` at the start of every
loop iteration and every macro, block and call-block body, and the sandbox's own hooks (calls,
operators, filters) call it too, so a loop of library code that calls back into the template
(`map`, `select`) stops as well.

Size (template_sizes.py): each operation that can make a result much larger than its inputs is
sized before it runs:
- the operators `*`, `**`, `+`, `%` (Jinja's sandbox lets an environment intercept them; an
  intercepted operator is also no longer folded at compile time, where `'a' * 2**31` used to
  allocate 2 GiB while the model loaded);
- the str methods and filters whose result grows with an argument (ljust, replace, join, format,
  indent, wordwrap, tojson's indent, batch, ...);
- each conversion of a value to text: `{{ }}`, `~`, the text filters, and the buffers that
  collect a template's or a macro's output.
Every other call has its result's length checked when it returns.

Not bounded: comparing or hashing two self-nested values (`==`, `in`, `unique` over lists that
each hold one list twice, 60 levels deep) is one C loop as long as the values are nested.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sized
from typing import Any

from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .render_deadline import Deadline
from .template_sizes import CONTAINERS, FILTERS, STR_METHODS, Bounds, percent_size, predict

_SEQUENCES = (str, bytes, list, tuple)


class _CodeGenerator(CodeGenerator):
    def enter_frame(self, frame):
        # Written where each frame's code begins: a loop iteration's body, a macro's, a block's,
        # a call block's; the only places template code repeats. (A loop's `if` clause runs
        # between ticks, over the one iterable's items: at most MAX_ITEMS, or MAX_CHARS of a str.)
        super().enter_frame(frame)
        self.writeline("environment.tick()")

    @optimizeconst
    def visit_Concat(self, node, frame):
        # Jinja's `~`, with the same joiner, through environment.concat_operands, which sizes
        # the operands before str() of a self-nested list runs in C.
        if frame.eval_ctx.volatile:
            joiner = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            joiner = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.concat_operands({joiner}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment whose renders, inside `deadline.run(...)`, stop at the
    deadline, and which builds no value past `bounds`. `filters` are added to Jinja's, and all
    of them bounded; a filter added after construction is not."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CodeGenerator

    def __init__(self, deadline: Deadline, *, bounds: Bounds = Bounds(),
                 filters: Mapping[str, Callable] | None = None, **options: Any):
        super().__init__(finalize=self._finalize, **options)
        self.bounds, self.tick = bounds, deadline.check
        # lorem ipsum, n paragraphs of it: a loop in library code that no check can reach, and no
        # chat template's need
        del self.globals["lipsum"]
        self.filters.update(filters or {})
        self.filters = {name: self._bounded_filter(name, f) if name in FILTERS else f
                        for name, f in self.filters.items()}

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        # No tick: an operator repeats only in a loop body, which has one. `+` first: templates
        # join their prompt with it, ~100 times a render.
        b = self.bounds
        if operator == "+":
            # at most the two operands, each within the bounds: checked after, on a fast path
            result = left + right
            if type(result) is str:
                if len(result) > b.max_chars:
                    b.chars(len(result), "'+'")
            elif isinstance(result, _SEQUENCES):
                b.length(result, len(result), "'+'")
            return result
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):
                b.bits(left.bit_length() + right.bit_length(), "'*'")
            elif isinstance(left, _SEQUENCES) and isinstance(right, int):
                b.length(left, len(left) * right, "'*'")
            elif isinstance(right, _SEQUENCES) and isinstance(left, int):
                b.length(right, len(right) * left, "'*'")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                b.bits(right * left.bit_length(), "'**'")
        elif operator == "%" and isinstance(left, str):
            b.chars(percent_size(b, left, right), "'%'")
        return self.binop_table[operator](left, right)

    def call(self, context, obj, /, *args: Any, **kwargs: Any) -> Any:
        self.tick()
        # str.format arrives wrapped by the sandbox (in a SandboxedFormatter); the method is inside
        method = getattr(obj, "__wrapped__", obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, (str, bytes)):
            name = getattr(method, "__name__", "")
            if name == "join" and args and not isinstance(args[0], Sized):
                args = (list(args[0]), *args[1:])  # sized exactly, then joined
            size = STR_METHODS.get(name)
            if size is not None:
                self.bounds.chars(predict(size, self.bounds, owner, *args, **kwargs), f"str.{name}()")
        return self.bounds.checked(super().call(context, obj, *args, **kwargs), "a call")

    def concat(self, parts) -> str:
        """The buffers of a render, a macro, a block: joined once their total is known to fit.
        Counted part by part, so a loop that prints one big string 10**10 times stops at the
        limit instead of first collecting 10**10 references to it."""
        out, size, limit = [], 0, self.bounds.max_chars
        for part in parts:
            size += len(part)
            if size > limit:
                self.bounds.chars(size, "the template's output")
            out.append(part)
        return "".join(out)

    def concat_operands(self, join: Callable, operands: tuple) -> str:
        self.bounds.chars(sum(map(self.bounds.text, operands)), "'~'")
        return join(operands)

    def _finalize(self, value: Any) -> Any:
        # every `{{ }}` passes here before str(); a str or a number is its own size
        if type(value) is not str and isinstance(value, CONTAINERS):
            self.bounds.measure(value)
        return value

    def _bounded_filter(self, name: str, f: Callable) -> Callable:
        unit, size = FILTERS[name]
        # the context, eval context or environment Jinja passes first to some filters
        skip = 0 if getattr(f, "jinja_pass_arg", None) is None else 1
        what, b, tick = f"the {name} filter", self.bounds, self.tick

        @functools.wraps(f)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            tick()
            if len(args) > skip:
                value = args[skip]
                if unit == "text":  # the value is printed as it is: a str is its own size
                    if type(value) is not str:
                        b.chars(b.text(value), what)
                elif unit == "items":
                    if isinstance(value, Sized):
                        b.items(len(value), what)
                else:
                    if name == "join" and not isinstance(value, Sized):
                        args = (*args[:skip], list(value), *args[skip + 1:])  # sized exactly
                    (b.items if unit == "item count" else b.chars)(
                        predict(size, b, *args[skip:], **kwargs), what)
            return b.checked(f(*args, **kwargs), what)

        return bounded
