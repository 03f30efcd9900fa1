"""Structured output: OpenAI's `response_format` as token-level constrained decoding (llguidance).

A request's grammar masks the logits of every step to the tokens that keep the output a prefix of
some string the grammar accepts, so the reply always parses: `{"type": "json_object"}` is any JSON
object, `{"type": "json_schema", "json_schema": {"schema": ...}}` a JSON value matching the schema.
Once the grammar is complete and nothing can extend it, only the end token is allowed, and the
request stops there. The grammar library does the parsing (llguidance, maintained by Microsoft for
guidance and used by vLLM and llama.cpp); lowbit only hands it the vocabulary and the tokens.

Cost: building the vocabulary's token trie takes ~0.1-1 s, once per server (`GrammarCompiler`
is created with the app and builds it on the first structured request); a mask is computed per
step per constrained request, typically well under a millisecond for JSON.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

# the separators OpenAI's JSON mode writes; strict whitespace keeps a small model from wandering
# into runs of spaces and newlines that only end at max_tokens
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response_format the grammar library cannot compile: the client's mistake (HTTP 400)."""


class _Vocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer: each id's raw bytes, the special
    ids, the end tokens and an encoder (used only for text the grammar forces)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(getattr(tokenizer, "special_ids", ()))
        self.eos_token_id = min(tokenizer.eos_ids)
        self.bos_token_id = getattr(tokenizer, "bos_id", None)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False)


class GrammarCompiler:
    """Turns a response_format into a per-request `Grammar`, for one tokenizer. Thread-safe."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ll_tokenizer = None
        self._lock = threading.Lock()

    def _llt(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                vocab = _Vocab(self._tokenizer)
                self._ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab),
                                                            n_vocab=len(vocab.tokens),
                                                            eos_token=sorted(self._tokenizer.eos_ids))
            return self._ll_tokenizer

    @staticmethod
    def schema_of(response_format: Any) -> dict | None:
        """The JSON schema a response_format asks for; None for plain text. Raises GrammarError
        naming what is wrong with the field."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise GrammarError("response_format must be an object such as {\"type\": \"json_object\"}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise GrammarError("response_format.json_schema must be an object with a \"schema\" object")
            schema = spec.get("schema", {})
            schema = schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
            # OpenAI's strict mode: only the declared properties; without it the schema is read as written
            return closed(schema) if spec.get("strict") is True else schema
        raise GrammarError(f"response_format.type must be text, json_object or json_schema, not {kind!r}")

    def compile(self, schema: dict) -> "Grammar":
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return self._matcher(grammar)

    def compile_lark(self, lark: str) -> "Grammar":
        """A grammar in llguidance's Lark syntax (`%json {schema}` embeds a JSON schema)."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid grammar: {e}") from None
        return self._matcher(grammar)

    def _matcher(self, grammar: str) -> "Grammar":
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._llt())
        if is_error:
            raise GrammarError(f"unsupported JSON schema or grammar: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(self._llt(), grammar)
        if matcher.is_error():
            raise GrammarError(f"unsupported JSON schema or grammar: {matcher.get_error()}")
        return Grammar(matcher, self._tokenizer.vocab_size)


def user_lark(kind: str, value: Any) -> str:
    """A request's own grammar as llguidance Lark: `regex` (the whole output matches it), `choice` (a
    list of strings: the output is exactly one), `grammar` (Lark, or GBNF as llama.cpp writes it:
    llguidance converts it). Checked here, without a tokenizer, so a mistake is the client's 400 before
    anything is queued; raises GrammarError with a one-line reason."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise GrammarError("must be a non-empty regular expression")
        lark = f"start: /{llguidance.regex_to_lark(value)}/"
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise GrammarError("must be a non-empty list of non-empty strings")
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)  # JSON escapes are Lark's
    elif not isinstance(value, str) or not value.strip():
        raise GrammarError("must be a Lark or GBNF grammar (a non-empty string)")
    else:
        try:
            lark = any_to_lark(value)  # Lark as given (it has `start:`), else GBNF (`root ::= ...`)
        except Exception as e:  # noqa: BLE001 -- the converter raises a bare Exception for an undefined rule
            raise GrammarError(f"invalid GBNF grammar: {_one_line(e)}") from None
    _check(llguidance.LLMatcher.grammar_from_lark(lark), f"invalid {kind}")
    return lark


def check_schema(schema: dict) -> None:
    """Raises GrammarError (one line) where llguidance cannot hold output to `schema`."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {_one_line(e)}") from None
    _check(grammar, "unsupported JSON schema")


def _check(grammar: str, what: str) -> None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{what}: {_one_line(messages[0])}")


def _one_line(e: Any) -> str:
    """llguidance's message on one line: its first, and the regex parser's `error:` line (the rest
    echoes the grammar with a caret under the spot)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines()]
    return " ".join([lines[0], *(ln for ln in lines[1:] if ln.startswith("error:"))]) if lines else type(e).__name__


def closed(schema: Any) -> Any:
    """`schema` with every object schema that does not say otherwise closed (`additionalProperties:
    false`), as OpenAI's strict mode reads it, through properties, items, $defs and anyOf/oneOf/allOf.
    An open object lets a small model invent properties (SmolLM2-135M wrote "allergy_to_nuts" and
    "price" into a book_table call, 8 of 20 seeded calls) and run on into max_tokens."""
    return _closed(schema, False)


def _closed(s: Any, same_object: bool) -> Any:
    """same_object: `s` is a branch of an object schema (or of allOf), describing the same object as
    its parent: its own level stays open and the parent, closed, admits the names it declares (JSON
    Schema's additionalProperties sees only sibling properties: closing each allOf branch would admit
    no property at all)."""
    if not isinstance(s, dict):
        return s
    out = dict(s)
    for k in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(s.get(k), dict):
            out[k] = {n: _closed(v, False) for n, v in s[k].items()}
    for k in ("items", "additionalProperties", "prefixItems"):
        v = s.get(k)
        out[k] = [_closed(x, False) for x in v] if isinstance(v, list) else _closed(v, False)
    obj = _is_object(s)
    for k in ("anyOf", "oneOf", "allOf"):
        if isinstance(s.get(k), list):
            out[k] = [_closed(b, same_object or obj or k == "allOf") for b in s[k]]
    out = {k: v for k, v in out.items() if k in s}
    if out.get("propertyNames") == {"type": "string"}:
        # says nothing (every JSON key is a string) and llguidance cannot compile it ("Unimplemented keys"):
        # zod's records carry it (Claude Code's TaskCreate `metadata`), and left in, every such request is a 400
        del out["propertyNames"]
    names = _names(s, ("anyOf", "oneOf", "allOf") if obj else ("allOf",))
    if same_object or not (obj or names) or "additionalProperties" in s or "unevaluatedProperties" in s:
        return out
    # in the order declared, the parent's own first: llguidance writes properties in schema order
    props = {**out.get("properties", {}), **{n: {} for n in names if n not in out.get("properties", {})}}
    return {**out, **({"properties": props} if props else {}), "additionalProperties": False}


def _is_object(s: dict) -> bool:
    t = s.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or isinstance(s.get("properties"), dict)


def _names(s: Any, keys: tuple[str, ...] = ("anyOf", "oneOf", "allOf")) -> list[str]:
    """The property names a schema declares at its own level, those of its `keys` branches included (an
    untyped schema's anyOf branches are objects of their own, closed each alone)."""
    if not isinstance(s, dict):
        return []
    own = list(s["properties"]) if isinstance(s.get("properties"), dict) else []
    branches = [b for k in keys if isinstance(s.get(k), list) for b in s[k]]
    return list(dict.fromkeys(own + [n for b in branches for n in _names(b)]))


class Grammar:
    """One request's constraint: `mask` the next token's logits, then `accept` the chosen token."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)  # one bit per token, little-endian
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool))

    def mask(self, logits: torch.Tensor) -> None:
        """In place on one row [V] (V >= vocab_size; ids past the tokenizer are already -inf)."""
        allowed = self.allowed().to(logits.device)
        logits[: self._vocab].masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if not self._m.consume_token(token):
            raise RuntimeError(f"grammar refused token {token}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """Complete: nothing but the end token may follow."""
        return self._m.is_stopped()

    def reset(self) -> None:
        self._m.reset()


class LazyGrammar:
    """A grammar that waits for its trigger: the output is free until it ends with `trigger` (a tool
    call's opening marker), then held to `body` until that completes, then free again (and the
    next trigger starts `body` afresh). So a model may talk before a call, and a call it opens always
    parses. The trigger counts only where it ends on a token boundary, as a marker that is one token
    (Qwen's `<tool_call>`) always does."""

    def __init__(self, trigger: str, body: Grammar, tokenizer):
        self.trigger, self.body, self.tok = trigger, body, tokenizer
        self.active = False
        self.tail = ""  # the output's last len(trigger) characters while free

    def mask(self, logits: torch.Tensor) -> None:
        if self.active:
            self.body.mask(logits)

    def accept(self, token: int) -> None:
        if self.active:
            self.body.accept(token)
            if self.body.done:  # the call closed: free text again, and a fresh body for the next call
                self.active, self.tail = False, ""
                self.body.reset()
            return
        text = self.tok.token_bytes(token).decode("utf-8", errors="replace")
        self.tail = (self.tail + text)[-len(self.trigger):]
        self.active = self.tail == self.trigger

    @property
    def done(self) -> bool:
        return False  # free text ends where the model ends it
