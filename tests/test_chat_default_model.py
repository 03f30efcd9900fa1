"""`lowbit chat` end to end on the default model: the command's own in-process server (loading in
the background while the app waits on /health), one prompt typed through Pilot, a streamed reply."""

from __future__ import annotations

import asyncio

import pytest

from lowbit.runtime.cli.chat import start_local_server, stop_local_server
from lowbit.runtime.cli.main import build_parser
from lowbit.tui.app import Bubble, ChatApp
from lowbit.tui.client import ChatClient, Settings
from lowbit.tui.store import ChatStore

pytestmark = pytest.mark.slow


def test_chat_in_process_with_the_default_model(default_gguf, tmp_path):
    args = build_parser().parse_args(["chat", str(default_gguf), "--kv-memory", "64MiB"])
    failure: list = []
    base_url, handle = start_local_server(args, failure)
    app = ChatApp(ChatClient(base_url), ChatStore(tmp_path / "chats.db"), Settings(temperature=0, max_tokens=24),
                  startup_error=lambda: str(failure[0]) if failure else None)

    async def go():
        async with app.run_test(size=(100, 30)) as pilot:
            for _ in range(1200):  # the model loads meanwhile (~2-3 s here)
                if app.settings.model:
                    break
                await pilot.pause(0.05)
            assert app.settings.model == default_gguf.name and not failure
            await pilot.click("#prompt")
            await pilot.press(*"What is the capital of France?", "enter")
            for _ in range(1200):
                if len(app.messages) == 2 and not app.generating:
                    break
                await pilot.pause(0.05)
            reply = app.messages[-1]
            assert reply.role == "assistant" and "Paris" in reply.content
            assert app.query(Bubble).last().source == reply.content
            assert "TTFT" in str(app.query_one("#status").render())

    try:
        asyncio.run(go())
    finally:
        stop_local_server(handle)
