"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure the
server reports, FastAPI's own validation and HTTP errors included (never its bare `{"detail": ...}`).

A client's mistake is always a 4xx: the official client retries 5xx responses twice, so a bad
request answered with a 500 would be sent three times.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def context_exceeded(max_model_len: int, prompt_len: int, param: str, max_tokens: int | None = None,
                     max_key: str = "max_tokens", at_least: bool = False) -> APIError:
    """OpenAI's 400 for a prompt (plus max_tokens) over the context; at_least: prompt_len is a lower bound,
    told from the text's length without encoding it (runtime/load/tokenizer.py PromptTooLong)."""
    if max_tokens is None:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
               f"{'at least ' if at_least else ''}{prompt_len} tokens, leaving no room for the completion. "
               f"Please shorten the prompt.")
    else:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
               f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
               f"Please reduce the prompt or {max_key}.")
    return bad_request(msg, param, "context_length_exceeded")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return APIError(e.status_code, str(e.detail), kind).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return bad_request(str(e.errors()[:1])).response()


def shaped_route(shape) -> type[APIRoute]:
    """A route class answering every APIError as `shape(error)` → Response, for a dialect whose errors are
    not OpenAI's (Ollama's {"error": "..."}, Anthropic's): the key's 401, a router dependency run inside
    the handler, included."""

    class ShapedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except APIError as e:
                    return shape(e)

            return answer

    return ShapedRoute
