"""What every request passes before a route sees it: the Host it names, the page it comes from, the
type and the size of its body. An ASGI middleware, so a refused body is never read whole.

- Host: a server bound to loopback answers only Host names of this machine (localhost, *.localhost,
  loopback addresses, the bound address) or `--allowed-hosts`. A web page that points its own DNS
  name at 127.0.0.1 (DNS rebinding) sends its own name and gets a 403. Bound beyond loopback, any
  Host is taken unless `--allowed-hosts` narrows it.
- Origin: a browser names the page's origin on every cross-site POST. One the CORS policy does not
  allow gets a 403: CORS alone only hides the answer from the page, the request would still run.
- Content-Type: a POST body must be JSON. text/plain, form and multipart bodies are the "simple
  requests" a page may send cross-site with no preflight; they get a 415.
- Size: a body over `max_body` bytes gets a 413 as soon as its Content-Length says so or its
  chunks add up past it, before it is parsed (a 40 MB prompt would otherwise be held, parsed and
  tokenized whole).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from typing import Callable

from lowbit.runtime.server.errors import APIError

DEFAULT_MAX_BODY = 8 * 2**20  # 8 MiB: a 128k-token prompt is ~0.5 MB of text; room for long histories


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _TooLarge(Exception):
    pass


class Guard:
    def __init__(self, app, bind_host: str | None, allowed_hosts: list[str] | None, max_body: int,
                 origin_allowed: Callable[[str], bool], shapes: tuple = ()):
        """bind_host: the address the server listens on (None: in-process, checks Host as loopback);
        allowed_hosts: more Host names to answer (["*"]: any); shapes: (path prefix, APIError → body) for the
        dialects whose clients parse errors of their own shape (Anthropic's, Ollama's); others get OpenAI's."""
        self.app, self.max_body, self.origin_allowed, self.shapes = app, max_body, origin_allowed, shapes
        self.extra = {h.lower() for h in (allowed_hosts or [])}
        bound = bind_host or "127.0.0.1"
        # beyond loopback: clients reach us by names we cannot know (LAN names, addresses)
        self.any_host = "*" in self.extra or (not is_loopback(bound) and not allowed_hosts)
        self.names = {bound.strip("[]").lower(), socket.gethostname().lower()} | self.extra

    def host_ok(self, host: str) -> bool:
        if self.any_host or not host:  # HTTP/1.0 clients may send no Host
            return True
        name = host.rsplit(":", 1)[0] if not host.endswith("]") and host.count(":") == 1 else host
        name = name.strip("[]").lower()
        return name in self.names or is_loopback(name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.check(scope["method"], headers)
        shape = next((fn for prefix, fn in self.shapes if scope["path"].startswith(prefix)), APIError.body)
        if refusal is not None:
            return await self.refuse(send, refusal, shape)
        total, started = 0, False

        async def counted():
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body:
                    raise _TooLarge
            return message

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except _TooLarge:
            if not started:
                await self.refuse(send, self.too_large(), shape)

    def check(self, method: str, headers: dict[str, str]) -> APIError | None:
        if not self.host_ok(headers.get("host", "")):
            return APIError(403, f"Host {headers['host']!r} is not this server's (a page's DNS name pointed at it?); "
                                 "start the server with --allowed-hosts to answer it", "permission_error")
        if method not in ("POST", "PUT", "PATCH"):
            return None
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):  # "null" (file:// pages) only under "*"
            return APIError(403, f"requests from the page {origin!r} are not allowed (see --cors-origins)",
                            "permission_error")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return self.too_large()
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind and not (kind == "application/json" or kind.endswith("+json")) and length != "0":
            return APIError(415, f"the request body must be JSON (Content-Type: application/json), not {kind!r}",
                            "invalid_request_error")
        return None

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_body} bytes "
                             "(see --max-body)", "invalid_request_error")

    @staticmethod
    async def refuse(send, e: APIError, shape) -> None:
        body = json.dumps(shape(e)).encode()
        await send({"type": "http.response.start", "status": e.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def origin_policy(pattern: str | None, origins: list[str] | None) -> Callable[[str], bool]:
    """The CORS policy's origins as a test: a regex, or a list (["*"]: any)."""
    if origins is not None:
        allowed = set(origins)
        return lambda o: "*" in allowed or o in allowed
    rx = re.compile(pattern or "")
    return lambda o: rx.fullmatch(o) is not None
