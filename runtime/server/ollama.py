"""Ollama's native API (/api/*) on lowbit's port, so that clients which speak only Ollama (the
`ollama` Python package, Continue's Ollama provider, oterm, Open WebUI) run against `lowbit serve
--port 11434` unchanged.

Endpoints, in the shapes of Ollama's docs/api.md: GET /api/version, GET /api/tags, POST /api/show,
GET /api/ps, POST /api/chat, POST /api/generate, POST /api/embed and the older POST /api/embeddings;
POST /api/pull answers "success" for the model being served (it is already here). GET / answers
"Ollama is running", the text clients probe for.

Every generation takes the engine path of /v1/chat/completions: an Ollama body is translated into
an OpenAI one and parsed by `RequestParser` (server/request.py), so prompts, sampling, tools and
`format` (JSON mode or a JSON schema, held by the grammar) get the same checks; the reply's pieces
(server/chat_response.py `replies`) become Ollama's messages: text, `thinking`, and tool calls whose
arguments are objects. Ollama streams by default: NDJSON, one object a line, the last one `done`
with the counts and timings (nanoseconds). Errors are Ollama's `{"error": "..."}` with the status,
a client's mistake always a 4xx.

Ollama's own defaults hold where a request says nothing (temperature 0.8, top_k 40, top_p 0.9),
since its clients are written against them. Load-time options (num_ctx, num_gpu, ...) and options
this sampler lacks (typical_p, mirostat, repeat_last_n, ...) are accepted without effect: the
model is loaded once, by `lowbit serve`. A num_predict beyond the context is cut to the room left,
as Ollama stops there too. `suffix` asks for fill-in-the-middle (server/fim.py). Not here: images
(text-only models), a per-request `template`, and model management (create, copy, delete, push),
which are 400s saying so.

Every route reads its body through `Frontend.parse`, on a worker thread: the body's decoding, the
chat template and the tokenizer never run on the event loop. What the served model is (/api/tags,
/api/ps, /api/show) is server/ollama_card.py.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from lowbit.runtime.engine.embedder import embed
from lowbit.runtime.engine.sampler import MAX_LOGPROBS
from lowbit.runtime.server.chat_response import call_id, replies
from lowbit.runtime.server.deps import frontend, require_key
from lowbit.runtime.server.errors import APIError, bad_request, context_exceeded, shaped_route
from lowbit.runtime.server.frontend import Frontend, Served
from lowbit.runtime.server.model_pool import ModelNotFound
from lowbit.runtime.server.ollama_card import capabilities, card, entries, iso_time, model
from lowbit.runtime.server.request import Parsed, RequestParser
from lowbit.runtime.server.sse import sse_response
from lowbit.runtime.version import lowbit_version

log = logging.getLogger("lowbit.server")

# The Ollama API release whose request and reply shapes these routes follow (tool calls with an
# index, `thinking`, logprobs). A plain x.y.z, since clients compare it to enable features; lowbit's
# own version is reported beside it.
OLLAMA_VERSION = "0.12.0"
# Ollama's DefaultOptions: what its clients get when they set nothing
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# Ollama option → the chat-completions field it is passed on as
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "stop": "stop"}
# an OpenAI field named in a parser's error → the Ollama field the client sent
_RENAMED = (("max_completion_tokens", "num_predict"), ("max_tokens", "num_predict"),
            ("repetition_penalty", "repeat_penalty"), ("response_format", "format"))
_THINK_LEVELS = ("low", "medium", "high", "max")


def error_body(e: APIError) -> dict:
    """Ollama's error: {"error": "..."}, in its words."""
    message = e.message
    for ours, theirs in _RENAMED:
        message = message.replace(ours, theirs)
    return {"error": message}


def _ollama_error(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


public = APIRouter()  # what clients probe the port with, keyless as in Ollama
router = APIRouter(dependencies=[Depends(require_key)], route_class=shaped_route(_ollama_error))


def _now() -> str:
    return iso_time(time.time())


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


# ---- routes -----------------------------------------------------------------------------------------

@public.get("/")
async def root():
    return PlainTextResponse("Ollama is running")


# HEAD / as well (Ollama's clients probe with it), one route of its own: a route of two methods
# gives both one OpenAPI operation id, which FastAPI warns about and schema tools reject
public.add_api_route("/", root, methods=["HEAD"], include_in_schema=False)


@public.get("/api/version")
async def version():
    return {"version": OLLAMA_VERSION, "lowbit": lowbit_version()}


@router.get("/api/tags")
async def tags(request: Request):
    """Every model the port offers: a loaded one described from the model, the others from their offer."""
    fe = frontend(request)
    fe.require()
    out = []
    for name, offer in fe.pool.offers.items():
        held = fe.pool.loaded.get(name)
        out += entries(fe, held.served) if held is not None else [
            {"name": n, "model": n, "modified_at": _now(), "size": offer.bytes, "digest": "",
             "details": {"parent_model": "", "format": "", "family": "", "families": [], "parameter_size": "",
                         "quantization_level": ""}} for n in (name, *offer.aliases)]
    return {"models": out}


@router.get("/api/ps")
async def ps(request: Request):
    """The models in memory now, with when each goes once idle (keep_alive, --idle-unload)."""
    fe = frontend(request)
    if fe.pool is None:  # still loading: nothing is in memory yet
        return {"models": []}
    out = []
    for held in list(fe.pool.loaded.values()):
        served = held.served
        c = card(fe, served)
        device = (served.formats or {}).get("device") or getattr(model(served), "device", "cpu")
        size_vram = c.size if str(device).startswith("cuda") else 0
        out += [{**e, "expires_at": _expires(held.expires), "size_vram": size_vram,
                 "context_length": served.max_model_len} for e in entries(fe, served)]
    return {"models": out}


def _expires(at: float | None) -> str:
    """A monotonic unload time as Ollama's RFC 3339 timestamp (never: Ollama's far-future one)."""
    if at is None:
        return "2318-01-01T00:00:00Z"
    wall = time.time() + (at - time.monotonic())
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


@router.post("/api/show")
async def show(request: Request):
    fe = frontend(request)
    served = await _model(fe, request)
    body = await fe.body(request)
    _resolve(served, body.get("model") or body.get("name"))  # `name`: the older clients' field
    c = card(fe, served)
    template = getattr(served.tokenizer, "chat_template", None) or ""
    defaults = {{"repetition_penalty": "repeat_penalty"}.get(k, k): v for k, v in {**DEFAULTS, **served.sampling}.items()}
    parameters = "\n".join(f"{k:<30} {v}" for k, v in defaults.items())
    modelfile = (f"# Modelfile of the model lowbit serves\nFROM {served.model_name}\n"
                 + (f'TEMPLATE """{template}"""\n' if template else "")
                 + "".join(f"PARAMETER {k} {v}\n" for k, v in defaults.items()))
    return {"modelfile": modelfile, "parameters": parameters, "template": template, "details": c.details,
            "model_info": c.model_info, "capabilities": capabilities(served), "modified_at": c.modified_at,
            "license": ""}


@router.post("/api/chat")
async def chat(request: Request):
    t0 = time.perf_counter()
    fe = frontend(request)
    served = await _model(fe, request)
    name, stream, parsed = await fe.parse(request, _chat_request, served.parser, served)
    if not isinstance(parsed, Parsed):  # the model (un)loaded: nothing to generate
        return await _loaded(fe, served, parsed)
    gen = _Generation(fe, served, parsed, t0)
    return await _run(gen, stream, partial(_chat_frame, name), gen.stats)


@router.post("/api/generate")
async def generate(request: Request):
    t0 = time.perf_counter()
    fe = frontend(request)
    served = await _model(fe, request)
    name, stream, parsed = await fe.parse(request, _generate_request, served.parser, served)
    if not isinstance(parsed, Parsed):  # the model (un)loaded: nothing to generate
        return await _loaded(fe, served, parsed)
    gen = _Generation(fe, served, parsed, t0)
    return await _run(gen, stream, partial(_generate_frame, name), partial(_generate_final, gen))


async def _loaded(fe, served, reply: dict) -> dict:
    """Ollama's load / unload request answered: `keep_alive: 0` with nothing to generate unloads the model
    now (a model handed over loaded, as in tests, stays: server/model_pool.py)."""
    if reply.get("done_reason") == "unload":
        await fe.pool.unload(served.model_name)
    return reply


@router.post("/api/embed")
async def embed_route(request: Request):
    t0 = time.perf_counter()
    fe = frontend(request)
    served = await _model(fe, request)
    name, ids, dimensions = await fe.parse(request, _embed_request, served)
    vectors, n = ([], 0) if not ids else await _embeddings(fe, served, ids, dimensions)
    return {"model": name, "embeddings": vectors, "total_duration": _ns(time.perf_counter() - t0),
            "load_duration": 0, "prompt_eval_count": n}


@router.post("/api/embeddings")
async def embeddings_route(request: Request):
    fe = frontend(request)
    served = await _model(fe, request)
    ids = await fe.parse(request, _embeddings_request, served)
    if ids is None:
        return {"embedding": []}
    vectors, _ = await _embeddings(fe, served, ids, None)
    return {"embedding": vectors[0]}


@router.post("/api/pull")
async def pull(request: Request):
    fe = frontend(request)
    served = await _model(fe, request)
    body = await fe.body(request)
    name = body.get("model") or body.get("name")
    try:
        _resolve(served, name)
    except APIError as e:
        if e.status != 404:
            raise
        raise APIError(404, f"model '{name}' not found: lowbit serves the model it was started with; fetch "
                            "another with `lowbit pull` and restart `lowbit serve` on it") from None
    return {"status": "success"}  # already here, loaded


async def unsupported(request: Request):
    raise bad_request(f"{request.url.path} is not supported: lowbit serves the one model it was started with "
                      "(manage models with `lowbit pull` and `lowbit serve`)")


for _path, _method in (("/api/create", "POST"), ("/api/copy", "POST"), ("/api/delete", "DELETE"),
                       ("/api/push", "POST"), ("/api/blobs/{digest}", "POST"), ("/api/blobs/{digest}", "HEAD")):
    router.add_api_route(_path, unsupported, methods=[_method])


# ---- request: an Ollama body → an OpenAI one the parser reads (on the parse's worker thread) ----------

def _chat_request(parser: RequestParser, served: Served, body: dict) -> tuple[str, bool, Parsed | dict]:
    """An /api/chat body → (the model name answered, stream, the request to run, or the reply itself
    when there is nothing to generate)."""
    name, stream = _generation(served, body)
    messages = body.get("messages") or []
    if not messages:  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return name, stream, {"model": name, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                              "done_reason": "unload" if _keep_alive_zero(body.get("keep_alive")) else "load",
                              "done": True}
    sampling, num_predict = _sampling(body, served.sampling)
    chat_body = {**sampling, "model": served.model_name, "messages": _messages(messages)}
    if body.get("tools"):
        chat_body["tools"] = body["tools"]
    if isinstance(body.get("think"), bool):  # Qwen3's and SmolLM3's templates switch thinking by this
        chat_body["chat_template_kwargs"] = {"enable_thinking": body["think"]}
    elif body.get("think") is not None:  # a level: gpt-oss's template reads it as reasoning_effort
        chat_body["chat_template_kwargs"] = {"reasoning_effort": body["think"]}
    top = _logprobs(body)
    return name, stream, _fit(parser.chat(chat_body), served.max_model_len, num_predict, top)


def _generate_request(parser: RequestParser, served: Served, body: dict) -> tuple[str, bool, Parsed | dict]:
    """An /api/generate body → (the model name answered, stream, the request to run, or the reply
    itself when there is nothing to generate)."""
    name, stream = _generation(served, body)
    raw = _flag(body, "raw", False)
    prompt, system = body.get("prompt"), body.get("system")
    tok = served.tokenizer
    context = _generate_checks(body, tok)
    if not prompt and not body.get("suffix"):  # Ollama's way to load (or, with keep_alive 0, unload) a model
        return name, stream, {"model": name, "created_at": _now(), "response": "", "done": True,
                              "done_reason": "unload" if _keep_alive_zero(body.get("keep_alive")) else "load"}
    sampling, num_predict = _sampling(body, served.sampling)
    if body.get("suffix"):  # fill in the middle (server/fim.py), as Ollama's code models answer it
        parsed = parser.completion({**sampling, "model": served.model_name, "prompt": prompt,
                                    "suffix": body["suffix"]})
    elif raw:  # the prompt as given (no template, no system), after the context's tokens
        ids = context + tok.encode(prompt, add_special=not context)
        parsed = parser.completion({**sampling, "model": served.model_name, "prompt": ids})
    else:
        messages = [{"role": "system", "content": system}] if system else []
        parsed = parser.chat({**sampling, "model": served.model_name,
                              "messages": messages + [{"role": "user", "content": prompt}]})
        if context:
            ids = parsed.prompt_ids
            bos = getattr(tok, "bos_id", None)
            if bos is not None and ids[:1] == [bos]:  # the context already opened the sequence
                ids = ids[1:]
            parsed = replace(parsed, prompt_ids=context + ids)
    return name, stream, _fit(parsed, served.max_model_len, num_predict, _logprobs(body))


def _generate_checks(body: dict, tok) -> list[int]:
    """The fields of /api/generate this server refuses or only types → the context's token ids."""
    for key, value in (("prompt", body.get("prompt")), ("system", body.get("system")),
                       ("suffix", body.get("suffix")), ("template", body.get("template"))):
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{key} must be a string", key)
    if body.get("images"):
        raise bad_request("images: this model reads text only", "images")
    if body.get("template"):
        raise bad_request("template: a per-request template is not supported; the model's own chat template "
                          "is used (or send raw: true with the prompt already formatted)", "template")
    context = body.get("context") or []
    if not (isinstance(context, list) and all(_is_int(t) and 0 <= t < tok.vocab_size for t in context)):
        raise bad_request(f"context must be a list of token ids in [0, {tok.vocab_size})", "context")
    return context


def _generation(served: Served, body: dict) -> tuple[str, bool]:
    """A generating route's first checks → (the model name answered, stream)."""
    name = _resolve(served, body.get("model"))
    stream = _flag(body, "stream", True)
    _check_think(body)
    return name, stream


def _embed_request(served: Served, body: dict) -> tuple[str, list[list[int]], int | None]:
    """An /api/embed body → (the model name answered, each text's token ids, dimensions)."""
    name = _resolve(served, body.get("model"))
    x = body.get("input")
    if x is None or x == "":
        texts = []
    elif isinstance(x, str):
        texts = [x]
    elif isinstance(x, list) and all(isinstance(t, str) for t in x):
        texts = x
    else:
        raise bad_request("input must be a string or a list of strings", "input")
    if not texts:
        return name, [], None
    truncate, dimensions = _flag(body, "truncate", True), body.get("dimensions")
    if dimensions is not None and not (_is_int(dimensions) and dimensions >= 1):
        raise bad_request("dimensions must be a positive integer", "dimensions")
    return name, _token_ids(served, texts, truncate), dimensions


def _embeddings_request(served: Served, body: dict) -> list[list[int]] | None:
    """An /api/embeddings body (the older API) → its prompt's token ids; None: no prompt."""
    _resolve(served, body.get("model"))
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    return _token_ids(served, [prompt], True) if prompt else None


def _token_ids(served: Served, texts: list[str], truncate: bool) -> list[list[int]]:
    """Each text's tokens, at most the context's length (cut when `truncate`, else a 400)."""
    tok, limit = served.tokenizer, served.max_model_len
    ids = []
    for i, t in enumerate(texts):
        x = tok.encode(t)
        if not x:
            raise bad_request(f"input[{i}]: an empty text has no tokens to embed", "input")
        if len(x) > limit:
            if not truncate:
                raise bad_request(f"input[{i}] has {len(x)} tokens, more than the context length {limit}",
                                  "input")
            x = x[:limit]
        ids.append(x)
    return ids


async def _model(fe, request):
    """The model the body names, loaded on demand (Frontend.model); Ollama's words for one it lacks."""
    try:
        return await fe.model(request)
    except ModelNotFound as e:
        raise _not_found(e.name) from None


def _not_found(name) -> APIError:
    return APIError(404, f"model '{name}' not found", "invalid_request_error", "model", "model_not_found")


def _base_name(name: str) -> str:
    return name.removesuffix(":latest")


def _resolve(served, name) -> str:
    """The name a request gave, checked against the served names; `x` and `x:latest` are one model,
    as in Ollama. Replies carry the name as the client gave it, as Ollama's do."""
    if name is None or name == "":
        raise bad_request("model is required", "model")
    if not isinstance(name, str):
        raise bad_request("model must be a string", "model")
    if _base_name(name) not in {_base_name(n) for n in (served.model_name, *served.aliases)}:
        raise _not_found(name)
    return name


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _options(options, model: dict) -> tuple[dict, int | None]:
    """`options` → (the sampling fields of a chat-completions body, num_predict or None: no limit). Unset
    fields take the model's own defaults (`model`, as Ollama's Modelfile PARAMETERs carry a model's card),
    else Ollama's."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad_request("options must be an object", "options")
    out = {**DEFAULTS, **model}
    for key, value in options.items():
        if value is None:
            continue
        if key in _OPTIONS:
            out[_OPTIONS[key]] = value
        elif key != "num_predict":
            log.debug("ollama option %s has no effect here", key)
    if _is_int(out.get("seed")) and out["seed"] < 0:  # Ollama's -1: a random seed
        del out["seed"]
    if _is_int(out.get("top_k")) and out["top_k"] < 0:  # Ollama: top_k <= 0 is off
        out["top_k"] = 0
    n = options.get("num_predict")
    if n is not None and not _is_int(n):
        raise bad_request(f"num_predict must be an integer, got {n!r}", "num_predict")
    return out, n if n is not None and n > 0 else None  # Ollama: -1 (and 0) is no limit


def _response_format(fmt) -> dict | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f'invalid format: expected "json" or a JSON schema object, got {json.dumps(fmt)}', "format")


def _logprobs(body: dict) -> int | None:
    """Top alternatives per token when `logprobs` is set (0: the chosen token's alone), else None."""
    if not _flag(body, "logprobs", False):
        return None
    top = body.get("top_logprobs", 0)
    if not (_is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
    return top


def _check_think(body: dict) -> None:
    think = body.get("think")
    if think is not None and not isinstance(think, bool) and think not in _THINK_LEVELS:
        raise bad_request(f"think must be a boolean or one of {', '.join(_THINK_LEVELS)}", "think")


def _messages(messages) -> list[dict]:
    """Ollama messages → OpenAI ones: tool calls' arguments (objects) as JSON strings, `tool_name`
    as the tool message's name, `thinking` as the assistant's reasoning."""
    if not isinstance(messages, list):
        raise bad_request("messages must be a list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        if m.get("images"):
            raise bad_request(f"messages[{i}].images: this model reads text only", "messages")
        role = m.get("role")
        msg = {"role": role.lower() if isinstance(role, str) else role, "content": m.get("content")}
        if m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise bad_request(f"messages[{i}].tool_calls[{j}] must have a function", "messages")
                args = fn.get("arguments") or {}
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                msg["tool_calls"].append({"id": c.get("id") or f"call_{i}_{j}", "type": "function",
                                          "function": {"name": fn.get("name"), "arguments": args}})
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        if m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _sampling(body: dict, model: dict) -> tuple[dict, int | None]:
    """The fields of a chat-completions (or completions) body that an Ollama request's `options`
    and `format` make, over the model's own defaults (`model`) → (them, num_predict)."""
    sampling, num_predict = _options(body.get("options"), model)
    fmt = _response_format(body.get("format"))
    if fmt is not None:
        sampling["response_format"] = fmt
    return sampling, num_predict


def _fit(parsed: Parsed, max_model_len: int, num_predict: int | None, top_logprobs: int | None) -> Parsed:
    """Bound the reply by num_predict and by the context's room, and ask for the logprobs."""
    n = len(parsed.prompt_ids)
    room = max_model_len - n
    if room <= 0:
        raise context_exceeded(max_model_len, n, "prompt")
    limit = room if num_predict is None else min(num_predict, room)
    params = [replace(p, max_tokens=limit, logprobs=top_logprobs) for p in parsed.params]
    return replace(parsed, params=params, logprobs=top_logprobs is not None)


def _keep_alive_zero(v) -> bool:
    return v in (0, 0.0, "0", "0s", "0m", "0h")


# ---- reply: the engine's deltas → Ollama's pieces ---------------------------------------------------

def _arguments(text: str) -> dict:
    """A call's arguments as the object Ollama sends (a non-object value kept under "value")."""
    try:
        v = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"value": text}
    return v if isinstance(v, dict) else {"value": v}


@dataclass
class _Step:
    """What one engine delta added to the reply."""

    content: str = ""
    thinking: str = ""
    calls: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.calls or self.logprobs)


class _Generation:
    """One request's generation: its steps as they come, then the final counts and timings."""

    def __init__(self, fe: Frontend, served: Served, parsed: Parsed, t0: float):
        self.fe, self.served, self.parsed, self.t0 = fe, served, parsed, t0
        self.finish, self.usage, self.token_ids, self.n_calls = "stop", None, [], 0

    async def open(self) -> None:
        """Open the engine's stream; a refusal raises here, before any byte is sent."""
        self.t_start = time.perf_counter()
        self.events = await self.fe.start(self.served, self.parsed, f"ollama-{uuid.uuid4().hex}")
        self.t_prompt = time.perf_counter()  # start returns once the first delta (the prefill) is in
        self.t_end = self.t_prompt

    async def close(self) -> None:
        """Close the engine's stream: a reply still running is aborted and its pages freed."""
        await self.events.aclose()

    async def steps(self) -> AsyncIterator[_Step]:
        responder = self.served.responder
        try:
            async for _, pieces, d in replies(self.parsed, self.events):
                step = _Step()
                for kind, value in pieces:
                    if kind == "content":
                        step.content += value
                    elif kind == "reasoning":
                        step.thinking += value
                    else:
                        step.calls.append({"id": call_id(), "function": {"index": self.n_calls, "name": value[0],
                                                                         "arguments": _arguments(value[1])}})
                        self.n_calls += 1
                if self.parsed.logprobs and d.token_ids:
                    step.logprobs = responder.chat_logprobs(d)
                self.token_ids += d.token_ids
                if d.finish_reason is not None:
                    self.finish, self.usage = responder.finish_of(d), d.usage  # an engine failure raises
                    self.t_end = time.perf_counter()
                yield step
        finally:
            await self.close()

    def stats(self) -> dict:
        u = self.usage
        return {"done_reason": self.finish, "total_duration": _ns(self.t_end - self.t0), "load_duration": 0,
                "prompt_eval_count": u.prompt_tokens if u else len(self.parsed.prompt_ids),
                "prompt_eval_duration": _ns(self.t_prompt - self.t_start),
                "eval_count": u.completion_tokens if u else 0, "eval_duration": _ns(self.t_end - self.t_prompt)}


async def _run(gen: _Generation, stream: bool, frame, final):
    """Stream or fold a generation. frame(step, done) → the object for one step (done: the folded
    whole); final() → the fields of the last object."""
    await gen.open()
    if not stream:
        whole = _Step()
        try:
            async for s in gen.steps():
                whole.content += s.content
                whole.thinking += s.thinking
                whole.calls += s.calls
                whole.logprobs += s.logprobs
        except APIError as e:
            return _ollama_error(e)
        finally:
            await gen.close()
        return JSONResponse({**frame(whole, True), **final()})

    return sse_response(_lines(gen, frame, final), "application/x-ndjson")


async def _lines(gen: _Generation, frame, final) -> AsyncIterator[bytes]:
    """A streamed generation: one NDJSON object a step, then the last, `done`, with the counts."""
    try:
        async for s in gen.steps():
            if s:
                yield _line(frame(s, False))
        yield _line({**frame(_Step(), True), **final()})
    except APIError as e:  # the engine failed after the reply began: an error line, then close
        yield _line({"error": e.message})
    finally:
        await gen.close()


async def _embeddings(fe: Frontend, served: Served, ids: list[list[int]], dimensions: int | None):
    """The texts' unit vectors (cut to their first `dimensions` and renormalized, as Ollama does,
    when that is fewer than the model's) and the tokens they took."""
    vectors = await fe.one_pass(served, "embeddings", "input", lambda m: embed(m, ids, served.pooling))
    if dimensions is not None and dimensions < vectors.shape[1]:
        cut = vectors[:, :dimensions].double()
        vectors = (cut / cut.norm(dim=-1, keepdim=True).clamp_min(1e-12)).float()
    return vectors.cpu().tolist(), sum(map(len, ids))


def _chat_frame(name: str, s: _Step, done: bool) -> dict:
    msg = {"role": "assistant", "content": s.content}
    if s.thinking:
        msg["thinking"] = s.thinking
    if s.calls:
        msg["tool_calls"] = s.calls
    out = {"model": name, "created_at": _now(), "message": msg, "done": done}
    if s.logprobs:
        out["logprobs"] = s.logprobs
    return out


def _generate_frame(name: str, s: _Step, done: bool) -> dict:
    out = {"model": name, "created_at": _now(), "response": s.content, "done": done}
    if s.thinking:
        out["thinking"] = s.thinking
    if s.logprobs:
        out["logprobs"] = s.logprobs
    return out


def _generate_final(gen: _Generation) -> dict:
    return {**gen.stats(), "context": gen.parsed.prompt_ids + gen.token_ids}
