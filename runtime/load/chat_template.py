"""Chat templates: the model's own Jinja template turned into a prompt string.

A GGUF (`tokenizer.chat_template`) or `tokenizer_config.json` (`chat_template`) carries the
template as Jinja source written for `transformers`. Templates are untrusted code from a model
hub, so they run in Jinja's immutable sandbox, and the environment mirrors the one transformers
builds (trim_blocks, lstrip_blocks, loopcontrols, `tojson`, `raise_exception`, `strftime_now`,
`{% generation %}`): the same template and messages give the same string as
`AutoTokenizer.apply_chat_template(..., tokenize=False)`.

Rendering is bounded (a template is a program, and a model file can carry one that never ends):
a render that runs past its time limit stops with a ValueError (render_deadline.py), and so does
one that would build an outsized value (template_sandbox.py) or exhausts memory or recursion, so
a server answers that request with a 400 and goes on serving.

There is no fallback template: a model without one raises, because a guessed format (ChatML,
say) silently gives a model prompts it was never trained on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from .render_deadline import Deadline, DeadlineExceeded
from .template_sandbox import BoundedSandbox
from .template_sizes import TemplateTooLarge

# Older names for a message's reasoning; templates (Qwen3, DeepSeek-R1, gpt-oss) read
# `reasoning_content` or `thinking`, clients send any of the three. Same aliasing as transformers.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Seconds one render may take. Real templates render 20 messages in 0.2 ms (SmolLM2, Llama 3.1,
# Qwen2.5 on one CPU core), so this is ~25,000x the need, yet it frees a server's worker thread
# long before a client gives up (the openai client waits 600 s).
RENDER_TIMEOUT = 5.0


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes `<`, `>`, `&`, `'`; a prompt is not HTML, and templates
    # that dump tool schemas expect the plain json.dumps text (as transformers renders it).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Llama 3.x templates print today's date in the system prompt.
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; for
    inference it only renders its body, but a template using it must still parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    # `namespace(...)` is how templates keep state across loop iterations; refusing underscore
    # names keeps a template from reaching CPython internals through it.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types: rich objects (pydantic models, dataclasses,
    arrays) carry methods the sandbox does not know are unsafe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any) -> dict:
    message = _plain(message)
    if not isinstance(message, dict):
        raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
    # OpenAI clients send `content=None` / `tool_calls=None`; many templates render a literal
    # "None" for a present-but-None key, while they handle a missing one.
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """One compiled template. `special_tokens` (bos_token, eos_token, …) are template variables
    that the caller's keyword arguments may override, as in transformers. `timeout`: seconds a
    render may run (a constructor argument: render's keywords are all template variables)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 timeout: float = RENDER_TIMEOUT):
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template must be a non-empty string")
        if not timeout > 0:
            raise ValueError(f"chat template timeout must be > 0 seconds, got {timeout}")
        self._deadline = Deadline()
        env = BoundedSandbox(
            self._deadline, trim_blocks=True, lstrip_blocks=True, filters={"tojson": _tojson},
            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _Namespace
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template does not compile: {_one_line(e)}") from None
        self.source, self.timeout = source, timeout
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("apply_chat_template needs a non-empty list of messages")
        variables = {"tools": None, "documents": None, **self._special, **_plain(kwargs)}
        variables["messages"] = [_normalize_message(m) for m in messages]
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._deadline.run(self.timeout, self._template.render, **variables)
        except DeadlineExceeded:
            raise ValueError(f"chat template timed out after {self.timeout:g} s "
                             "(does it loop without end?)") from None
        except (jinja2.exceptions.TemplateError, TemplateTooLarge) as e:
            raise ValueError(f"chat template error: {_one_line(e)}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError, ValueError,
                MemoryError, RecursionError, OverflowError) as e:
            # A template that indexes a missing key or calls a string method on None fails
            # with a plain Python error, one that recurses without end or builds a value too big
            # for memory with another; report each the same way as a raise_exception().
            raise ValueError(f"chat template error: {type(e).__name__}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
