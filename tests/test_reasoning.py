"""Reasoning on the OpenAI port: with a template whose generation prompt opens a think block (as
DeepSeek-R1's does), the reply up to `</think>` is `reasoning_content` (and `reasoning`), streamed
as such, never content; an assistant message's `reasoning_content` reaches the template."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import serving
from tests.test_tools import TemplateTokenizer, tiny_app

THINK = """{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}\
{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant><think>
{% endif %}"""


@pytest.fixture(scope="module")
def think():
    tok = TemplateTokenizer(THINK)
    with serving(tiny_app(tok, 256)) as base:
        yield tok, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def test_open_think_block_is_reasoning_streamed_and_not(think):
    tok, client = think
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
               logit_bias={"100": -100})
    r = client.chat.completions.create(**ask).choices[0].message
    # the random model never writes </think>: all twelve tokens are reasoning
    assert r.content == "" and len(r.reasoning_content) == 12 and r.model_extra["reasoning"] == r.reasoning_content
    raw = client.completions.create(model="tiny", prompt=tok.last, max_tokens=12, temperature=0,
                                    logit_bias={"100": -100}).choices[0].text
    assert r.reasoning_content == raw  # the same tokens, only routed
    parts = {"content": "", "reasoning_content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            parts["content"] += ch.delta.content or ""
            parts["reasoning_content"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"content": "", "reasoning_content": r.reasoning_content}


def test_reasoning_of_history_reaches_the_template(think):
    tok, client = think
    client.chat.completions.create(model="tiny", max_tokens=1, messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "because"},
        {"role": "user", "content": "q2"}])
    assert "<assistant>[because]a<user>q2" in tok.last


def test_a_thinking_budget_closes_the_block_and_the_answer_follows(think):
    """max_reasoning_tokens 5 on a model that would think forever: its first 5 tokens are the reasoning (the
    same as unbudgeted, greedy), `</think>` (8 byte tokens here) is forced, and the rest of max_tokens is
    content, streamed the same; thinking_budget_tokens is the same; a bad value is a 400 naming it."""
    _, client = think
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, logit_bias={"100": -100})
    free = client.chat.completions.create(**ask, max_tokens=5).choices[0].message.reasoning_content
    for field in ("max_reasoning_tokens", "thinking_budget_tokens"):
        r = client.chat.completions.create(**ask, max_tokens=40, extra_body={field: 5})
        m = r.choices[0].message
        assert m.reasoning_content == free and len(m.content) == 40 - 5 - len("</think>"), (m.reasoning_content,
                                                                                           m.content)
        assert r.choices[0].finish_reason == "length"
    parts = {"content": "", "reasoning_content": ""}
    for chunk in client.chat.completions.create(**ask, max_tokens=40, stream=True,
                                                extra_body={"max_reasoning_tokens": 5}):
        for ch in chunk.choices:
            parts["content"] += ch.delta.content or ""
            parts["reasoning_content"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"content": m.content, "reasoning_content": free}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, max_tokens=4, extra_body={"max_reasoning_tokens": -1})
    assert e.value.body["param"] == "max_reasoning_tokens"
