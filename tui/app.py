"""`lowbit chat`: a Textual chat app over any OpenAI-compatible server (tui/client.py).

The reply streams into a Markdown widget as tokens arrive; the transcript stays anchored to the
bottom unless the user scrolls up. Generation runs in an async worker on the app's own event loop,
so the input stays responsive and Esc cancels it at once (the HTTP stream closes, the server aborts
the request and frees its pages); the partial reply is kept and marked stopped. Chats are saved to
SQLite (tui/store.py) after every exchange. Errors are notifications, never tracebacks.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message as TMessage
from textual.widgets import Footer, Header, Markdown, Static, TextArea

from lowbit.tui.client import ChatClient, ChatError, Settings, Stats
from lowbit.tui.store import ChatStore, Message

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


class ChatApp(App):
    TITLE = "lowbit chat"
    CSS = """
    #transcript { height: 1fr; padding: 0 1; }
    Bubble { margin: 1 0 0 0; padding: 0 1; }
    Bubble.user { background: $boost; border-left: thick $accent; }
    Bubble.assistant { border-left: thick $success; }
    Bubble.system { color: $text-muted; border-left: thick $warning; }
    #status { height: 1; background: $panel; color: $text-muted; padding: 0 1; }
    PromptInput { height: auto; max-height: 8; min-height: 3; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
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
        self.generate()

    @work(exclusive=True, group="generate")
    async def generate(self) -> None:
        transcript = self.query_one("#transcript")
        bubble = Bubble("assistant")
        await transcript.mount(bubble)
        stream = Markdown.get_stream(bubble)
        reply = Message("assistant", "")
        self.generating = True
        try:
            async for chunk in self.client.stream_chat(self.wire_messages(), self.settings,
                                                       self.settings.model or ""):
                if chunk.text:
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
            await stream.stop()
            if reply.stopped and reply.content:
                await bubble.update(reply.content + "\n\n*(stopped)*")
            if reply.content:
                self.messages.append(reply)
            else:  # nothing arrived (an error, or Esc before the first token): no empty reply kept
                await bubble.remove()
                if reply.stopped:
                    self.notify("Stopped before the reply began.")
            self.save()
            self.show_status()

    def save(self) -> None:
        if not self.messages:
            return
        if self.chat_id is None:
            first = self.messages[0].content
            self.chat_id = self.store.new_chat(first[:48] + ("…" if len(first) > 48 else ""))
        self.store.save_messages(self.chat_id, self.messages, asdict(self.settings))

    # ---- actions -------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self.workers.cancel_group(self, "generate")

    async def action_new_chat(self) -> None:
        self.action_stop()
        self.chat_id, self.messages, self.last_stats = None, [], None
        await self.query_one("#transcript").remove_children()
        self.show_status()

    async def action_regenerate(self) -> None:
        if self.generating:
            return
        if not self.messages or self.messages[-1].role != "assistant":
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        self.messages.pop()
        bubbles = self.query(Bubble)
        if bubbles:
            await bubbles.last().remove()
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
        self.chat_id = chat_id
        self.messages = self.store.messages(chat_id)
        saved = self.store.settings(chat_id)
        if saved:
            self.settings = Settings(**{**asdict(self.settings), **saved})
        transcript = self.query_one("#transcript")
        await transcript.remove_children()
        await transcript.mount_all([Bubble(m.role, m.content, m.stopped) for m in self.messages])
        self.last_stats = None
        self.show_status()
