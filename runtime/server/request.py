"""An OpenAI request body → what the engine runs: prompt ids, one SamplingParams per choice, an
optional JSON schema to constrain the reply, and how to answer (stream, usage, logprobs).

Every field the server cannot honour is a 400 naming its `param`; fields it does not know are
logged and ignored (clients send vendor extensions), and the few known fields without effect here
(`user`, `store`, ...) are accepted silently.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from lowbit.runtime.engine.grammar import GrammarCompiler, GrammarError
from lowbit.runtime.engine.sampler import MAX_LOGPROBS, SamplingParams
from lowbit.runtime.load.chat_template import REASONING_FIELDS
from lowbit.runtime.load.tokenizer import PromptTooLong
from lowbit.runtime.server.body import decode_json
from lowbit.runtime.server.errors import APIError, bad_request, context_exceeded
from lowbit.runtime.server.fim import fim_prompt
from lowbit.runtime.server.harmony import harmony_history, is_harmony
from lowbit.runtime.server.reply import think_tags
from lowbit.runtime.server.tools import ToolPlan, history_message, parse_tools, prompt_messages, reply_grammar
from lowbit.runtime.server.user_grammar import GRAMMAR_FIELDS, grammar_param, user_grammar

log = logging.getLogger("lowbit.server")

MAX_CHOICES = 128  # OpenAI's bound on n
# Bounds on what one request may ask of every decode step: each stop string is searched in the
# tail of every detokenized delta (500k of them cost 278 ms a token), each logit_bias entry is a
# write per step. OpenAI allows 4 stop strings, 300 biased tokens and 128 tools; these are looser
# for local agents that send long stop lists, and still keep a step's cost bounded.
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
# fields both endpoints pass on to SamplingParams under the same names
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed")
# what a request that omits them samples with when the model names no defaults of its own (OpenAI's)
OPENAI_DEFAULTS = MappingProxyType({"temperature": 1.0, "top_p": 1.0})
# fields accepted and deliberately without effect here
_IGNORED = {"user", "store", "metadata", "service_tier"}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "n", "stop", "logit_bias", "logprobs",
           "response_format", "ignore_eos", *_SAMPLING, *_IGNORED,  # ignore_eos: vLLM's and llama.cpp's extension
           *GRAMMAR_FIELDS}  # vLLM's structured_outputs / guided_*, llama-server's grammar (server/user_grammar.py)
# a thinking budget (runtime/engine/think_budget.py): lowbit's name, and one for Anthropic's budget_tokens
BUDGET_FIELDS = ("max_reasoning_tokens", "thinking_budget_tokens")
CHAT_FIELDS = frozenset({"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                         "function_call", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort",
                         *BUDGET_FIELDS, *_COMMON})
# OpenAI's reasoning_effort values; the template reads the one given as `reasoning_effort` (gpt-oss's writes
# "Reasoning: low" into its system message, and was trained on low, medium and high)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# chat_template_kwargs (vLLM's and llama-server's extension): extra variables for the template, such as
# Qwen3's enable_thinking; never the ones the server itself sets
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
COMPLETION_FIELDS = frozenset({"prompt", "echo", "best_of", "suffix", *_COMMON})
# /tokenize as vLLM ("prompt" or "messages") and llama-server ("content") take it
TOKENIZE_FIELDS = frozenset({"model", "prompt", "content", "messages", "add_generation_prompt", "add_special_tokens"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
EMBEDDINGS_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
_ROLES = ("system", "user", "assistant", "developer", "tool")
_PARAMS_FIELDS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "logit_bias", "seed", "max_tokens", "stop", "logprobs"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class Parsed:
    chat: bool  # /v1/chat/completions, else /v1/completions
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per choice
    schema: dict | None  # response_format's (or structured_outputs.json's) JSON schema: constrain every choice to it
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: bool = False  # /v1/completions: the prompt leads the text (and its tokens the logprobs)
    generate: bool = True  # False: max_tokens 0 with echo, the prompt scored and nothing generated
    tools: ToolPlan | None = None  # the request's tools: how to read calls out of the reply
    think: tuple[str, str] | None = None  # the template's think tags: a leading block in them is reasoning
    in_think: bool = False  # the prompt itself opened the think block
    harmony: bool = False  # the template writes gpt-oss's harmony format: server/harmony.py reads the reply
    reasoning_budget: int | None = None  # reasoning tokens before the think block is closed for the model
    lark: str | None = None  # a Lark grammar for every choice: tools.reply_grammar's, or the request's own
    # (server/user_grammar.py)


class RequestParser:
    def __init__(self, tokenizer, model_name: str, max_model_len: int, aliases: tuple[str, ...] = (),
                 defaults: Mapping[str, float] | None = None):
        """model_name: the id responses carry; a request may name it or any of `aliases`. defaults: the
        sampling a request gets where it sets none (the model's own, runtime/load/sampling_defaults.py,
        over which `lowbit serve --temperature/--top-p/--top-k/--min-p` win), else OpenAI's."""
        self.tok, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len
        self.defaults = {**OPENAI_DEFAULTS, **(defaults or {})}
        self.names = (model_name, *aliases)

    def body(self, raw: bytes, fields: frozenset[str]) -> dict:
        body = decode_json(raw)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        unknown = sorted(set(body) - fields)
        if unknown:
            log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        model = body.get("model")
        if model is not None and model not in self.names:
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                                f"{', '.join(repr(n) for n in self.names)}).",
                           "invalid_request_error", "model", "model_not_found")
        return body

    # ---- the two endpoints ------------------------------------------------------------------------

    def chat(self, body: dict) -> Parsed:
        self._unsupported(body, chat=True)
        template = getattr(self.tok, "chat_template", None)
        plan = parse_tools(body, template)
        harmony = is_harmony(template)
        history = self._messages(body)
        messages, tools = prompt_messages(harmony_history(history) if harmony else history, plan)
        extra = {**_reasoning_effort(body, template), **_template_kwargs(body)}
        try:
            ids = self.tok.encode_chat(messages, add_generation_prompt=True, limit=self.max_model_len - 1, **extra,
                                       **({"tools": tools} if tools else {}))
        except ValueError as e:
            raise bad_request(f"cannot render the chat template: {e}", "messages") from None
        except PromptTooLong as e:
            raise context_exceeded(self.max_model_len, e.at_least, "messages", at_least=True) from None
        self._check_prompt_len(len(ids), "messages")
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):  # 1 == True in Python; OpenAI answers 400
            raise bad_request("logprobs must be a boolean", "logprobs")
        if top is not None:
            if not lp:
                raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
            if not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
                raise bad_request(f"top_logprobs must be an int in [0, {MAX_LOGPROBS}]", "top_logprobs")
        params = self._params(body, len(ids), "max_completion_tokens", (top or 0) if lp else None)
        parsed = self._parsed(body, True, ids, params)
        think = think_tags(template)
        # decoded, not matched by id: a byte vocabulary spells the tag out
        in_think = think is not None and self.tok.decode(ids[-16:]).rstrip().endswith(think[0])
        lark = reply_grammar(plan, in_think)
        if plan is not None and (plan.schema is not None or lark is not None):
            if parsed.schema is not None or parsed.lark is not None:
                param = grammar_param(body)
                raise bad_request(f"{param} cannot be combined with tool_choice 'required', a named "
                                  "function, or tools on a template without tool support", param)
            parsed = replace(parsed, schema=plan.schema)
        if harmony:  # its channel markers are special tokens the reply parser must see
            parsed = replace(parsed, params=[replace(p, skip_special_tokens=False) for p in parsed.params])
        return replace(parsed, tools=plan, think=think, in_think=in_think, harmony=harmony, lark=lark or parsed.lark,
                       reasoning_budget=_reasoning_budget(body) if think is not None else None)

    def completion(self, body: dict) -> Parsed:
        self._unsupported(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.tok.vocab_size for t in ids):
                raise bad_request("prompt token ids must lie in the vocabulary", "prompt")
        elif isinstance(prompt, str) and body.get("suffix"):  # fill in the middle: the prefix may be empty
            try:
                ids = fim_prompt(self.tok, prompt, body["suffix"], limit=self.max_model_len - 1)
            except PromptTooLong as e:
                raise context_exceeded(self.max_model_len, e.at_least, "prompt", at_least=True) from None
        elif isinstance(prompt, str) and prompt:
            try:
                ids = self.tok.encode(prompt, add_special=True, limit=self.max_model_len - 1)
            except PromptTooLong as e:
                raise context_exceeded(self.max_model_len, e.at_least, "prompt", at_least=True) from None
        else:
            raise bad_request("prompt must be a non-empty string (or one list of token ids)", "prompt")
        self._check_prompt_len(len(ids), "prompt")
        lp = body.get("logprobs")
        if lp is not None and not (_is_int(lp) and 0 <= lp <= 5):
            raise bad_request("logprobs must be an int in [0, 5]", "logprobs")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad_request("echo must be a boolean", "echo")
        score_only = echo and body.get("max_tokens") == 0  # lm-eval's loglikelihood: the prompt alone
        params = self._params({**body, "max_tokens": 1} if score_only else body, len(ids), "max_tokens", lp)
        return replace(self._parsed(body, False, ids, params), echo=echo, generate=not score_only)

    # ---- pieces -----------------------------------------------------------------------------------

    def tokenize(self, body: dict) -> list[int]:
        """/tokenize: `prompt` (or `content`) as text, special tokens added unless
        add_special_tokens is false; or `messages` through the chat template."""
        if "messages" in body:
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise bad_request("add_generation_prompt must be a boolean", "add_generation_prompt")
            messages = self._messages(body)
            if is_harmony(getattr(self.tok, "chat_template", None)):
                messages = harmony_history(messages)
            try:
                return self.tok.encode_chat(messages, add_generation_prompt=gen)
            except ValueError as e:
                raise bad_request(str(e), "messages") from None
        key = "prompt" if "prompt" in body else "content"
        text, special = body.get(key), body.get("add_special_tokens", True)
        if not isinstance(text, str):
            raise bad_request(f"{key} must be a string (or give messages)", key)
        if not isinstance(special, bool):
            raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
        return self.tok.encode(text, add_special=special)

    def embeddings(self, body: dict) -> tuple[list[list[int]], str]:
        """/v1/embeddings → (each input's token ids, encoding_format). input: a string, a list of
        strings, a token array, or a list of token arrays."""
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
        if body.get("dimensions") is not None:
            raise bad_request("dimensions is not supported: the embedding is the model's hidden size", "dimensions")
        x = body.get("input")
        is_ids = lambda v: isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)  # noqa: E731
                                                            for t in v)
        if isinstance(x, str) or is_ids(x):
            x = [x]
        if not isinstance(x, list) or not x or not all(isinstance(v, str) or is_ids(v) for v in x):
            raise bad_request("input must be a non-empty string, a list of strings, or token arrays", "input")
        out = []
        for v in x:
            try:
                ids = self.tok.encode(v, limit=self.max_model_len) if isinstance(v, str) else v
            except PromptTooLong as e:
                raise context_exceeded(self.max_model_len, e.at_least, "input", at_least=True) from None
            if not ids:
                raise bad_request("input: an empty text has no tokens to embed", "input")
            if any(not 0 <= t < self.tok.vocab_size for t in ids):
                raise bad_request(f"input: every token id must be in 0..{self.tok.vocab_size - 1}", "input")
            if len(ids) > self.max_model_len:
                raise context_exceeded(self.max_model_len, len(ids), "input")
            out.append(ids)
        return out, fmt

    def detokenize(self, body: dict) -> str:
        ids = body.get("tokens")
        vocab = self.tok.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("tokens must be a list of token ids", "tokens")
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"tokens: every id must be in 0..{vocab - 1}", "tokens")
        return self.tok.decode(ids)

    def _parsed(self, body: dict, chat: bool, ids: list[int], params: SamplingParams) -> Parsed:
        n = body.get("n")
        n = 1 if n is None else n
        if not (_is_int(n) and 1 <= n <= MAX_CHOICES):
            raise bad_request(f"n must be an int in [1, {MAX_CHOICES}]", "n")
        # a seeded request with n choices: choice i draws from seed + i, so the choices differ and the
        # whole reply is reproducible; unseeded choices each get their own random seed
        per_choice = [params if params.seed is None else replace(params, seed=(params.seed + i) % 2**64)
                      for i in range(n)]
        try:
            schema = GrammarCompiler.schema_of(body.get("response_format"))
        except GrammarError as e:
            raise bad_request(str(e), "response_format") from None
        own = user_grammar(body)
        if own is not None and schema is not None:
            raise bad_request(f"{own.param} cannot be combined with response_format", own.param)
        opts = body.get("stream_options") or {}
        return Parsed(chat, ids, per_choice, own.schema if own else schema, bool(body.get("stream")),
                      bool(opts.get("include_usage")), params.logprobs is not None, lark=own.lark if own else None)

    def _check_prompt_len(self, n: int, param: str) -> None:
        if n >= self.max_model_len:
            raise context_exceeded(self.max_model_len, n, param)

    def _messages(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise bad_request(f"messages[{i}] must have a role among {', '.join(_ROLES)}", "messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                        raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
                    parts.append(p["text"])
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            msg = {"role": role, "content": content, **history_message(i, m)}
            reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k)), None)
            if role == "assistant" and reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad_request(f"messages[{i}].reasoning_content must be a string", "messages")
                msg["reasoning_content"] = reasoning
            out.append(msg)
        return out

    @staticmethod
    def _unsupported(body: dict, chat: bool) -> None:
        if not chat:
            for name in ("tools", "functions"):
                if body.get(name):
                    raise bad_request(f"{name} are for /v1/chat/completions", name)
            if body.get("best_of") not in (None, 1):
                raise bad_request("best_of is not supported", "best_of")
            if body.get("suffix") is not None and not isinstance(body["suffix"], str):
                raise bad_request("suffix must be a string", "suffix")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):  # 0 == False in Python
            raise bad_request("stream must be a boolean", "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        usage = (opts or {}).get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
        tools = body.get("tools")
        if isinstance(tools, list) and len(tools) > MAX_TOOLS:
            raise bad_request(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")

    def _params(self, body: dict, prompt_len: int, max_key: str, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
        if body.get("ignore_eos") is not None:
            if not isinstance(body["ignore_eos"], bool):
                raise bad_request("ignore_eos must be a boolean", "ignore_eos")
            kw["ignore_eos"] = body["ignore_eos"]
        for name, value in self.defaults.items():
            kw.setdefault(name, value)
        stop = body.get("stop")
        if stop is not None:
            if isinstance(stop, str):
                stop = [stop]
            if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
                raise bad_request("stop must be a string or a list of strings", "stop")
            if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
                raise bad_request(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters", "stop")
            kw["stop"] = tuple(s for s in stop if s)
        bias = body.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, dict):
                raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
            if len(bias) > MAX_LOGIT_BIAS:
                raise bad_request(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
            try:
                bias = {int(k): v for k, v in bias.items()}
            except (TypeError, ValueError):
                raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
            vocab = self.tok.vocab_size
            bad_ids = [t for t in bias if not 0 <= t < vocab]
            if bad_ids:
                raise bad_request(f"logit_bias token id {bad_ids[0]} is outside the vocabulary [0, {vocab})",
                                  "logit_bias")
            kw["logit_bias"] = bias
        room = self.max_model_len - prompt_len
        max_tokens = body.get(max_key)
        if max_key == "max_completion_tokens" and max_tokens is None:
            max_tokens, max_key = body.get("max_tokens"), "max_tokens"
        if max_tokens is not None:
            if not (_is_int(max_tokens) and max_tokens >= 1):
                raise bad_request(f"{max_key} must be an int >= 1, got {max_tokens!r}", max_key)
            if max_tokens > room:
                raise context_exceeded(self.max_model_len, prompt_len, max_key, max_tokens, max_key)
            kw["max_tokens"] = max_tokens
        else:
            kw["max_tokens"] = room
        kw["logprobs"] = logprobs
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            name = msg.split(" ", 1)[0]
            param = name if name in _PARAMS_FIELDS else None
            if param == "max_tokens":
                param = max_key
            raise bad_request(msg, param) from None


def _reasoning_effort(body: dict, template: str | None) -> dict:
    """reasoning_effort as the template variable of that name, for a template that reads it (others are
    handed nothing new); chat_template_kwargs may still override it."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return {}
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
    return {"reasoning_effort": effort} if "reasoning_effort" in (template or "") else {}


def _reasoning_budget(body: dict) -> int | None:
    """max_reasoning_tokens (or thinking_budget_tokens): an int >= 0, or None for no budget. A template
    without think tags has no block to close, and ignores it (Parsed.reasoning_budget stays None)."""
    given = [(name, body[name]) for name in BUDGET_FIELDS if body.get(name) is not None]
    if not given:
        return None
    name, value = given[0]
    if not (_is_int(value) and value >= 0):
        raise bad_request(f"{name} must be an int >= 0, got {value!r}", name)
    return value


def _template_kwargs(body: dict) -> dict:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise bad_request("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    clash = sorted(set(kw) & _RESERVED_TEMPLATE_VARS)
    if clash:
        raise bad_request(f"chat_template_kwargs cannot set {', '.join(clash)}", "chat_template_kwargs")
    return kw
