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


def test_the_model_selector_switches_models_loading_on_demand(default_gguf, moe_gguf, tmp_path):
    """`lowbit chat MODEL --models OTHER`: the in-process server offers both; Settings (Ctrl+S) lists the other
    as loading when used, and the next reply comes from it, loaded on demand (/api/ps), after which the status
    line shows its context length."""
    import httpx

    from lowbit.tui.screens import SettingsScreen

    args = build_parser().parse_args(["chat", str(default_gguf), "--models", str(moe_gguf), "--kv-memory", "64MiB"])
    failure: list = []
    base_url, handle = start_local_server(args, failure)
    app = ChatApp(ChatClient(base_url), ChatStore(tmp_path / "chats.db"), Settings(temperature=0, max_tokens=8),
                  startup_error=lambda: str(failure[0]) if failure else None)
    root = base_url.removesuffix("/v1")

    async def until(pilot, cond):
        for _ in range(2400):
            if cond():
                return
            await pilot.pause(0.05)
        raise AssertionError("condition not reached")

    async def go():
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.settings.model == default_gguf.name or failure)
            assert not failure and {m["id"] for m in app.served} >= {default_gguf.name, moe_gguf.name}
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.models_loaded)
            select = app.screen.query_one("#model")
            assert (f"{moe_gguf.name} (loads when used)", moe_gguf.name) in select._options
            select.value = moe_gguf.name
            await pilot.pause(0.1)
            await pilot.click("#save")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
            assert moe_gguf.name not in [m["name"] for m in httpx.get(root + "/api/ps").json()["models"]]
            await pilot.click("#prompt")
            await pilot.press(*"Hello", "enter")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            assert app.messages[-1].role == "assistant" and app.messages[-1].content
            assert moe_gguf.name in [m["name"] for m in httpx.get(root + "/api/ps").json()["models"]]
            status = str(app.query_one("#status").render())
            assert status.startswith(moe_gguf.name) and f"/{app.model_info['max_model_len']}" in status, status

    try:
        asyncio.run(go())
    finally:
        stop_local_server(handle)
