"""The OpenAPI schema of the routes lowbit serves (GET /openapi.json).

The routes read raw bodies (`request: Request`) so that request.py can answer OpenAI-shaped 400s,
so FastAPI generates no request bodies. This adds, per POST route, a permissive JSON body (known
fields typed as OpenAI/Ollama type them, anything else allowed) and the responses the route gives,
so that schema-driven fuzzers (tests/test_schemathesis.py) can exercise the server and check its
replies. A JSON 200 is described by `_OK` (the path's reply, not streamed): its required fields and
the type of every field declared, extra fields allowed (clients ignore them), as OpenAI's and
Ollama's docs shape them. Streams (text/event-stream, application/x-ndjson), text replies (/,
/metrics) and the routes that only refuse (stored responses, model management) have no schema."""

from __future__ import annotations

from fastapi import FastAPI

_STR_OR_LIST = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_MESSAGES = {"type": "array", "items": {"type": "object", "additionalProperties": True, "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}}
_SAMPLING = {"model": {"type": "string"}, "stream": {"type": "boolean"}, "max_tokens": {"type": "integer", "minimum": 1},
             "temperature": {"type": "number"}, "top_p": {"type": "number"}, "n": {"type": "integer"},
             "stop": _STR_OR_LIST, "logprobs": {"type": "boolean"}, "seed": {"type": "integer"}}
_BODIES = {
    "/v1/chat/completions": {"messages": _MESSAGES, "top_logprobs": {"type": "integer"}, **_SAMPLING},
    "/v1/completions": {"prompt": _STR_OR_LIST, "echo": {"type": "boolean"}, **_SAMPLING,
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
    "/infill": {"input_prefix": {"type": "string"}, "input_suffix": {"type": "string"}, "prompt": {"type": "string"},
                "n_predict": {"type": "integer"}, "temperature": {"type": "number"}, "stream": {"type": "boolean"}},
    **{path: {"model": {"type": "string"}, "query": {"type": "string"},
              "documents": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "object"}]}},
              "top_n": {"type": "integer", "minimum": 1}, "return_documents": {"type": "boolean"}}
       for path in ("/v1/rerank", "/rerank")},
}
_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_STREAMS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/infill"}


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
}


def install_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for path, ops in schema.get("paths", {}).items():
            error = _OLLAMA_ERROR if path.startswith("/api/") else _OPENAI_ERROR
            for method, op in ops.items():
                if method == "post":
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                        "type": "object", "additionalProperties": True, "properties": _BODIES.get(path, {})}}}}
                ok = {"application/json": {"schema": _OK.get(path, {})}}
                if path in _STREAMS or path in ("/api/chat", "/api/generate"):
                    ok["text/event-stream" if path in _STREAMS else "application/x-ndjson"] = {"schema": {}}
                op["responses"] = {"200": {"description": "OK", "content": ok},
                                   "4XX": {"description": "Refused",
                                           "content": {"application/json": {"schema": error}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
