"""Chat history in SQLite: chats (title, settings, times) and their messages, in the user data
directory (platformdirs; `LOWBIT_CHAT_DB` or `lowbit chat --history FILE` overrides).

Several app windows may have one file, even one chat, open at once (each is a ChatStore, its own
connection). So the file is in WAL mode (readers never wait for a writer), every write takes the
write lock up front (BEGIN IMMEDIATE) and commits at once, and a save merges instead of replacing:
each message carries a stable id, and a save inserts this window's new messages, updates the ones it
wrote or loaded, deletes the ones it dropped (a regenerated reply), and leaves alone every row it
never knew (another window's) or knew but no longer finds (deleted by another window)."""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1  # PRAGMA user_version; 0 is the first layout, messages keyed by (chat_id, seq) alone

_CHATS = """CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
)"""
_MESSAGES = """CREATE TABLE {name} (
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    id TEXT NOT NULL,  -- uuid4 hex, made with the message: the key a merge matches on
    seq INTEGER NOT NULL,  -- the order shown: MAX + 1 when first written, under the write lock
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0,  -- 1: generation stopped by the user (Esc), reply partial
    PRIMARY KEY (chat_id, id),
    UNIQUE (chat_id, seq)
)"""


def default_path() -> Path:
    if os.environ.get("LOWBIT_CHAT_DB"):
        return Path(os.environ["LOWBIT_CHAT_DB"])
    from platformdirs import user_data_dir

    return Path(user_data_dir("lowbit")) / "chats.sqlite3"


class ChatDeleted(LookupError):
    """The chat being saved is gone (deleted in another window); nothing was written."""

    def __init__(self, chat_id: int):
        super().__init__(f"chat {chat_id} no longer exists")
        self.chat_id = chat_id


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
    # identity, not content: two messages with the same words are equal, yet stored as two rows
    id: str = field(default_factory=lambda: uuid.uuid4().hex, compare=False)


class ChatStore:
    def __init__(self, path: str | Path | None = None, busy_timeout: float = 2.0):
        """busy_timeout: seconds a write waits for another window's lock before "database is locked".
        A save of a 120-message chat holds the lock ~1 ms, so 2 s outlasts any honest holder many times
        over while bounding how long a stuck one freezes the app (store calls run on its event loop)."""
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; _write() opens each one explicitly
        self.db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        self.db.execute("PRAGMA journal_mode = WAL")  # persistent in the file; a no-op once set
        self.db.execute("PRAGMA foreign_keys = ON")
        # chat id -> ids of the messages this connection wrote or loaded: the base a save merges against
        self._known: dict[int, set[str]] = {}
        if self.db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:  # else opening writes nothing,
            with self._write():  # so it does not wait on another window's lock
                self.db.execute(_CHATS)
                self._migrate()

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One write transaction. IMMEDIATE takes the write lock at BEGIN, where the busy timeout
        applies; a deferred one upgrading later can fail at once with SQLITE_BUSY in WAL mode."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # a failed COMMIT leaves the transaction open
                self.db.execute("ROLLBACK")
            raise

    def _migrate(self) -> None:
        """Bring the file to SCHEMA_VERSION. Runs inside the write lock, so of two windows opening an
        old file at once the second finds it already done."""
        cols = [r[1] for r in self.db.execute("PRAGMA table_info(messages)")]
        if not cols:
            self.db.execute(_MESSAGES.format(name="messages"))
        elif "id" not in cols:  # version 0: give every row an id, keep its seq (the order it had)
            self.db.execute(_MESSAGES.format(name="messages_v1"))
            self.db.execute("INSERT INTO messages_v1 (chat_id, id, seq, role, content, stopped) "
                            "SELECT chat_id, lower(hex(randomblob(16))), seq, role, content, stopped FROM messages")
            self.db.execute("DROP TABLE messages")
            self.db.execute("ALTER TABLE messages_v1 RENAME TO messages")
        self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def new_chat(self, title: str = "New chat", settings: dict | None = None) -> int:
        with self._write():
            return self._insert_chat(title, settings)

    def _insert_chat(self, title: str, settings: dict | None) -> int:
        now = time.time()
        cur = self.db.execute("INSERT INTO chats (title, settings, created, updated) VALUES (?, ?, ?, ?)",
                              (title, json.dumps(settings or {}), now, now))
        return cur.lastrowid

    def list_chats(self) -> list[ChatInfo]:
        rows = self.db.execute("SELECT c.id, c.title, c.updated, COUNT(m.id) FROM chats c LEFT JOIN messages m "
                               "ON m.chat_id = c.id GROUP BY c.id ORDER BY c.updated DESC").fetchall()
        return [ChatInfo(*r) for r in rows]

    def messages(self, chat_id: int) -> list[Message]:
        """The chat as stored now, every window's messages in the order they were first written."""
        rows = self.db.execute("SELECT role, content, stopped, id FROM messages WHERE chat_id = ? ORDER BY seq",
                               (chat_id,)).fetchall()
        return [Message(r, c, bool(s), i) for r, c, s, i in rows]

    def load(self, chat_id: int) -> list[Message]:
        """messages() for a window that opens the chat: later saves merge against what it saw."""
        msgs = self.messages(chat_id)
        self._known[chat_id] = {m.id for m in msgs}
        return msgs

    def settings(self, chat_id: int) -> dict:
        row = self.db.execute("SELECT settings FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def title(self, chat_id: int) -> str:
        row = self.db.execute("SELECT title FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return row[0] if row else ""

    def save_messages(self, chat_id: int | None, messages: list[Message], settings: dict | None = None,
                      title: str = "New chat") -> int:
        """Merge this window's view of the chat into the file and return the chat's id; chat_id None
        makes the chat (titled `title`) in the same transaction, so a failed save leaves no empty
        chat behind. Raises ChatDeleted if chat_id is gone.

        Against `_known` (what this connection wrote or loaded): a message it never knew is inserted at
        the end; one it knew is updated, or skipped if another window deleted it (not brought back);
        one it knew that `messages` no longer has is deleted (a regenerated reply replaces the last
        one). Rows it never knew are another window's and stay."""
        base = self._known.get(chat_id, set()) if chat_id is not None else set()
        ids = {m.id for m in messages}
        with self._write():
            if chat_id is None:
                chat_id = self._insert_chat(title, settings)
            elif self.db.execute("SELECT 1 FROM chats WHERE id = ?", (chat_id,)).fetchone() is None:
                raise ChatDeleted(chat_id)
            stored = {r[0] for r in self.db.execute("SELECT id FROM messages WHERE chat_id = ?", (chat_id,))}
            seq = self.db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE chat_id = ?",
                                  (chat_id,)).fetchone()[0]
            for m in messages:
                if m.id in stored:
                    self.db.execute("UPDATE messages SET role = ?, content = ?, stopped = ? WHERE chat_id = ? "
                                    "AND id = ?", (m.role, m.content, int(m.stopped), chat_id, m.id))
                elif m.id not in base:  # new here; one in base but not stored was deleted elsewhere
                    self.db.execute("INSERT INTO messages (chat_id, id, seq, role, content, stopped) VALUES "
                                    "(?, ?, ?, ?, ?, ?)", (chat_id, m.id, seq, m.role, m.content, int(m.stopped)))
                    seq += 1
            self.db.executemany("DELETE FROM messages WHERE chat_id = ? AND id = ?",
                                [(chat_id, i) for i in (base - ids) & stored])
            if settings is not None:
                self.db.execute("UPDATE chats SET settings = ? WHERE id = ?", (json.dumps(settings), chat_id))
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (time.time(), chat_id))
        self._known[chat_id] = ids  # only once committed: a failed save leaves the base as it was
        return chat_id

    def rename(self, chat_id: int, title: str) -> None:
        with self._write():
            self.db.execute("UPDATE chats SET title = ? WHERE id = ?", (title.strip() or "Untitled", chat_id))

    def delete(self, chat_id: int) -> None:
        with self._write():
            self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))
        self._known.pop(chat_id, None)

    def export_markdown(self, chat_id: int) -> str:
        lines = [f"# {self.title(chat_id)}", ""]
        for m in self.messages(chat_id):
            if m.role == "system":
                lines += ["**System:**", "", m.content, ""]
            else:
                who = "You" if m.role == "user" else "Assistant"
                lines += [f"## {who}", "", m.content + (" *(stopped)*" if m.stopped else ""), ""]
        return "\n".join(lines).rstrip() + "\n"
