"""The chat app (tui/) driven by Textual's Pilot against a fake OpenAI-compatible server with
scripted token streams (an httpx transport inside the test), plus SVG snapshots at a fixed size."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import httpx

from lowbit.tui.app import Bubble, ChatApp, PromptInput, Thinking
from lowbit.tui.client import ChatClient, Settings, Stats
from lowbit.tui.screens import HistoryScreen, SettingsScreen
from lowbit.tui.store import ChatStore, Message

SIZE = (100, 30)


def sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class FakeOpenAI:
    def __init__(self, replies: list[list[str]] | None = None, model: str = "fake-model", max_model_len: int = 2048):
        self.replies = replies or [["Hello", " there", "!"]]
        self.model, self.max_model_len = model, max_model_len
        self.requests: list[dict] = []
        self.hold_after: int | None = None
        self.release = asyncio.Event()
        self.reached_hold = asyncio.Event()
        self.closed_early = 0
        self.fail_with: tuple[int, str] | None = None  # (status, message) for the next chat request
        self.delay = 0.0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/health"):
            return httpx.Response(200, json={"status": "ok"})
        if path.endswith("/models"):
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": self.model, "object": "model", "max_model_len": self.max_model_len,
                 "lowbit": {"weights": "auto", "kv_cache": "k8v4"}},
                {"id": "other-model", "object": "model", "max_model_len": 1024}]})
        body = json.loads(request.content)
        self.requests.append(body)
        if self.fail_with is not None:
            status, msg = self.fail_with
            self.fail_with = None
            return httpx.Response(status, json={"error": {"message": msg, "type": "invalid_request_error",
                                                          "param": None, "code": None}})
        reply = self.replies[(len(self.requests) - 1) % len(self.replies)]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream(reply))

    async def stream(self, reply: list[str]):
        finished = False
        try:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i, piece in enumerate(reply):
                if self.hold_after is not None and i == self.hold_after:
                    self.reached_hold.set()
                    await self.release.wait()
                if self.delay:
                    await asyncio.sleep(self.delay)
                # ("reasoning", text): a thinking model's reasoning, as lowbit's server streams it
                delta = {"reasoning_content": piece[1]} if isinstance(piece, tuple) else {"content": piece}
                yield sse({"choices": [{"index": 0, "delta": delta}]})
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(reply),
                                                "total_tokens": 7 + len(reply)}})
            yield sse("[DONE]")
            finished = True
        finally:
            if not finished:
                self.closed_early += 1


def make_app(tmp_path, fake: FakeOpenAI, **kw) -> ChatApp:
    return ChatApp(ChatClient("http://fake/v1", transport=fake.transport()), ChatStore(tmp_path / "chats.db"), **kw)


async def until(pilot, cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached")


async def send(pilot, text: str) -> None:
    await pilot.click("#prompt")
    await pilot.press(*text, "enter")


def bubble_text(app: ChatApp, i: int = -1) -> str:
    return app.query(Bubble)[i].source


def test_send_streams_the_reply_and_shows_stats(tmp_path):
    fake = FakeOpenAI([["Hello", " there", ", friend", "!"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model == "fake-model")
            fake.hold_after = 2
            await send(pilot, "hi")
            await until(pilot, lambda: fake.reached_hold.is_set())
            await pilot.pause(0.1)
            assert bubble_text(app) == "Hello there"  # arrived so far, shown while the rest is pending
            assert app.query_one("#prompt").has_focus  # the input stays usable meanwhile
            fake.release.set()
            await until(pilot, lambda: not app.generating and len(app.messages) == 2)
            assert bubble_text(app) == "Hello there, friend!"
            status = str(app.query_one("#status").render())
            assert "fake-model" in status and "7 + 4 tokens" in status and "context 11/2048" in status
            assert "TTFT" in status and "tok/s" in status and "KV k8v4" in status
            assert fake.requests[0]["messages"] == [{"role": "user", "content": "hi"}]
            assert fake.requests[0]["stream"] is True

    asyncio.run(go())


def test_reasoning_streams_dimmed_and_folds_when_the_answer_begins(tmp_path):
    """A thinking model's reasoning_content shows as it streams (no blank wait), apart from the reply,
    and folds once the answer begins; the reply and the saved chat hold only the answer."""
    fake = FakeOpenAI([[("reasoning", "Let me"), ("reasoning", " think."), "Paris", "."]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model == "fake-model")
            fake.hold_after = 2
            await send(pilot, "capital of France?")
            await until(pilot, lambda: fake.reached_hold.is_set())
            await pilot.pause(0.1)
            thinking = app.query_one(Thinking)
            assert thinking.source == "Let me think." and not thinking.collapsed and thinking.title == "Thinking…"
            fake.release.set()
            await until(pilot, lambda: not app.generating and len(app.messages) == 2)
            assert thinking.collapsed and thinking.title.startswith("Thought for ")
            assert bubble_text(app) == "Paris." and app.messages[-1].content == "Paris."
            await pilot.press("ctrl+r")  # regenerate: the old reasoning goes with the old reply
            await until(pilot, lambda: not app.generating and len(fake.requests) == 2 and len(app.messages) == 2)
            assert len(app.query(Thinking)) == 1 and len(app.query(Bubble)) == 2

    asyncio.run(go())


def test_multiline_prompt_and_esc_stops_mid_stream(tmp_path):
    fake = FakeOpenAI([["one", " two", " three", " four"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            fake.hold_after = 2
            await pilot.click("#prompt")
            await pilot.press("a", "ctrl+j", "b", "enter")
            await until(pilot, lambda: fake.reached_hold.is_set())
            await pilot.pause(0.05)
            await pilot.press("escape")
            await until(pilot, lambda: not app.generating)
            assert fake.requests[0]["messages"][-1]["content"] == "a\nb"
            assert app.messages[-1] == Message("assistant", "one two", stopped=True)
            assert "*(stopped)*" in bubble_text(app)
            await until(pilot, lambda: fake.closed_early == 1)  # the HTTP stream was dropped
            saved = ChatStore(tmp_path / "chats.db").messages(app.chat_id)
            assert saved[-1].stopped and saved[-1].content == "one two"

    asyncio.run(go())


def test_esc_before_the_first_token_keeps_no_empty_reply(tmp_path):
    fake = FakeOpenAI([["late"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            fake.hold_after = 0
            await send(pilot, "q")
            await until(pilot, lambda: fake.reached_hold.is_set())
            await pilot.press("escape")
            await until(pilot, lambda: not app.generating)
            await pilot.pause(0.05)
            assert [m.role for m in app.messages] == ["user"] and len(app.query(Bubble)) == 1
            assert any("before the reply began" in n.message for n in app._notifications)

    asyncio.run(go())


def test_regenerate_replaces_the_last_reply(tmp_path):
    fake = FakeOpenAI([["first"], ["second"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            await send(pilot, "q")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            await pilot.press("ctrl+r")
            await until(pilot, lambda: len(fake.requests) == 2 and not app.generating and len(app.messages) == 2)
            assert [m.content for m in app.messages] == ["q", "second"]
            assert fake.requests[1]["messages"] == fake.requests[0]["messages"]
            assert len(app.query(Bubble)) == 2
            assert stored(tmp_path, app.chat_id) == ["q", "second"]  # replaced in the file too

    asyncio.run(go())


def stored(tmp_path, chat_id) -> list[str]:
    """The chat as another window would read it from the file now."""
    return [m.content for m in ChatStore(tmp_path / "chats.db").messages(chat_id)]


def notes(app: ChatApp) -> list[str]:
    return [n.message for n in app._notifications]


def test_the_prompt_is_saved_when_sent_before_the_reply_ends(tmp_path):
    fake = FakeOpenAI([["part", " rest"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            fake.hold_after = 1
            await send(pilot, "keep me")
            await until(pilot, lambda: fake.reached_hold.is_set())
            assert app.chat_id is not None and stored(tmp_path, app.chat_id) == ["keep me"]  # a crash now keeps it
            fake.release.set()
            await until(pilot, lambda: not app.generating and len(app.messages) == 2)
            assert stored(tmp_path, app.chat_id) == ["keep me", "part rest"]

    asyncio.run(go())


def test_a_chat_deleted_in_another_window_is_saved_as_a_new_chat(tmp_path):
    fake = FakeOpenAI([["r1"], ["r2"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            await send(pilot, "q1")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            gone = app.chat_id
            ChatStore(tmp_path / "chats.db").delete(gone)  # the other window
            await send(pilot, "q2")  # was an uncaught sqlite3.IntegrityError (FOREIGN KEY constraint failed)
            await until(pilot, lambda: len(app.messages) == 4 and not app.generating)
            assert any("deleted in another window" in m for m in notes(app))
            assert app.chat_id != gone and stored(tmp_path, app.chat_id) == ["q1", "r1", "q2", "r2"]
            assert [c.id for c in ChatStore(tmp_path / "chats.db").list_chats()] == [app.chat_id]

    asyncio.run(go())


def test_a_locked_history_file_is_a_notification_and_a_later_save_succeeds(tmp_path):
    fake = FakeOpenAI([["r1"], ["r2"], ["r3"]])
    app = ChatApp(ChatClient("http://fake/v1", transport=fake.transport()),
                  ChatStore(tmp_path / "chats.db", busy_timeout=0.1))
    holder = sqlite3.connect(tmp_path / "chats.db", isolation_level=None)  # a third window, mid-write

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            holder.execute("BEGIN EXCLUSIVE")
            await send(pilot, "q1")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            await pilot.pause(0.05)
            failed = [m for m in notes(app) if "Saving the chat failed" in m]
            assert len(failed) == 2 and "locked" in failed[0]  # the prompt's save and the reply's
            assert app.unsaved and app.chat_id is None
            assert ChatStore(tmp_path / "chats.db").list_chats() == []  # no empty chat left behind
            holder.execute("COMMIT")
            await send(pilot, "q2")  # the app kept running, and this save carries the earlier exchange
            await until(pilot, lambda: len(app.messages) == 4 and not app.generating)
            assert not app.unsaved and stored(tmp_path, app.chat_id) == ["q1", "r1", "q2", "r2"]
            holder.execute("BEGIN EXCLUSIVE")
            await send(pilot, "q3")
            await until(pilot, lambda: len(app.messages) == 6 and not app.generating)
            assert app.unsaved
            holder.execute("COMMIT")
            await pilot.press("ctrl+q")  # quitting retries the failed save
        assert stored(tmp_path, app.chat_id) == ["q1", "r1", "q2", "r2", "q3", "r3"]

    asyncio.run(go())


def test_a_new_chat_mid_reply_files_the_reply_under_its_own_chat(tmp_path):
    fake = FakeOpenAI([["one", " two", " three"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            fake.hold_after = 1
            await send(pilot, "first")
            await until(pilot, lambda: fake.reached_hold.is_set())
            first = app.chat_id
            await pilot.press("ctrl+n")
            await until(pilot, lambda: not app.generating)
            await pilot.pause(0.05)
            assert app.messages == [] and app.chat_id is None  # the new chat does not begin with that reply
            saved = ChatStore(tmp_path / "chats.db").messages(first)
            assert [m.content for m in saved] == ["first", "one"] and saved[-1].stopped

    asyncio.run(go())


def test_deleting_the_open_chat_in_the_history_starts_a_new_one(tmp_path):
    fake = FakeOpenAI([["r1"], ["r2"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            await send(pilot, "q1")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            await pilot.press("ctrl+o")
            await until(pilot, lambda: isinstance(app.screen, HistoryScreen))
            await pilot.press("d")
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, HistoryScreen))
            assert app.chat_id is None and app.messages == [] and len(app.query(Bubble)) == 0
            await send(pilot, "q2")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            assert not any("another window" in m for m in notes(app))
            chats = ChatStore(tmp_path / "chats.db").list_chats()
            assert [c.title for c in chats] == ["q2"] and stored(tmp_path, app.chat_id) == ["q2", "r2"]

    asyncio.run(go())


def test_settings_reach_the_request(tmp_path):
    fake = FakeOpenAI([["ok"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen))
            screen = app.screen
            screen.query_one("#system").text = "Answer in French."
            screen.query_one("#temperature").value = "0.2"
            screen.query_one("#max_tokens").value = "64"
            await pilot.pause(0.1)
            await pilot.click("#save")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
            await send(pilot, "hello")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            body = fake.requests[-1]
            assert body["messages"][0] == {"role": "system", "content": "Answer in French."}
            assert body["temperature"] == 0.2 and body["max_tokens"] == 64

    asyncio.run(go())


def test_changing_the_model_in_settings_updates_the_status_line(tmp_path):
    """Picking another model in Settings shows that model's /v1/models entry in the status line (its
    context length, no stale formats of the model before) and sends requests to it."""
    fake = FakeOpenAI([["ok"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model == "fake-model")
            status = app.query_one("#status")
            assert "kv_cache" not in str(status.render()) and "KV k8v4" in str(status.render())
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.models_loaded)
            app.screen.query_one("#model").value = "other-model"
            await pilot.pause(0.1)
            await pilot.click("#save")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
            assert app.model_info["id"] == "other-model"
            await send(pilot, "hello")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
            assert fake.requests[-1]["model"] == "other-model"
            text = str(status.render())
            assert text.startswith("other-model") and "KV k8v4" not in text and "/1024" in text, text

    asyncio.run(go())


def test_history_saved_reopened_after_restart_and_exported(tmp_path):
    fake = FakeOpenAI([["**bold** answer"]])
    app = make_app(tmp_path, fake)

    async def first():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            await send(pilot, "remember me")
            await until(pilot, lambda: len(app.messages) == 2 and not app.generating)

    asyncio.run(first())
    again = make_app(tmp_path, FakeOpenAI())

    async def second():
        async with again.run_test(size=SIZE) as pilot:
            await pilot.press("ctrl+o")
            await until(pilot, lambda: isinstance(again.screen, HistoryScreen))
            again.screen.export_dir = tmp_path
            await pilot.press("e")
            await pilot.press("enter")
            await until(pilot, lambda: len(again.messages) == 2)
            assert [m.content for m in again.messages] == ["remember me", "**bold** answer"]
            assert len(again.query(Bubble)) == 2

    asyncio.run(second())
    exported = (tmp_path / f"lowbit-chat-{again.chat_id}.md").read_text()
    assert exported == "# remember me\n\n## You\n\nremember me\n\n## Assistant\n\n**bold** answer\n"


def test_history_rename_and_delete(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    a = store.new_chat("alpha")
    store.save_messages(a, [Message("user", "x")])
    b = store.new_chat("beta")
    store.rename(b, "  gamma ")
    assert {c.title for c in store.list_chats()} == {"alpha", "gamma"}
    store.delete(a)
    assert [c.title for c in store.list_chats()] == ["gamma"] and store.messages(a) == []


def test_error_is_a_notification_not_a_crash(tmp_path):
    fake = FakeOpenAI([["fine"]])
    app = make_app(tmp_path, fake)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.settings.model is not None)
            fake.fail_with = (400, "This model's maximum context length is 2048 tokens.")
            await send(pilot, "too long")
            await until(pilot, lambda: not app.generating and len(fake.requests) == 1)
            await pilot.pause(0.1)
            notes = [n.message for n in app._notifications]
            assert any("HTTP 400" in m and "maximum context length" in m for m in notes)
            assert [m.role for m in app.messages] == ["user"]  # no empty reply kept
            await send(pilot, "again")  # the app still works
            await until(pilot, lambda: len(app.messages) == 3 and not app.generating)

    asyncio.run(go())


def test_server_down_is_a_notification(tmp_path):
    def refuse(request):
        raise httpx.ConnectError("refused")

    app = ChatApp(ChatClient("http://nowhere/v1", transport=httpx.MockTransport(refuse)),
                  ChatStore(tmp_path / "c.db"), wait_ready=False)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.3)
            assert any("cannot reach" in n.message for n in app._notifications)

    asyncio.run(go())


# ---- snapshots (pytest-textual-snapshot) ------------------------------------------------------------

def steady(app: ChatApp) -> None:
    """Cursors stop blinking, so a picture does not depend on the moment it is taken."""
    for w in app.screen.query("TextArea, Input"):
        w.cursor_blink = False


def test_snapshot_empty_app(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeOpenAI())

    async def run_before(pilot):
        await until(pilot, lambda: app.settings.model is not None)
        steady(app)
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_finished_exchange(snap_compare, tmp_path):
    fake = FakeOpenAI([["Paris is the capital of **France**.\n\n```python\nprint('Paris')\n```"]])
    app = make_app(tmp_path, fake)

    async def run_before(pilot):
        await until(pilot, lambda: pilot.app.settings.model is not None)
        prompt = app.query_one(PromptInput)
        prompt.focus()
        prompt.text = "What is the capital of France?"
        await pilot.press("enter")
        await until(pilot, lambda: len(app.messages) == 2 and not app.generating)
        app.last_stats = Stats("fake-model", ttft=0.125, decode_tps=42.0, prompt_tokens=7, completion_tokens=1)
        app.show_status()  # measured timings vary run to run: fixed ones for the picture
        steady(app)
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_snapshot_settings_screen(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeOpenAI(), settings=Settings(system_prompt="Be brief."))

    async def run_before(pilot):
        await until(pilot, lambda: app.settings.model is not None)
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.models_loaded)
        steady(app)
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
