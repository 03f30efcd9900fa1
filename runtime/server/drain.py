"""Stopping without losing a request in silence: an ASGI middleware that counts the requests in
flight and, once the server drains, answers new ones with a 503 and Retry-After instead of a
refused connection (a client or a load balancer retries a 503; a refused connection looks like a
dead server)."""

from __future__ import annotations

import json


class Drain:
    def __init__(self, app):
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining:
            body = json.dumps({"error": {"message": "The server is shutting down; retry shortly.",
                                         "type": "server_error", "param": None, "code": "server_shutdown"}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5"),
                                    (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
