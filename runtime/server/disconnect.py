"""A request whose client has gone stops: an ASGI middleware that cancels the route once the client
disconnects, streamed or not.

A streamed reply notices a closed socket when it next writes; a non-streamed one writes only at
the end, so without this it kept generating every token of `max_tokens` (by default the rest of the
context: minutes) for nobody, and each retry of the official client left one more. Once the body
has been read, this listens for the ASGI `http.disconnect` event and cancels the route's task;
the cancellation closes the engine streams the route holds, which aborts their requests and frees
their KV pages (`AsyncEngine.generate`'s `finally`), and the metrics count them as aborted.
"""

from __future__ import annotations

import asyncio
import contextlib


class CancelOnDisconnect:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done = asyncio.Event()
        gone: asyncio.Future = asyncio.get_running_loop().create_future()  # the disconnect message
        finished = False

        async def app_receive():
            if body_done.is_set():  # after the body: the next message is the disconnect, heard below
                return await asyncio.shield(gone)
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.done() or gone.set_result(message)
            elif not message.get("more_body", False):
                body_done.set()
            return message

        async def app_send(message):
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True

        async def listen():
            await body_done.wait()
            message = await receive()
            gone.done() or gone.set_result(message)

        task = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and gone.done() and gone.result()["type"] == "http.disconnect" and not finished:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
            await task
        finally:
            listener.cancel()
            if not task.done():
                task.cancel()
