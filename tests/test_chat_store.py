"""The chat history file shared by several app windows (tui/store.py): each ChatStore is one
window's own sqlite connection, as two `lowbit chat` processes would have."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import pytest

from lowbit.tui.store import SCHEMA_VERSION, ChatDeleted, ChatStore, Message

# The first layout (schema version 0): files written by it must still open, chats and all.
_V0_SCHEMA = """
CREATE TABLE chats (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (chat_id, seq));
"""


def contents(msgs: list[Message]) -> list[str]:
    return [m.content for m in msgs]


def test_wal_mode_and_a_busy_timeout(tmp_path):
    store = ChatStore(tmp_path / "c.db")
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA busy_timeout").fetchone()[0] == 2000
    other = sqlite3.connect(tmp_path / "c.db")  # WAL is a property of the file, every connection sees it
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_two_windows_adding_to_one_chat_lose_nothing(tmp_path):
    a, b = ChatStore(tmp_path / "c.db"), ChatStore(tmp_path / "c.db")
    mine = [Message("user", "q1"), Message("assistant", "r1")]
    chat = a.new_chat("shared")
    a.save_messages(chat, mine)
    theirs = b.messages(chat)
    assert contents(theirs) == ["q1", "r1"]
    mine += [Message("user", "a asks")]
    a.save_messages(chat, mine)
    theirs += [Message("user", "b asks")]
    b.save_messages(chat, theirs)  # B never saw "a asks": it stays
    mine += [Message("assistant", "a answer")]
    a.save_messages(chat, mine)  # A never saw "b asks": it stays
    theirs += [Message("assistant", "b answer")]
    b.save_messages(chat, theirs)
    fresh = ChatStore(tmp_path / "c.db").messages(chat)
    assert contents(fresh) == ["q1", "r1", "a asks", "b asks", "a answer", "b answer"]  # in the order written
    assert [m.id for m in fresh] == [m.id for m in ChatStore(tmp_path / "c.db").messages(chat)]  # stable ids
    assert [c.n_messages for c in a.list_chats()] == [6]


def test_a_regenerated_reply_replaces_the_last_and_stays_replaced(tmp_path):
    a, b = ChatStore(tmp_path / "c.db"), ChatStore(tmp_path / "c.db")
    mine = [Message("user", "q"), Message("assistant", "first")]
    chat = a.save_messages(None, mine)
    theirs = b.load(chat)
    mine[-1] = Message("assistant", "second")
    a.save_messages(chat, mine)
    assert contents(a.messages(chat)) == ["q", "second"]
    theirs.append(Message("user", "more"))  # B still shows "first"; saving must not bring it back
    b.save_messages(chat, theirs)
    assert contents(a.messages(chat)) == ["q", "second", "more"]


def test_a_stopped_reply_and_settings_are_kept(tmp_path):
    store = ChatStore(tmp_path / "c.db")
    msgs = [Message("user", "q"), Message("assistant", "part", stopped=True)]
    chat = store.save_messages(None, msgs, {"temperature": 0.2}, title="t")
    again = ChatStore(tmp_path / "c.db")
    assert again.messages(chat) == msgs and again.messages(chat)[1].stopped
    assert again.settings(chat) == {"temperature": 0.2} and again.title(chat) == "t"


def test_saving_a_chat_deleted_elsewhere_raises_chat_deleted(tmp_path):
    a, b = ChatStore(tmp_path / "c.db"), ChatStore(tmp_path / "c.db")
    msgs = [Message("user", "q")]
    chat = a.new_chat()
    a.save_messages(chat, msgs)
    b.delete(chat)
    msgs.append(Message("assistant", "r"))
    with pytest.raises(ChatDeleted) as e:  # not sqlite3.IntegrityError (a foreign key), and nothing written
        a.save_messages(chat, msgs)
    assert e.value.chat_id == chat
    assert a.list_chats() == [] and a.messages(chat) == []
    assert not isinstance(e.value, sqlite3.Error)


def test_a_lock_held_past_the_busy_timeout_fails_the_save_and_a_later_one_succeeds(tmp_path):
    store = ChatStore(tmp_path / "c.db", busy_timeout=0.2)
    msgs = [Message("user", "q")]
    chat = store.new_chat()
    store.save_messages(chat, msgs)
    holder = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    msgs.append(Message("assistant", "r"))
    t = time.perf_counter()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store.save_messages(chat, msgs)
    assert 0.15 < time.perf_counter() - t < 2.0  # waited the busy timeout, not the old 5 s default
    assert not store.db.in_transaction
    assert contents(store.messages(chat)) == ["q"]  # WAL: reading is not blocked by the writer
    holder.execute("COMMIT")
    store.save_messages(chat, msgs)
    assert contents(ChatStore(tmp_path / "c.db").messages(chat)) == ["q", "r"]


def test_a_file_of_the_first_schema_opens_and_its_chats_load(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(_V0_SCHEMA)
    old.execute("INSERT INTO chats (title, settings, created, updated) VALUES ('old chat', '{\"top_p\": 0.5}', 1, 2)")
    old.executemany("INSERT INTO messages (chat_id, seq, role, content, stopped) VALUES (1, ?, ?, ?, ?)",
                    [(0, "user", "hello", 0), (1, "assistant", "hi", 0), (2, "user", "more", 0),
                     (3, "assistant", "cut", 1)])
    old.commit()
    old.close()

    store = ChatStore(path)
    assert store.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert [(c.title, c.n_messages) for c in store.list_chats()] == [("old chat", 4)]
    msgs = store.load(1)
    assert [(m.role, m.content, m.stopped) for m in msgs] == [
        ("user", "hello", False), ("assistant", "hi", False), ("user", "more", False), ("assistant", "cut", True)]
    assert store.settings(1) == {"top_p": 0.5}
    assert len({m.id for m in msgs}) == 4
    msgs.append(Message("user", "new"))
    store.save_messages(1, msgs)
    reopened = ChatStore(path)  # a second open neither migrates again nor changes the ids
    assert contents(reopened.messages(1)) == ["hello", "hi", "more", "cut", "new"]
    assert [m.id for m in reopened.messages(1)] == [m.id for m in msgs]


# One app process: asks N questions in the shared chat, saving after each prompt and after each reply.
_WINDOW = """
import sys
from lowbit.tui.store import ChatStore, Message
path, chat, name, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = ChatStore(path)
msgs = store.messages(chat)
for i in range(n):
    for role in ("user", "assistant"):
        msgs.append(Message(role, f"{name} {role} {i}"))
        store.save_messages(chat, msgs)
"""


def test_several_processes_writing_one_chat_lose_nothing(tmp_path):
    path = tmp_path / "c.db"
    first = ChatStore(path)
    chat = first.new_chat()
    first.save_messages(chat, [Message("user", "start")])
    names, n = ["p0", "p1", "p2"], 15
    procs = [subprocess.Popen([sys.executable, "-c", _WINDOW, str(path), str(chat), name, str(n)],
                              stderr=subprocess.PIPE, text=True) for name in names]
    errs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    got = contents(ChatStore(path).messages(chat))
    assert len(got) == 1 + len(names) * n * 2 and got[0] == "start"
    for name in names:  # every process's messages, each in the order it wrote them
        assert [c for c in got if c.startswith(name + " ")] == [
            f"{name} {role} {i}" for i in range(n) for role in ("user", "assistant")]


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.mkdir(), "unable to open database file"),  # a directory where the file should be
    (lambda p: p.write_bytes(b"not a database\n" * 100), "file is not a database"),
], ids=["a-directory", "not-sqlite"])
def test_lowbit_chat_with_an_unusable_history_file_is_one_line(tmp_path, make, needle):
    """`lowbit chat` (the real CLI, in a subprocess) stops before it loads a model or starts the app:
    one line naming the file, exit 1, no traceback."""
    path = tmp_path / "chats.sqlite3"
    make(path)
    r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "chat", "--history", str(path),
                        "--base-url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == "", r
    line = r.stderr.rstrip("\n")
    assert "\n" not in line and "Traceback" not in line, r.stderr
    assert line.startswith(f"lowbit: error: cannot open the chat history {path}: ") and needle in line, line
