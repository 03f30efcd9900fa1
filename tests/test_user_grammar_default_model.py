"""A request's own grammar on `lowbit serve` with the default model, sent as clients send it (the `openai`
package's extra_body): vLLM's structured_outputs and guided_*, llama-server's GBNF `grammar`, on
/v1/chat/completions and /v1/completions; and the 400s that name the field."""

from __future__ import annotations

import re

import openai
import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Is Paris the capital of France?"}]
CHOICES = ["yes", "no", "it depends"]


def _chat(client, model, extra: dict, seed: int = 0, max_tokens: int = 24) -> str:
    r = client.chat.completions.create(model=model, messages=ASK, seed=seed, temperature=1.0, max_tokens=max_tokens,
                                       extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    return r.choices[0].message.content


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}],
                         ids=["structured_outputs", "guided"])
def test_choice_answers_one_of_them(serve_client, serve_model_id, extra):
    for seed in range(3):
        assert _chat(serve_client, serve_model_id, extra, seed) in CHOICES
    r = serve_client.completions.create(model=serve_model_id, prompt="Q: Is the sky blue?\nA:", max_tokens=8, seed=0,
                                        extra_body=extra)
    assert r.choices[0].text in CHOICES


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, {"guided_regex": r"\d{3}-\d{4}"}],
                         ids=["structured_outputs", "guided"])
def test_regex_matches_whole(serve_client, serve_model_id, extra):
    for seed in range(3):
        assert re.fullmatch(r"\d{3}-\d{4}", _chat(serve_client, serve_model_id, extra, seed))


@pytest.mark.parametrize("extra, pattern", [
    ({"grammar": 'root ::= ("yes" | "no") ", because " [a-z]{1,12} "."'}, r"(yes|no), because [a-z]{1,12}\."),
    ({"structured_outputs": {"grammar": 'start: "Answer: " WORD\nWORD: /[A-Z][a-z]{1,10}/'}}, r"Answer: [A-Z][a-z]{1,10}"),
    ({"guided_grammar": 'root ::= [0-9]{2} " km"'}, r"[0-9]{2} km"),
], ids=["llama_gbnf", "lark", "guided_gbnf"])
def test_grammar_holds_the_output(serve_client, serve_model_id, extra, pattern):
    for seed in range(2):
        assert re.fullmatch(pattern, _chat(serve_client, serve_model_id, extra, seed))
    r = serve_client.completions.create(model=serve_model_id, prompt="The answer:", max_tokens=24, seed=0,
                                        extra_body=extra)
    assert re.fullmatch(pattern, r.choices[0].text)


def test_json_schema_spelled_by_vllm(serve_client, serve_model_id):
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    text = _chat(serve_client, serve_model_id, {"structured_outputs": {"json": schema,
                                                                       "disable_additional_properties": True}})
    assert text in ('{"answer": true}', '{"answer": false}')


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"grammar": "root ::= undefined"}, "grammar"),
    ({"structured_outputs": {"grammar": 'start: "a" b'}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_choice": ["a"], "grammar": 'root ::= "a"'}, "grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"grammar": 'root ::= "a"', "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "grammar"),
])
def test_bad_grammar_is_a_400_naming_the_field(serve_client, serve_model_id, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        serve_client.chat.completions.create(model=serve_model_id, messages=ASK, max_tokens=4, extra_body=extra)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and "\n" not in err["message"], err
