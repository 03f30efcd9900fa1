"""The chat app's two dialogs: per-chat settings (system prompt, sampling, max tokens, model from
/v1/models) and the history (open, rename, delete, export to Markdown)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, TextArea
from textual.widgets.option_list import Option

from lowbit.tui.client import ChatClient, ChatError, Settings
from lowbit.tui.store import ChatStore

_DIALOG_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{ width: 80; height: auto; max-height: 90%; border: thick $accent; background: $surface;
                    padding: 1 2; }}
{name} Label {{ margin: 1 0 0 0; }}
{name} Horizontal {{ height: auto; margin: 1 0 0 0; }}
"""


class SettingsScreen(ModalScreen[Settings | None]):
    CSS = _DIALOG_CSS.format(name="SettingsScreen") + """
    SettingsScreen TextArea { height: 4; }
    SettingsScreen Label { margin: 0; }
    SettingsScreen .field { width: 1fr; height: auto; margin: 0 1 0 0; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: Settings, client: ChatClient):
        super().__init__()
        self.settings, self.client = settings, client
        self.models_loaded = False

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical():
            yield Label("System prompt")
            yield TextArea(s.system_prompt, id="system")
            yield Label("Model")
            yield Select([(s.model or "(server default)", s.model or "")], value=s.model or "", id="model",
                         allow_blank=False)
            with Horizontal():
                with Vertical(classes="field"):
                    yield Label("Temperature")
                    yield Input(str(s.temperature), id="temperature")
                with Vertical(classes="field"):
                    yield Label("Top-p")
                    yield Input(str(s.top_p), id="top_p")
                with Vertical(classes="field"):
                    yield Label("Max tokens")
                    yield Input(str(s.max_tokens), id="max_tokens")
            with Horizontal():
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.load_models()

    @work
    async def load_models(self) -> None:
        try:
            models = await self.client.models()
        except ChatError as e:
            self.notify(str(e), severity="error")
            return
        ids = [m["id"] for m in models]
        if ids:
            select = self.query_one("#model", Select)
            # lowbit serve --models: a model not loaded yet loads on its first request (seconds to minutes)
            select.set_options([(m["id"] + (" (loads when used)" if (m.get("status") or {}).get("value") == "unloaded"
                                            else ""), m["id"]) for m in models])
            select.value = self.settings.model if self.settings.model in ids else ids[0]
        self.models_loaded = True

    @on(Button.Pressed, "#save")
    def save(self) -> None:
        try:
            temperature = float(self.query_one("#temperature", Input).value)
            top_p = float(self.query_one("#top_p", Input).value)
            max_tokens = int(self.query_one("#max_tokens", Input).value)
            if not (0 <= temperature <= 2 and 0 < top_p <= 1 and max_tokens >= 1):
                raise ValueError
        except ValueError:
            self.notify("Temperature must be in [0, 2], top-p in (0, 1], max tokens an integer >= 1.",
                        severity="error")
            return
        model = self.query_one("#model", Select).value
        self.dismiss(replace(self.settings, system_prompt=self.query_one("#system", TextArea).text,
                             temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             model=model if isinstance(model, str) and model else self.settings.model))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class HistoryScreen(ModalScreen[int | None]):
    """Enter opens the highlighted chat; r renames it, d deletes it, e exports it to Markdown.
    Store calls run inside the app's database() guard: a locked file is a notification here too."""

    CSS = _DIALOG_CSS.format(name="HistoryScreen") + "HistoryScreen OptionList { height: 16; }"
    BINDINGS = [Binding("escape", "close", "Close"), Binding("r", "rename", "Rename"),
                Binding("d", "delete", "Delete"), Binding("e", "export", "Export")]

    def __init__(self, store: ChatStore, export_dir: Path | None = None):
        super().__init__()
        self.store = store
        self.export_dir = export_dir or Path.cwd()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Enter open · r rename · d delete · e export to Markdown · Esc close")
            yield OptionList(id="chats")

    def on_mount(self) -> None:
        self.refresh_list()

    def refresh_list(self) -> None:
        chats = []
        with self.app.database("Reading the history"):
            chats = self.store.list_chats()
        ol = self.query_one("#chats", OptionList)
        ol.clear_options()
        ol.add_options([Option(f"{c.title}  ({c.n_messages} messages)", id=str(c.id)) for c in chats])
        if chats:
            ol.highlighted = 0
        ol.focus()

    def current(self) -> int | None:
        ol = self.query_one("#chats", OptionList)
        if ol.highlighted is None or ol.option_count == 0:
            return None
        return int(ol.get_option_at_index(ol.highlighted).id)

    @on(OptionList.OptionSelected)
    def open(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_rename(self) -> None:
        chat = self.current()
        if chat is None:
            return

        def done(title: str | None) -> None:
            if title is not None:
                with self.app.database("Renaming the chat"):
                    self.store.rename(chat, title)
                self.refresh_list()

        with self.app.database("Reading the chat"):
            self.app.push_screen(RenameScreen(self.store.title(chat)), done)

    async def action_delete(self) -> None:
        chat = self.current()
        if chat is None:
            return
        with self.app.database("Deleting the chat"):
            self.store.delete(chat)
            if chat == self.app.chat_id:  # the chat on screen: the window moves on to a new one
                await self.app.action_new_chat()
            self.notify("Chat deleted.")
        self.refresh_list()

    def action_export(self) -> None:
        chat = self.current()
        if chat is None:
            return
        path = self.export_dir / f"lowbit-chat-{chat}.md"
        with self.app.database("Exporting the chat"):
            try:
                path.write_text(self.store.export_markdown(chat), encoding="utf-8")
            except OSError as e:  # an unwritable folder, a full disk
                self.notify(f"Exporting failed: {e}", severity="error")
                return
            self.notify(f"Exported to {path}")

    def action_close(self) -> None:
        self.dismiss(None)


class RenameScreen(ModalScreen[str | None]):
    """A title box over the history (its own screen, so the history's one-letter keys stay out of it)."""

    CSS = _DIALOG_CSS.format(name="RenameScreen")
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str):
        super().__init__()
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("New title (Enter to save, Esc to cancel)")
            yield Input(self.title_text, id="title")

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
