"""Helpers the tests import (the fixtures are in conftest.py, which builds some of them on these)."""

from __future__ import annotations

import contextlib

from lowbit.runtime.ports import free_port


class ByteTokenizer:
    """For tiny random models with a vocabulary of 101: token i < 100 is the byte i + 32
    (printable ASCII); 100 is the end token."""

    vocab_size = 101
    special_ids = frozenset({100})
    eos_ids = frozenset({100})

    def token_bytes(self, i: int) -> bytes:
        return b"" if i == 100 else bytes([i + 32])

    def encode_chat(self, messages, add_generation_prompt=True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return [min(ord(ch) - 32, 99) for ch in text]


@contextlib.contextmanager
def serving(app):
    """An ASGI app on a free loopback port, uvicorn in a thread → its base URL (http://127.0.0.1:P);
    stopped on exit."""
    import threading
    import time

    import uvicorn

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    try:
        deadline = time.time() + 20
        while not srv.started:
            assert time.time() < deadline and th.is_alive(), "server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)
