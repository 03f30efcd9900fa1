"""The OpenAPI schema of the routes lowbit serves (GET /openapi.json).

The routes read raw bodies (`request: Request`) so that request.py can answer OpenAI-shaped 400s,
so FastAPI generates no request bodies. This adds, per POST route, a permissive JSON body (known
fields typed as each dialect types them, anything else allowed; `_RULES`: what a body must hold for
the route to do more than refuse it; `model`: one of the names served) and the responses the route
gives, so that schema-driven fuzzers (tests/test_schemathesis.py) can exercise the server and check its
replies. A JSON 200 is described by `_OK` (the path's reply, not streamed): its required fields and
the type of every field declared, extra fields allowed (clients ignore them), as OpenAI's, Ollama's,
Anthropic's and llama-server's docs shape them. A stream's events are described by `_EVENTS` where
the dialect documents them (Anthropic's Messages stream, llama-server's /infill; an event's `data`
is checked as JSON through `contentSchema`, as Open API 3.1 describes an SSE event); the others
(OpenAI's, which end in a non-JSON `[DONE]`, and Ollama's NDJSON), text replies (/, /metrics) and
the routes that only refuse (stored responses, Ollama's model management) have no schema. Errors are
each dialect's own: Ollama's `{"error": "..."}` under /api/, Anthropic's
`{"type": "error", "error": {...}}` under /v1/messages, OpenAI's elsewhere."""

from __future__ import annotations

from fastapi import FastAPI

_STR_OR_LIST = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {  # the models read text only
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_TURN = {"type": "object", "additionalProperties": True, "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}
_MESSAGES = {"type": "array", "items": _TURN}
_SAMPLING = {"model": {"type": "string"}, "stream": {"type": "boolean"},
             "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0},
             "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
             "n": {"type": "integer", "minimum": 1, "maximum": 128}, "stop": _STR_OR_LIST,
             "logprobs": {"type": "boolean"}, "seed": {"type": "integer"}}
_BODIES = {
    "/v1/chat/completions": {"messages": {**_MESSAGES, "minItems": 1}, "top_logprobs": {
                                 "type": "integer", "minimum": 0, "maximum": 20}, **_SAMPLING},
    # a text, or one list of token ids (a list of texts, a batch, is not taken)
    "/v1/completions": {"prompt": {"anyOf": [{"type": "string", "minLength": 1}, {
                            "type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
                        "echo": {"type": "boolean"}, **_SAMPLING,
                        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5}},  # the legacy API's count
    "/v1/embeddings": {"model": {"type": "string"}, "input": _STR_OR_LIST,
                       "encoding_format": {"type": "string", "enum": ["float", "base64"]}},
    "/tokenize": {"model": {"type": "string"}, "prompt": {"type": "string"}, "messages": _MESSAGES},
    "/detokenize": {"model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer"}}},
    "/v1/responses": {"model": {"type": "string"}, "input": {"anyOf": [{"type": "string"}, {"type": "array"}]},
                      "stream": {"type": "boolean"}, "max_output_tokens": {"type": "integer", "minimum": 1},
                      "user": {"type": "string"}, "metadata": {
                          "type": "object", "maxProperties": 16, "propertyNames": {"maxLength": 64},
                          "additionalProperties": {"type": "string", "maxLength": 512}}},
    "/api/chat": {"model": {"type": "string"}, "messages": _MESSAGES, "stream": {"type": "boolean"}},
    "/api/generate": {"model": {"type": "string"}, "prompt": {"type": "string"}, "stream": {"type": "boolean"}},
    "/api/show": {"model": {"type": "string"}}, "/api/embed": {"model": {"type": "string"}, "input": _STR_OR_LIST},
    "/api/embeddings": {"model": {"type": "string"}, "prompt": {"type": "string"}},
    "/api/pull": {"model": {"type": "string"}, "name": {"type": "string"}, "stream": {"type": "boolean"},
                  "insecure": {"type": "boolean"}},
    "/infill": {"input_prefix": {"type": "string"}, "input_suffix": {"type": "string"}, "prompt": {"type": "string"},
                "input_extra": {"type": "array", "items": {"type": "object", "properties": {
                    "filename": {"type": "string"}, "text": {"type": "string"}}}},
                "n_predict": {"type": "integer"}, "temperature": {"type": "number"}, "stream": {"type": "boolean"}},
    # llama-server's router mode
    **{path: {"model": {"type": "string"}} for path in ("/models/load", "/models/unload")},
    **{path: {"model": {"type": "string"}, "query": {"type": "string", "minLength": 1}, "documents": {
              "type": "array", "minItems": 1, "items": {"anyOf": [{"type": "string", "minLength": 1}, {
                  "type": "object", "required": ["text"],
                  "properties": {"text": {"type": "string", "minLength": 1}}}]}},
              "top_n": {"type": "integer", "minimum": 1}, "return_documents": {"type": "boolean"}}
       for path in ("/v1/rerank", "/rerank")},
}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_STREAMS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/infill", "/v1/messages"}


# ---- the replies (200, application/json, not streamed) ----------------------------------------------
def _obj(required: str = "", **properties) -> dict:
    """An object of these typed properties, those named in `required` (space-separated) required."""
    return {"type": "object", "required": required.split(), "properties": properties}


def _list(items: dict, **more) -> dict:
    return {"type": "array", "items": items, **more}


def _t(*types: str, **more) -> dict:
    return {"type": list(types) if len(types) > 1 else types[0], **more}


def _enum(*values: str) -> dict:
    return _t("string", enum=list(values))


_S, _I, _N, _B, _OBJ = _t("string"), _t("integer"), _t("number"), _t("boolean"), _t("object")
_COUNT = _t("integer", minimum=0)
_TOKEN_LP = _obj("token logprob bytes", token=_S, logprob=_N, bytes=_t("array", "null", items=_I))
_LOGPROB = _obj("token logprob bytes top_logprobs", **_TOKEN_LP["properties"], top_logprobs=_list(_TOKEN_LP))
_USAGE = _obj("prompt_tokens completion_tokens total_tokens", prompt_tokens=_COUNT, completion_tokens=_COUNT,
              total_tokens=_COUNT, prompt_tokens_details=_obj("", cached_tokens=_COUNT))
_CALL = _obj("id type function", id=_S, type=_enum("function"), function=_obj("name arguments", name=_S, arguments=_S))
_CHAT_CHOICE = _obj("index message logprobs finish_reason", index=_COUNT, message=_obj(
    "role content", role=_enum("assistant"), content=_t("string", "null"), refusal=_t("string", "null"),
    tool_calls=_list(_CALL), reasoning_content=_S, reasoning=_S),
    logprobs={**_obj("content", content=_t("array", "null", items=_LOGPROB)), "type": ["object", "null"]},
    finish_reason=_enum("stop", "length", "tool_calls", "content_filter", "function_call"))
_TEXT_CHOICE = _obj("index text logprobs finish_reason", index=_COUNT, text=_S, logprobs={**_obj(
    "tokens token_logprobs top_logprobs text_offset", tokens=_list(_S), token_logprobs=_list(_t("number", "null")),
    top_logprobs=_list(_t("object", "null")), text_offset=_list(_COUNT)), "type": ["object", "null"]},
    finish_reason=_enum("stop", "length", "content_filter"))


def _completion(kind: str, choice: dict) -> dict:
    return _obj("id object created model choices usage", id=_S, object=_enum(kind), created=_I, model=_S,
                system_fingerprint=_t("string", "null"), choices=_list(choice, minItems=1), usage=_USAGE)


_MODEL = _obj("id object created owned_by", id=_S, object=_enum("model"), created=_I, owned_by=_S, root=_S,
              max_model_len=_I, lowbit=_OBJ)
_STATUS = _enum("in_progress", "completed", "incomplete")
_ITEM = {"oneOf": [  # a Response's output items: a message, a reasoning item, a function call
    _obj("type id role status content", type=_enum("message"), id=_S, role=_enum("assistant"), status=_STATUS,
         content=_list(_obj("type text annotations", type=_enum("output_text"), text=_S, annotations=_list(_OBJ),
                            logprobs=_list(_LOGPROB)))),
    _obj("type id summary", type=_enum("reasoning"), id=_S, summary=_list(_OBJ), status=_STATUS,
         content=_list(_obj("type text", type=_enum("reasoning_text"), text=_S))),
    _obj("type call_id name arguments", type=_enum("function_call"), id=_S, call_id=_S, name=_S, arguments=_S,
         status=_STATUS)]}
_RESPONSE_USAGE = _obj("input_tokens input_tokens_details output_tokens output_tokens_details total_tokens",
                       input_tokens=_COUNT, input_tokens_details=_obj("cached_tokens", cached_tokens=_COUNT),
                       output_tokens=_COUNT, output_tokens_details=_obj("reasoning_tokens", reasoning_tokens=_COUNT),
                       total_tokens=_COUNT)
_RESPONSE = _obj(
    "id object created_at status model output usage", id=_S, object=_enum("response"), created_at=_I,
    status=_enum("completed", "failed", "in_progress", "cancelled", "queued", "incomplete"),
    completed_at=_t("integer", "null"), error=_t("object", "null"), incomplete_details=_t("object", "null"),
    model=_S, output=_list(_ITEM), instructions=_t("string", "null"), max_output_tokens=_t("integer", "null"),
    metadata=_OBJ, parallel_tool_calls=_B, previous_response_id=_t("string", "null"), reasoning=_t("object", "null"),
    store=_B, background=_B, temperature=_t("number", "null"), top_p=_t("number", "null"),
    text=_obj("format", format=_OBJ), tool_choice=_t("string", "object"), tools=_list(_OBJ),
    top_logprobs=_t("integer", "null"), truncation=_enum("auto", "disabled"), user=_t("string", "null"),
    service_tier=_t("string", "null"), usage=_RESPONSE_USAGE)
# Ollama's
_DETAILS = _obj("parent_model format family families parameter_size quantization_level", parent_model=_S,
                format=_S, family=_S, families=_list(_S), parameter_size=_S, quantization_level=_S)
_ENTRY = dict(name=_S, model=_S, modified_at=_S, size=_COUNT, digest=_S, details=_DETAILS)
_STATS = dict(total_duration=_COUNT, load_duration=_COUNT, prompt_eval_count=_COUNT, prompt_eval_duration=_COUNT,
              eval_count=_COUNT, eval_duration=_COUNT)


def _done(required: str, *final: str, **properties) -> dict:
    """A generation's one reply: done, with its counts and timings (and `final`), unless it only
    (un)loaded the model."""
    loaded = {"properties": {"done_reason": {"enum": ["load", "unload"]}}}
    return {**_obj("model created_at done done_reason " + required, model=_S, created_at=_S,
                   done=_t("boolean", const=True), done_reason=_enum("stop", "length", "load", "unload"),
                   logprobs=_list(_LOGPROB), **_STATS, **properties),
            "anyOf": [loaded, {"required": [*_STATS, *final]}]}


# llama-server's /completion object, /infill's reply and each of its stream's events (the last: stop true)
_INFILL = {**_obj("content stop model tokens_predicted tokens_evaluated", content=_S, stop=_B, model=_S,
                  tokens_predicted=_COUNT, tokens_evaluated=_COUNT, stop_type=_enum("none", "eos", "limit", "word")),
           "if": {"properties": {"stop": {"const": True}}}, "then": {"required": ["stop_type"]}}

# ---- Anthropic's Messages API (docs.anthropic.com/en/api/messages; the SDK's anthropic.types) -------
_A_TEXT = _obj("type text", type=_enum("text"), text=_S, cache_control=_OBJ)
_A_TEXTS = {"anyOf": [_S, _list(_A_TEXT)]}
_A_TOOL_USE = _obj("type id name input", type=_enum("tool_use"), id=_S, name=_S, input=_OBJ)
_A_THINKING = _obj("type thinking signature", type=_enum("thinking"), thinking=_S, signature=_S)
_A_BLOCKS = {  # what each role's turn may hold here (images, documents: a 400, the models read text)
    "user": [_A_TEXT, _obj("type tool_use_id", type=_enum("tool_result"), tool_use_id=_S, content=_A_TEXTS,
                           is_error=_B, cache_control=_OBJ)],
    "assistant": [_A_TEXT, _A_TOOL_USE, _A_THINKING, _obj("type data", type=_enum("redacted_thinking"), data=_S)],
    "system": [_A_TEXT]}  # the mid-conversation-system beta's (Claude Code's)
_A_COMMON = {  # count_tokens' body; /v1/messages' adds max_tokens
    "model": _S, "messages": _list({"anyOf": [_obj("role content", role=_enum(role), content={
        "anyOf": [_S, _list({"anyOf": blocks})]}) for role, blocks in _A_BLOCKS.items()]}, minItems=1),
    "system": _A_TEXTS, "stop_sequences": _list(_S), "stream": _B,
    "temperature": _t("number", minimum=0, maximum=1), "top_p": _t("number", exclusiveMinimum=0, maximum=1),
    "top_k": _t("integer", minimum=0), "metadata": _obj("", user_id=_t("string", "null")),
    "service_tier": _enum("auto", "standard_only"), "output_config": _OBJ,
    "tools": _list(_obj("name input_schema", type=_enum("custom"), description=_S, input_schema=_OBJ,
                        name=_t("string", pattern=r"^[A-Za-z0-9_.\-]{1,64}$"), cache_control=_OBJ)),
    "tool_choice": _obj("type", type=_enum("auto", "any", "tool", "none"), name=_S, disable_parallel_tool_use=_B),
    # lowbit takes any budget >= 0 (Anthropic's floor of 1,024 is its models')
    "thinking": _obj("type", type=_enum("enabled", "adaptive", "disabled"), budget_tokens=_COUNT)}
_ANTHROPIC_BODIES = {"/v1/messages": {**_A_COMMON, "max_tokens": _t("integer", minimum=1)},
                     "/v1/messages/count_tokens": _A_COMMON}
_A_NEEDS_TOOLS = {  # a choice of "any" tool, or of one, is a 400 without tools
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"required": ["type"], "properties": {
        "type": {"enum": ["any", "tool"]}}}}},
    "then": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}}
_RULES = {  # path → what its body must hold besides its fields' types: without it the route can only refuse
    "/v1/messages": {"required": ["messages", "max_tokens"], **_A_NEEDS_TOOLS},
    "/v1/messages/count_tokens": {"required": ["messages"], **_A_NEEDS_TOOLS},
    **{path: {"required": ["query", "documents"]} for path in ("/v1/rerank", "/rerank")},
    "/v1/chat/completions": {"required": ["messages"]}, "/v1/completions": {"required": ["prompt"]}}
_A_BLOCK = {"oneOf": [_obj("type text", type=_enum("text"), text=_S, citations=_t("array", "null")),
                      _A_THINKING, _A_TOOL_USE]}
_A_NULLABLE_COUNT = _t("integer", "null", minimum=0)
_A_USAGE = _obj("input_tokens output_tokens", input_tokens=_COUNT, output_tokens=_COUNT,
                cache_creation_input_tokens=_A_NULLABLE_COUNT, cache_read_input_tokens=_A_NULLABLE_COUNT,
                service_tier=_t("string", "null"))
_A_STOP = ("end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal",
           "model_context_window_exceeded")
# stop_sequence is the string that stopped the reply exactly when stop_reason says one did
_A_STOPPED = {"anyOf": [{"properties": {"stop_reason": {"const": "stop_sequence"}, "stop_sequence": _S}},
                        {"properties": {"stop_reason": {"not": {"const": "stop_sequence"}}, "stop_sequence": {
                            "type": "null"}}}]}


def _message(stop_reason: dict) -> dict:
    return {**_obj("id type role content model stop_reason stop_sequence usage", id=_S, type=_enum("message"),
                   role=_enum("assistant"), content=_list(_A_BLOCK), model=_S, stop_reason=stop_reason,
                   stop_sequence=_t("string", "null"), usage=_A_USAGE), **_A_STOPPED}


_MESSAGE = _message(_enum(*_A_STOP))  # "always non-null" once the reply is whole, as the docs say
_A_ERROR_TYPES = ("invalid_request_error", "authentication_error", "billing_error", "permission_error",
                  "not_found_error", "request_too_large", "rate_limit_error", "api_error", "timeout_error",
                  "overloaded_error")
_ANTHROPIC_ERROR = _obj("type error", type=_enum("error"),
                        error=_obj("type message", type=_enum(*_A_ERROR_TYPES), message=_S))


def _sse(events: dict[str, dict]) -> dict:
    """One SSE event of a stream whose events are named by their data's `type`: the name and its JSON."""
    return {"oneOf": [_obj("event data", event={"const": name}, data={
        "type": "string", "contentMediaType": "application/json", "contentSchema": data})
        for name, data in events.items()]}


def _a_event(kind: str, required: str = "", **properties) -> dict:
    return _obj(("type " + required).strip(), type=_enum(kind), **properties)


_A_STREAM = _sse({  # the Messages stream's events, as its docs list them
    "message_start": _a_event("message_start", "message",
                              message=_message(_t("string", "null", enum=[*_A_STOP, None]))),
    "content_block_start": _a_event("content_block_start", "index content_block", index=_COUNT, content_block=_A_BLOCK),
    "content_block_delta": _a_event("content_block_delta", "index delta", index=_COUNT, delta={"oneOf": [
        _obj("type text", type=_enum("text_delta"), text=_S),
        _obj("type thinking", type=_enum("thinking_delta"), thinking=_S),
        _obj("type signature", type=_enum("signature_delta"), signature=_S),
        _obj("type partial_json", type=_enum("input_json_delta"), partial_json=_S)]}),
    "content_block_stop": _a_event("content_block_stop", "index", index=_COUNT),
    "message_delta": _a_event("message_delta", "delta usage", delta={**_obj(
        "stop_reason stop_sequence", stop_reason=_enum(*_A_STOP), stop_sequence=_t("string", "null")), **_A_STOPPED},
        usage=_obj("output_tokens", output_tokens=_COUNT, input_tokens=_A_NULLABLE_COUNT,
                   cache_creation_input_tokens=_A_NULLABLE_COUNT, cache_read_input_tokens=_A_NULLABLE_COUNT)),
    "message_stop": _a_event("message_stop"),
    "ping": _a_event("ping"),
    "error": _ANTHROPIC_ERROR})
_EVENTS = {"/v1/messages": _A_STREAM,  # path → one event of its text/event-stream reply
           "/infill": _obj("event data", event={"const": "message"}, data={
               "type": "string", "contentMediaType": "application/json", "contentSchema": _INFILL})}

_OK = {  # path → its 200 reply
    "/health": _obj("status", status=_enum("ok")),
    "/v1/models": _obj("object data", object=_enum("list"), data=_list(_MODEL)),
    "/v1/models/{model_id}": _MODEL,
    "/v1/chat/completions": _completion("chat.completion", _CHAT_CHOICE),
    "/v1/completions": _completion("text_completion", _TEXT_CHOICE),
    "/v1/embeddings": _obj("object data model usage", object=_enum("list"), model=_S, data=_list(_obj(
        "object index embedding", object=_enum("embedding"), index=_COUNT, embedding=_t("array", "string", items=_N))),
        usage=_obj("prompt_tokens total_tokens", prompt_tokens=_COUNT, total_tokens=_COUNT)),  # base64: a string
    "/tokenize": _obj("tokens count max_model_len", tokens=_list(_I), count=_COUNT, max_model_len=_I),
    "/detokenize": _obj("prompt content", prompt=_S, content=_S),
    "/v1/responses": _RESPONSE,
    "/api/version": _obj("version", version=_S, lowbit=_S),
    "/api/tags": _obj("models", models=_list(_obj(" ".join(_ENTRY), **_ENTRY))),
    "/api/ps": _obj("models", models=_list(_obj(" ".join(_ENTRY) + " expires_at size_vram", **_ENTRY, expires_at=_S,
                                                size_vram=_COUNT, context_length=_I))),
    "/api/show": _obj("modelfile parameters template details model_info capabilities modified_at", modelfile=_S,
                      parameters=_S, template=_S, details=_DETAILS, model_info=_OBJ, capabilities=_list(_S),
                      modified_at=_S, license=_S),
    "/api/chat": _done("message", message=_obj(
        "role content", role=_enum("assistant"), content=_S, thinking=_S, tool_calls=_list(_obj(
            "function", id=_S, function=_obj("name arguments", index=_I, name=_S, arguments=_OBJ))))),
    "/api/generate": _done("response", "context", response=_S, thinking=_S, context=_list(_I)),
    "/api/embed": _obj("model embeddings", model=_S, embeddings=_list(_list(_N)), total_duration=_COUNT,
                       load_duration=_COUNT, prompt_eval_count=_COUNT),
    "/api/embeddings": _obj("embedding", embedding=_list(_N)),
    "/api/pull": _obj("status", status=_enum("success")),
    "/version": _obj("version python torch", version=_S, python=_S, torch=_S, cuda=_t("string", "null")),
    **{path: _obj("object model results usage", object=_enum("list"), model=_S, results=_list(_obj(
        "index relevance_score", index=_COUNT, relevance_score=_N, document=_obj("text", text=_S))),
        usage=_obj("prompt_tokens total_tokens", prompt_tokens=_COUNT, total_tokens=_COUNT))
       for path in ("/v1/rerank", "/rerank")},
    "/infill": _INFILL,
    **{path: _obj("success model", success=_B, model=_S) for path in ("/models/load", "/models/unload")},
    "/v1/messages": _MESSAGE,
    "/v1/messages/count_tokens": _obj("input_tokens", input_tokens=_COUNT),
}


def install_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        # a body's `model` is one of the names this server offers (any other is a 404): so described, a
        # client (or a fuzzer) can name a model that runs; while the server starts it is any string
        pool = app.state.lowbit.pool
        model = {"type": "string", "enum": pool.names()} if pool is not None else {"type": "string"}
        for path, ops in schema.get("paths", {}).items():
            error = (_OLLAMA_ERROR if path.startswith("/api/") else
                     _ANTHROPIC_ERROR if path.startswith("/v1/messages") else _OPENAI_ERROR)
            for method, op in ops.items():
                if method == "post":
                    properties = _BODIES.get(path) or _ANTHROPIC_BODIES.get(path, {})
                    if "model" in properties:
                        properties = {**properties, "model": model}
                    body = {"type": "object", "additionalProperties": True, "properties": properties,
                            **_RULES.get(path, {})}
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
                ok = {"application/json": {"schema": _OK.get(path, {})}}
                if path in _STREAMS or path in ("/api/chat", "/api/generate"):
                    ok["text/event-stream" if path in _STREAMS else "application/x-ndjson"] = {
                        "schema": _EVENTS.get(path, {})}
                op["responses"] = {"200": {"description": "OK", "content": ok},
                                   "4XX": {"description": "Refused",
                                           "content": {"application/json": {"schema": error}}}}
        if pool is not None:  # kept once the names are known: the models offered never change
            app.openapi_schema = schema
        return schema

    app.openapi = openapi
