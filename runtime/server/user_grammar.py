"""A request's own grammar, in the fields vLLM and llama-server take it in, on /v1/chat/completions and
/v1/completions:

- vLLM's `structured_outputs`: one of `{"regex": R}`, `{"choice": [..]}`, `{"grammar": G}`, `{"json": S}`,
  `{"json_object": true}` (with `disable_additional_properties: true` closing S's objects);
- vLLM's older top-level `guided_regex`, `guided_choice`, `guided_grammar`, `guided_json`;
- llama-server's top-level `grammar` (GBNF).

A grammar is Lark or GBNF either way (llguidance tells them apart by `start:` / `root ::=`). Each becomes
what the engine already runs: a Lark grammar (engine/grammar.py `user_lark`) or a JSON schema. A
mistake is a 400 naming the field, found while parsing, before anything is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lowbit.runtime.engine.grammar import GrammarError, check_schema, closed, user_lark
from lowbit.runtime.server.errors import bad_request

# top-level field → the kind of grammar it holds
_TOP = {"guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar", "guided_json": "json",
        "grammar": "grammar"}
_KINDS = ("regex", "choice", "grammar", "json", "json_object")
# structured_outputs options: disable_additional_properties closes `json`'s objects; the rest are accepted
# without effect (one grammar library, no fallback to switch off; JSON's whitespace is always strict)
_OPTIONS = {"disable_additional_properties", "disable_fallback", "disable_any_whitespace", "whitespace_pattern"}
GRAMMAR_FIELDS = frozenset({"structured_outputs", *_TOP})


@dataclass(frozen=True)
class UserGrammar:
    param: str  # the request field it came from: errors name it
    lark: str | None = None
    schema: dict | None = None


def user_grammar(body: dict) -> UserGrammar | None:
    """The request's own grammar, or None when it sends none. Raises a 400 naming the field."""
    given = [*_structured(body.get("structured_outputs")),
             *((f, kind, body[f]) for f, kind in _TOP.items() if body.get(f) is not None)]
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(g[0] for g in given)
        raise bad_request(f"give one grammar, not {names}", given[1][0].split(".")[0])
    where, kind, value = given[0]
    param = where.split(".")[0]
    try:
        if kind in ("json", "json_object"):
            strict = (body.get("structured_outputs") or {}).get("disable_additional_properties") is True
            return UserGrammar(param, schema=_schema(kind, value, strict))
        return UserGrammar(param, lark=user_lark(kind, value))
    except GrammarError as e:
        raise bad_request(f"{where} {e}", param) from None


def grammar_param(body: dict) -> str:
    """The field a request's grammar came from, for an error about it: response_format unless one of ours."""
    return next((f for f in ("structured_outputs", *_TOP) if body.get(f) is not None), "response_format")


def _structured(spec: Any) -> list[tuple[str, str, Any]]:
    """structured_outputs → its (field, kind, value) constraints; None-valued keys are clients' defaults."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise bad_request("structured_outputs must be an object such as {\"regex\": \"...\"}", "structured_outputs")
    unknown = sorted(k for k, v in spec.items() if v is not None and k not in (*_KINDS, *_OPTIONS))
    if unknown:
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported (give one of {', '.join(_KINDS)})",
                          "structured_outputs")
    given = [(f"structured_outputs.{k}", k, spec[k]) for k in _KINDS if spec.get(k) not in (None, False)]
    if not given:
        raise bad_request(f"structured_outputs needs one of {', '.join(_KINDS)}", "structured_outputs")
    return given


def _schema(kind: str, value: Any, strict: bool) -> dict:
    if kind == "json_object":
        return {"type": "object"}
    if isinstance(value, str):  # vLLM takes the schema as an object or as its JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise GrammarError("must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(value, dict):
        raise GrammarError("must be a JSON schema (an object, or its JSON text)")
    schema = closed(value) if strict else value
    check_schema(schema)
    return schema
