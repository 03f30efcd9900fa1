"""A chat template is a program from a model file: one that loops, exhausts memory or recurses
must fail its render with a one-line ValueError, quickly, and leave the thread (and a server) as
it was. Legit templates must render exactly as transformers renders them."""

from __future__ import annotations

import importlib
import sys
import threading
import time
import tracemalloc

import httpx
import pytest

from lowbit.runtime.load.chat_template import ChatTemplate
from tests.helpers import serving
from tests.test_tools import TemplateTokenizer, tiny_app

HI = [{"role": "user", "content": "hi"}]
LIMIT = 0.5  # s: the time limit these tests give a render
MARGIN = 1.5  # s: scheduling slack on a loaded 2-core CI machine
# 10**10 iterations, each allowed by the sandbox's 100k cap on range
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _render(template: ChatTemplate, messages=HI, **kwargs) -> tuple[BaseException | str, float]:
    """(the render's text or exception, seconds) on a thread of its own: a render that never
    returns fails the test instead of hanging it."""
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            box["out"] = template.render(messages, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the test reads whatever escaped
            box["out"] = e
        box["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(template.timeout + 10 if hasattr(template, "timeout") else 10)
    assert not th.is_alive(), "the render is still running"
    return box["out"], box["s"]


def _one_line_error(out, *needles: str) -> str:
    assert isinstance(out, ValueError), repr(out)
    msg = str(out)
    assert msg and "\n" not in msg, repr(msg)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def test_nested_loop_times_out_within_the_limit():
    out, s = _render(ChatTemplate(NESTED, timeout=LIMIT))
    _one_line_error(out, "chat template timed out after 0.5 s")
    assert LIMIT <= s < LIMIT + MARGIN


@pytest.mark.parametrize("source", [
    # each loop only ever calls the template back from library code, or recurses
    "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}{% endfor %}{% endfor %}",
    "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(60) }}",
    "{% set s = 'x' * 1000000 %}{{ ([s] * 100000) | map('replace', 'x', 'y') | list | length }}",
], ids=["filtered-loop", "exponential-macro", "filter-in-map"])
def test_other_loops_time_out(source):
    out, s = _render(ChatTemplate(source, timeout=LIMIT))
    _one_line_error(out, "timed out")
    assert s < LIMIT + MARGIN


@pytest.mark.parametrize("source, needle", [
    ("{{ 'x' * 10**10 }}", "'*' would make a string of 10000000000 characters"),
    ("{% set s = 'a' * 2**31 %}{{ s | length }}", "'*' would make a string of 2147483648"),
    ("{{ ([0] * 10**9) | length }}", "'*' would make 1000000000 items"),
    ("{{ 10 ** (10 ** 8) > 0 }}", "'**' would make an integer"),
    ("{{ 'a'.ljust(10**10) }}", "str.ljust()"),
    ("{{ 'a' | center(10**10) }}", "the center filter"),
    ("{{ '%10000000000s' % 'x' }}", "'%'"),
    ("{{ '{:>10000000000}'.format('x') }}", "str.format()"),
    ("{{ range(100000) | join('x' * 10**6) }}", "the join filter"),
    ("{{ ('x' * 10**7).replace('', 'yyyyyyyyyy') }}", "str.replace()"),
    ("{{ messages | tojson(indent=10**9) }}", "the tojson filter"),
    # doubling a string 64 times, with `+` and with `~`
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "'+' would make a string of 67108864"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "'~' would make a string of 67108864"),
    # a list holding the previous one twice, 64 levels deep: 2**64 items once printed
    ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l }}", "printing a value would make"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"
     "{{ ns.l | tojson }}", "printing a value would make"),
    # one 10 MB string printed 100k times: a 1 TB prompt
    ("{% set s = 'x' * 10**7 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "the template's output"),
    ("{{ [[0] * 1000] * 10000 | sum(start=[]) }}", "the sum filter adds numbers"),
], ids=lambda v: v[:24] if isinstance(v, str) else None)
def test_oversized_values_fail_fast_and_small(source, needle):
    template = ChatTemplate(source, timeout=30)
    out, s = _render(template)
    _one_line_error(out, "chat template error: ", needle)
    assert s < 2.0
    tracemalloc.start()  # a second render, traced (tracing makes it several times slower)
    try:
        _one_line_error(_render(template)[0], needle)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 512 << 20, f"the render allocated {peak >> 20} MiB before it failed"


@pytest.mark.parametrize("source, needle", [
    ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "RecursionError"),
    ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "RecursionError"),
    ("{{ 10.0 ** 1000 }}", "OverflowError"),
    ("{{ range(10**20) | length }}", "OverflowError"),
])
def test_recursion_and_overflow_are_value_errors(source, needle):
    out, s = _render(ChatTemplate(source))
    _one_line_error(out, "chat template error: ", needle)
    assert s < 2.0


def test_the_thread_renders_again_and_keeps_its_tracer():
    template = ChatTemplate("{% if spin %}" + NESTED + "{% endif %}<{{ messages[0].content }}>", timeout=0.3)
    seen, box = [], {}

    def tracer(frame, event, arg):  # a debugger's or coverage's stand-in, on the render's thread
        if frame.f_code.co_name == "marker":
            seen.append(event)
        return None

    def marker():
        return 1

    def scenario():  # on a thread of its own, as a server's worker renders
        sys.settrace(tracer)
        try:
            box["timed out"] = _error_of(lambda: template.render(HI, spin=True))
            box["tracer after"] = sys.gettrace()
            box["again"] = template.render(HI, spin=False)
            marker()
        finally:
            sys.settrace(None)

    th = threading.Thread(target=scenario, daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "the render is still running"
    _one_line_error(box["timed out"], "timed out after 0.3 s")
    assert box["tracer after"] is tracer and box["again"] == "<hi>" and seen == ["call"]


def _error_of(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


def test_each_thread_has_its_own_deadline():
    """A looping render in one thread does not stop renders of the same template in another."""
    template = ChatTemplate("{% if spin %}" + NESTED + "{% endif %}<{{ messages[0].content }}>", timeout=1.0)
    box: dict = {}
    spinner = threading.Thread(target=lambda: box.update(out=_render(template, spin=True)[0]))
    spinner.start()
    renders = 0
    while spinner.is_alive():
        assert template.render(HI, spin=False) == "<hi>"
        renders += 1
    _one_line_error(box["out"], "timed out after 1 s")
    assert renders > 10


# ---- legit templates: the same text as transformers ----------------------------------------------

# Qwen2.5's template, as published
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# every operator, filter and method the bounds look at, used as templates use them
FEATURES = (
    "{{- bos_token }}{% set ns = namespace(n=0, sys='') %}{% macro head(role) %}<|{{ role }}|>{% endmacro %}"
    "{{ '=' * 8 }} {{ '%s has %d messages' % ('chat', messages | length) }} {{ '{} {:>6}'.format('a', 'b') }}"
    "{% if tools %}{{ 'Tools:\n' ~ (tools | tojson(indent=2) | indent(2)) }}"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}{% endif %}"
    "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ head(m.role) }}{{ m.content | trim | replace('  ', ' ') }}"
    "{{ (' [' ~ loop.index ~ '/' ~ loop.length ~ ']') | center(12) }}{{ m.content.strip().ljust(3, '.') }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson(separators=(',', ':')) }}{% endfor %}{% endif %}{{ loop.cycle('\n', '\n\n') }}{% endfor %}"
    "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | map('upper') | first }}"
    "{{ messages | batch(3) | list | length }} {{ [1, 2, 3] | sum }} {{ 2 ** 10 }} {{ ns.n * 1000003 }}"
    "{{ 'ab' | wordwrap(1) | length }}{{ messages[-1] | string | length > 0 }}"
    "{% if add_generation_prompt %}{{ head('assistant') }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                               "required": ["city"]}}}]


def _chat(n: int = 20) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a  helpful assistant. " * 5}]
    for i in range(n - 4):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "words " * 30})
    return msgs + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "21 °C"}, {"role": "tool", "content": "windy"},
        {"role": "user", "content": "thanks <3 & \"bye\""}]


@pytest.mark.parametrize("source", [QWEN25, FEATURES], ids=["qwen2.5", "features"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_legit_templates_render_as_transformers(source, tools):
    cu = importlib.import_module("transformers.utils.chat_template_utils")
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    chat = _chat()
    (want,), _ = cu.render_jinja_template(conversations=[chat], chat_template=source, add_generation_prompt=True,
                                          tools=tools, **specials)
    assert ChatTemplate(source, specials).render(chat, True, tools=tools) == want


# ---- a server in front of a looping template ----------------------------------------------------

SPIN = ("{% if messages[-1].content == 'spin' %}" + NESTED + "{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
SERVER_LIMIT = 2.0  # s: long enough that /health is asked several times while the render spins


# each API that renders a chat template: path, its body asking `text`, the param its 400 names (None:
# Ollama's errors, {"error": "..."}, name none)
APIS = {
    "chat": ("/v1/chat/completions", lambda text: {
        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}, "messages"),
    "responses": ("/v1/responses", lambda text: {"model": "tiny", "input": text, "max_output_tokens": 2}, "input"),
    "ollama": ("/api/chat", lambda text: {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                          "stream": False, "options": {"num_predict": 2}}, None),
}


@pytest.mark.parametrize("api", APIS)
def test_server_answers_400_and_stays_healthy(api):
    path, body, param = APIS[api]
    tok = TemplateTokenizer(SPIN)
    tok.template = ChatTemplate(SPIN, timeout=SERVER_LIMIT)
    with serving(tiny_app(tok)) as base, httpx.Client(base_url=base, timeout=30) as http:
        box: dict = {}

        def spin():
            t0 = time.monotonic()
            box["r"] = http.post(path, json=body("spin"))
            box["s"] = time.monotonic() - t0

        th = threading.Thread(target=spin)
        th.start()
        during = []  # (status, seconds) of each /health asked while the spinning request was out
        while th.is_alive():
            t0 = time.monotonic()
            code = http.get("/health").status_code
            if th.is_alive():
                during.append((code, time.monotonic() - t0))
        th.join()

        assert "r" in box, "the spinning request got no answer"
        r = box["r"]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        if param is not None:
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
            err = err["message"]
        assert "chat template timed out after 2 s" in err
        assert SERVER_LIMIT <= box["s"] < SERVER_LIMIT + MARGIN
        # the render ran off the event loop: /health answered all the while. On the loop, a /health asked during
        # the render would wait for all of it (SERVER_LIMIT, 2 s) and few would be asked; off it they take
        # ~0.02 s, but one in the full suite once took over 0.5 s (a 2.6 GB test process: a pause of the
        # whole process, not the loop), so the bound is half the render, which still tells the two apart
        assert len(during) >= 5 and all(code == 200 and s < SERVER_LIMIT / 2 for code, s in during), during
        assert http.get("/health").status_code == 200
        ok = http.post(path, json=body("hello"))
        assert ok.status_code == 200, ok.text
