"""Chat history in SQLite: chats (title, settings, times) and their messages, in the user data
directory (platformdirs; `LOWBIT_CHAT_DB` or `lowbit chat --history FILE` overrides). Every write
commits at once, so a crash loses nothing already shown."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0,  -- 1: generation stopped by the user (Esc), reply partial
    PRIMARY KEY (chat_id, seq)
);
"""


def default_path() -> Path:
    if os.environ.get("LOWBIT_CHAT_DB"):
        return Path(os.environ["LOWBIT_CHAT_DB"])
    from platformdirs import user_data_dir

    return Path(user_data_dir("lowbit")) / "chats.sqlite3"


@dataclass
class ChatInfo:
    id: int
    title: str
    updated: float
    n_messages: int


@dataclass
class Message:
    role: str  # system | user | assistant
    content: str
    stopped: bool = False


class ChatStore:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def new_chat(self, title: str = "New chat", settings: dict | None = None) -> int:
        now = time.time()
        cur = self.db.execute("INSERT INTO chats (title, settings, created, updated) VALUES (?, ?, ?, ?)",
                              (title, json.dumps(settings or {}), now, now))
        self.db.commit()
        return cur.lastrowid

    def list_chats(self) -> list[ChatInfo]:
        rows = self.db.execute("SELECT c.id, c.title, c.updated, COUNT(m.seq) FROM chats c LEFT JOIN messages m "
                               "ON m.chat_id = c.id GROUP BY c.id ORDER BY c.updated DESC").fetchall()
        return [ChatInfo(*r) for r in rows]

    def messages(self, chat_id: int) -> list[Message]:
        rows = self.db.execute("SELECT role, content, stopped FROM messages WHERE chat_id = ? ORDER BY seq",
                               (chat_id,)).fetchall()
        return [Message(r, c, bool(s)) for r, c, s in rows]

    def settings(self, chat_id: int) -> dict:
        row = self.db.execute("SELECT settings FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def title(self, chat_id: int) -> str:
        row = self.db.execute("SELECT title FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return row[0] if row else ""

    def save_messages(self, chat_id: int, messages: list[Message], settings: dict | None = None) -> None:
        """Replace the chat's messages (a regenerated reply replaces the last one)."""
        with self.db:
            self.db.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
            self.db.executemany("INSERT INTO messages (chat_id, seq, role, content, stopped) VALUES (?, ?, ?, ?, ?)",
                                [(chat_id, i, m.role, m.content, int(m.stopped)) for i, m in enumerate(messages)])
            if settings is not None:
                self.db.execute("UPDATE chats SET settings = ? WHERE id = ?", (json.dumps(settings), chat_id))
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (time.time(), chat_id))

    def rename(self, chat_id: int, title: str) -> None:
        with self.db:
            self.db.execute("UPDATE chats SET title = ? WHERE id = ?", (title.strip() or "Untitled", chat_id))

    def delete(self, chat_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    def export_markdown(self, chat_id: int) -> str:
        lines = [f"# {self.title(chat_id)}", ""]
        for m in self.messages(chat_id):
            if m.role == "system":
                lines += ["**System:**", "", m.content, ""]
            else:
                who = "You" if m.role == "user" else "Assistant"
                lines += [f"## {who}", "", m.content + (" *(stopped)*" if m.stopped else ""), ""]
        return "\n".join(lines).rstrip() + "\n"
