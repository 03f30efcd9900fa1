"""`lowbit chat`: a Textual chat app over any OpenAI-compatible server (tui/client.py).

The reply streams into a Markdown widget as tokens arrive; a thinking model's reasoning
(`reasoning_content`) streams dimmed into a collapsible block above it, which folds once the answer
begins (as oterm shows it), instead of a blank wait. The transcript stays anchored to the
bottom unless the user scrolls up. Generation runs in an async worker on the app's own event loop,
so the input stays responsive and Esc cancels it at once (the HTTP stream closes, the server aborts
the request and frees its pages); the partial reply is kept and marked stopped. Chats are saved to
SQLite (tui/store.py): the prompt when it is sent, the reply when it ends or is stopped. Errors are
notifications, never tracebacks; every store call runs inside ChatApp.database() for that.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message as TMessage
from textual.screen import ModalScreen
from rich.text import Text
from textual.widgets import Collapsible, Footer, Header, Markdown, Static, TextArea

from lowbit.tui.client import ChatClient, ChatError, Settings, Stats
from lowbit.tui.store import ChatDeleted, ChatStore, Message

_CODE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


class PromptInput(TextArea):
    """The message box: Enter sends, Ctrl+J inserts a newline (multi-line prompts)."""

    BINDINGS = [Binding("ctrl+j", "newline", "Newline")]

    class Submitted(TMessage):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    async def _on_key(self, event) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        self.insert("\n")


class Bubble(Markdown):
    """One message of the transcript."""

    def __init__(self, role: str, text: str = "", stopped: bool = False):
        super().__init__(text + ("\n\n*(stopped)*" if stopped else ""), classes=role)
        self.role = role


class Thinking(Collapsible):
    """A reply's reasoning: open and growing while it streams, folded to one line ("Thought for 12 s")
    once the answer begins. Plain text: reasoning is drafts, not markup to render."""

    def __init__(self):
        self.body = Static("", classes="reasoning-text")
        super().__init__(self.body, title="Thinking…", collapsed=False, classes="reasoning")
        self.source, self.t0, self.finished = "", time.perf_counter(), False

    def add(self, piece: str) -> None:
        self.source += piece
        self.body.update(Text(self.source))

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.title = f"Thought for {time.perf_counter() - self.t0:.0f} s"
            self.collapsed = True


class ChatApp(App):
    TITLE = "lowbit chat"
    CSS = """
    #transcript { height: 1fr; padding: 0 1; }
    Bubble { margin: 1 0 0 0; padding: 0 1; }
    Bubble.user { background: $boost; border-left: thick $accent; }
    Bubble.assistant { border-left: thick $success; }
    Bubble.system { color: $text-muted; border-left: thick $warning; }
    Thinking { margin: 1 0 0 0; border-left: thick $secondary; }
    Thinking .reasoning-text { color: $text-muted; text-style: italic; }
    #status { height: 1; background: $panel; color: $text-muted; padding: 0 1; }
    PromptInput { height: auto; max-height: 8; min-height: 3; }
    """
    BINDINGS = [
        Binding("escape", "escape", "Stop", priority=True),
        Binding("ctrl+n", "new_chat", "New", priority=True),
        Binding("ctrl+r", "regenerate", "Redo", priority=True),
        Binding("ctrl+l", "copy_reply", "Copy", priority=True),
        Binding("ctrl+b", "copy_code", "Code", priority=True),
        Binding("ctrl+s", "settings", "Settings", priority=True),
        Binding("ctrl+o", "history", "History", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]
    ENABLE_COMMAND_PALETTE = False  # every action has a key in the footer

    def __init__(self, client: ChatClient, store: ChatStore, settings: Settings | None = None,
                 model_info: dict | None = None, wait_ready: bool = True, startup_error=None):
        super().__init__()
        self.startup_error = startup_error or (lambda: None)  # () -> str | None: the in-process load failed
        self.client, self.store = client, store
        self.settings = settings or Settings()
        self.model_info = model_info or {}  # /v1/models entry: id, max_model_len, lowbit's formats
        self.served: list[dict] = [model_info] if model_info else []  # every /v1/models entry, once connected
        self.wait_ready = wait_ready
        self.chat_id: int | None = None
        self.messages: list[Message] = []
        self.last_stats: Stats | None = None
        self.generating = False
        self.unsaved = False  # the last save failed: the next one (or quitting) tries again

    def compose(self) -> ComposeResult:
        yield Header()
        yield VerticalScroll(id="transcript")
        yield Static("", id="status")
        yield PromptInput(id="prompt", soft_wrap=True, show_line_numbers=False)
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#transcript").anchor()
        self.query_one("#prompt").focus()
        self.connect()

    # ---- server --------------------------------------------------------------------------------

    @work(exclusive=True, group="connect")
    async def connect(self) -> None:
        """Wait for the server (lowbit answers /health 503 while loading), then pick the model."""
        status = self.query_one("#status", Static)
        frames = "|/-\\"
        i = 0
        while self.wait_ready:
            if (err := self.startup_error()) is not None:
                self.notify(err, title="The model did not load", severity="error", timeout=30)
                status.update(f"the model did not load: {err}")
                return
            code = await self.client.health()
            if code == 200 or (code is not None and code != 503):
                break
            status.update(f"{frames[i % 4]} loading the model at {self.client.base_url} ...")
            i += 1
            await asyncio.sleep(0.25)
        try:
            models = await self.client.models()
        except (ChatError, ValueError, KeyError) as e:  # unreachable, or not an OpenAI server
            self.notify(str(e), title="Server unavailable", severity="error")
            status.update(f"no server at {self.client.base_url}")
            return
        self.served = models
        if models:
            chosen = next((m for m in models if m.get("id") == self.settings.model), models[0])
            self.model_info = chosen
            self.settings.model = chosen["id"]
        self.show_status()

    def show_status(self) -> None:
        m = self.model_info
        parts = [m.get("id") or self.settings.model or "no model"]
        fmt = m.get("lowbit") or {}
        if fmt:
            parts.append(f"weights {fmt.get('weights', '?')}, KV {fmt.get('kv_cache', '?')}")
        s = self.last_stats
        if s is not None:
            if s.ttft is not None:
                parts.append(f"TTFT {s.ttft * 1000:.0f} ms")
            if s.decode_tps is not None:
                parts.append(f"{s.decode_tps:.1f} tok/s")
            if s.prompt_tokens is not None and s.completion_tokens is not None:
                parts.append(f"{s.prompt_tokens} + {s.completion_tokens} tokens")
                if m.get("max_model_len"):
                    parts.append(f"context {s.prompt_tokens + s.completion_tokens}/{m['max_model_len']}")
        self.query_one("#status", Static).update(" · ".join(parts))

    # ---- the conversation ----------------------------------------------------------------------

    def wire_messages(self) -> list[dict]:
        sys_msgs = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return sys_msgs + [{"role": m.role, "content": m.content} for m in self.messages]

    @on(PromptInput.Submitted)
    async def send(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        if self.generating:
            self.notify("Still answering: press Esc to stop it first.", severity="warning")
            return
        self.query_one("#prompt", PromptInput).clear()
        self.messages.append(Message("user", text))
        await self.query_one("#transcript").mount(Bubble("user", text))
        self.save()  # before the reply streams: a crash mid-reply keeps the prompt
        self.generate()

    @work(exclusive=True, group="generate")
    async def generate(self) -> None:
        transcript = self.query_one("#transcript")
        bubble = Bubble("assistant")
        await transcript.mount(bubble)
        stream = Markdown.get_stream(bubble)
        reply = Message("assistant", "")
        thinking: Thinking | None = None
        # the chat this reply belongs to, even if Ctrl+N or the history opens another before it ends
        messages, chat_id = self.messages, self.chat_id
        self.generating = True
        if (self.model_info.get("status") or {}).get("value") == "unloaded":  # lowbit serve --models
            self.query_one("#status", Static).update(f"loading {self.model_info['id']} on the server ...")
        try:
            async for chunk in self.client.stream_chat(self.wire_messages(), self.settings,
                                                       self.settings.model or ""):
                if chunk.reasoning:
                    if thinking is None:
                        thinking = Thinking()
                        await transcript.mount(thinking, before=bubble)
                    thinking.add(chunk.reasoning)
                if chunk.text:
                    if thinking is not None:
                        thinking.finish()
                    reply.content += chunk.text
                    await stream.write(chunk.text)
                if chunk.stats is not None:
                    self.last_stats = chunk.stats
        except ChatError as e:
            self.notify(str(e), title="Request failed", severity="error")
            reply.stopped = bool(reply.content)
        except Exception as e:  # noqa: BLE001 - a bug still ends as a notification, not a traceback
            self.notify(f"{type(e).__name__}: {e}", title="Unexpected error", severity="error")
            reply.stopped = bool(reply.content)
        except BaseException:  # cancelled by Esc (or the app closing): keep what came, marked stopped
            reply.stopped = True
            raise
        finally:
            self.generating = False
            if thinking is not None:
                thinking.finish()
            await stream.stop()
            if reply.stopped and reply.content:
                await bubble.update(reply.content + "\n\n*(stopped)*")
            if reply.content:
                messages.append(reply)
            else:  # nothing arrived (an error, or Esc before the first token): no empty reply kept
                await bubble.remove()
                if reply.stopped:
                    self.notify("Stopped before the reply began.")
            if messages is self.messages:
                self.save()
            else:  # another chat is open now: file the reply under its own, unless that was deleted
                self.write(chat_id, messages, None, recreate=False)
            if not reply.stopped:  # Esc or the app closing: no request to wait on
                await self.refresh_models()
            self.show_status()

    async def refresh_models(self) -> None:
        """/v1/models again: a model the reply loaded on demand now has its context length and formats."""
        try:
            self.served = await self.client.models()
        except (ChatError, ValueError, KeyError):
            return  # the status line keeps what it knew
        self.model_info = next((m for m in self.served if m.get("id") == self.model_info.get("id")), self.model_info)

    @contextmanager
    def database(self, doing: str) -> Iterator[None]:
        """The one place a store call's sqlite3.Error (locked past the busy timeout, disk full, a broken
        file) ends: a notification, and the rest of the block is skipped. The app keeps running."""
        try:
            yield
        except sqlite3.Error as e:
            self.notify(f"{doing} failed: {e}", title="Chat history", severity="error", timeout=10)

    def save(self) -> None:
        """Save the open chat; on failure it stays marked unsaved for the next save to retry."""
        if self.messages:
            saved = self.write(self.chat_id, self.messages, asdict(self.settings))
            self.unsaved = saved is None
            if saved is not None:  # a new chat's id, or the one a deleted chat was saved anew as
                self.chat_id = saved

    def write(self, chat_id: int | None, messages: list[Message], settings: dict | None,
              recreate: bool = True) -> int | None:
        """Merge `messages` into chat `chat_id` (None: a new chat); its id, or None if it failed.
        recreate: a chat deleted meanwhile is saved anew (it is on screen), else let go."""
        first = messages[0].content
        title = first[:48] + ("…" if len(first) > 48 else "")
        with self.database("Saving the chat"):
            try:
                return self.store.save_messages(chat_id, messages, settings, title)
            except ChatDeleted:  # deleted in another window: keep what is on screen, as a chat of its own
                if not recreate:
                    return None
                chat_id = self.store.save_messages(None, messages, settings, title)
                self.notify("This chat was deleted in another window; it is saved as a new chat.",
                            title="Chat history", severity="warning")
                return chat_id
        return None

    # ---- actions -------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self.workers.cancel_group(self, "generate")

    def action_escape(self) -> None:
        """Esc stops the reply; else it closes the open dialog, whose own Esc binding never runs
        (this one is a priority binding, checked first)."""
        if self.generating:
            self.action_stop()
        elif isinstance(self.screen, ModalScreen):
            self.screen.dismiss(None)

    async def action_quit(self) -> None:
        if self.unsaved and not self.generating:  # a generating worker saves as it is cancelled
            self.save()
        self.exit()

    async def action_new_chat(self) -> None:
        self.action_stop()
        self.chat_id, self.messages, self.last_stats, self.unsaved = None, [], None, False
        await self.query_one("#transcript").remove_children()
        self.show_status()

    async def action_regenerate(self) -> None:
        if self.generating:
            return
        if not self.messages or self.messages[-1].role != "assistant":
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self.messages.pop()
        transcript = self.query_one("#transcript")
        last = transcript.children[-1] if transcript.children else None
        if isinstance(last, Bubble):
            before = transcript.children[-2] if len(transcript.children) > 1 else None
            await last.remove()
            if isinstance(before, Thinking):  # the replaced reply's reasoning goes with it
                await before.remove()
        self.generate()

    def last_reply(self) -> str | None:
        return next((m.content for m in reversed(self.messages) if m.role == "assistant"), None)

    def action_copy_reply(self) -> None:
        text = self.last_reply()
        if text is None:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify("Reply copied to the clipboard.")

    def action_copy_code(self) -> None:
        blocks = _CODE.findall(self.last_reply() or "")
        if not blocks:
            self.notify("The last reply has no code block.", severity="warning")
            return
        self.copy_to_clipboard(blocks[-1])
        self.notify("Code block copied to the clipboard.")

    def action_settings(self) -> None:
        from lowbit.tui.screens import SettingsScreen

        def done(result: Settings | None) -> None:
            if result is not None:
                self.settings = result
                # the chosen model's entry: its context length and formats, not the previous model's
                self.model_info = next((m for m in self.served if m.get("id") == result.model),
                                       {"id": result.model} if result.model else self.model_info)
                self.save()
                self.show_status()

        self.push_screen(SettingsScreen(self.settings, self.client), done)

    def action_history(self) -> None:
        from lowbit.tui.screens import HistoryScreen

        async def done(chat_id: int | None) -> None:
            if chat_id is not None:
                await self.open_chat(chat_id)

        self.push_screen(HistoryScreen(self.store), done)

    async def open_chat(self, chat_id: int) -> None:
        self.action_stop()
        with self.database("Opening the chat"):  # a failed read leaves the open chat as it is
            messages, saved = self.store.load(chat_id), self.store.settings(chat_id)
            self.chat_id, self.messages, self.unsaved = chat_id, messages, False
            if saved:
                self.settings = Settings(**{**asdict(self.settings), **saved})
            transcript = self.query_one("#transcript")
            await transcript.remove_children()
            await transcript.mount_all([Bubble(m.role, m.content, m.stopped) for m in self.messages])
            self.last_stats = None
            self.show_status()
