"""`lowbit chat [MODEL]`: the Textual chat app (tui/) on the engine's own OpenAI-compatible server,
started in this process on a free loopback port while the app shows a loading indicator; or
`lowbit chat --base-url URL` against any OpenAI-compatible server (llama.cpp, Ollama, vLLM).

The app is an HTTP client and imports nothing of ours; this module is the one place that joins
the two (an import-linter exception in pyproject.toml).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from lowbit.runtime.cli.engine_args import add_engine_args, add_model_args
from lowbit.runtime.cli.offers import add_pool_args
from lowbit.runtime.ports import free_port


KEYS = ("Enter send, Ctrl+J newline, Esc stop, Ctrl+N new chat, Ctrl+R regenerate, Ctrl+L copy reply, "
        "Ctrl+B copy code block, Ctrl+S settings, Ctrl+O history, Ctrl+Q quit")


def add_chat_parser(sub) -> None:
    about = ("A terminal chat app. Without --base-url it loads MODEL and serves it in-process on a free loopback "
             "port; with --base-url it talks to any OpenAI-compatible server. Keys: " + KEYS + ".")
    chat = sub.add_parser("chat", help="chat in the terminal (Textual app), streaming replies", description=about)
    chat.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                      help="alias, .gguf path or HF directory (same as --model)")
    add_model_args(chat)
    add_engine_args(chat)
    add_pool_args(chat)  # the in-process server offers these too: Settings (Ctrl+S) picks among them
    chat.add_argument("--base-url", default=None,
                      help="use this OpenAI-compatible server (its root or its /v1 URL) instead of loading a model here")
    chat.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                      help="Bearer token for --base-url (default: $OPENAI_API_KEY)")
    chat.add_argument("--history", default=None,
                      help="SQLite file of the chat history (default: $LOWBIT_CHAT_DB, else the user data dir)")
    chat.add_argument("--system", default="", help="system prompt of new chats")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    chat.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default 512)")


def start_local_server(args, failure: list) -> tuple[str, tuple]:
    """uvicorn on a free loopback port in a daemon thread; the model loads in another thread (the
    server answers /health 503 meanwhile, which the app shows as loading). → (base URL, (server,
    its thread)): `stop_local_server` ends it."""
    import uvicorn

    from lowbit.runtime.cli.engine_args import check_engine_args, load_served, parse_size
    from lowbit.runtime.cli.offers import open_pool
    from lowbit.runtime.server.app import build_app

    check_engine_args(args)
    kv_memory = parse_size(args.kv_memory)
    app = build_app(None)
    port = free_port()
    # the terminal belongs to the app: the server only logs errors, to a logger the app does not show
    logging.getLogger("uvicorn.error").handlers = [logging.NullHandler()]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", access_log=False))

    def load() -> None:
        try:
            app.state.lowbit.offer(open_pool(args, kv_memory, load_served, progress=False))
        except BaseException as e:  # noqa: BLE001 - shown by the app
            failure.append(e)

    serving = threading.Thread(target=server.run, name="lowbit-server", daemon=True)
    serving.start()
    threading.Thread(target=load, name="lowbit-load", daemon=True).start()
    return f"http://127.0.0.1:{port}/v1", (server, serving)


def stop_local_server(handle) -> None:
    """Shut uvicorn down and wait for it: a process that exits while the server thread is still
    closing its loop aborts ("terminate called without an active exception", exit 134)."""
    server, thread = handle
    server.should_exit = True
    thread.join(timeout=10)


def open_history(store_class, path):
    """The chat store, or one line naming the file when it cannot be opened (a directory in the
    way, no permission, a file that is not SQLite)."""
    import sqlite3

    from lowbit.runtime.errors import LowbitError

    try:
        return store_class(path)
    except (OSError, sqlite3.Error) as e:
        from lowbit.tui.store import default_path

        where = path or default_path()
        raise LowbitError(f"cannot open the chat history {where}: {e} "
                          "(--history or $LOWBIT_CHAT_DB chooses another file)") from None


def cmd_chat(args) -> int:
    from lowbit.runtime.errors import LowbitError

    try:
        from lowbit.tui.app import ChatApp
        from lowbit.tui.client import ChatClient, Settings
        from lowbit.tui.store import ChatStore
    except ImportError as e:
        raise LowbitError(f"`lowbit chat` needs textual ({e})") from None
    if args.max_tokens < 1:
        raise LowbitError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    store = open_history(ChatStore, args.history)  # before a model loads: a bad file fails in an instant
    failure: list[BaseException] = []
    server = None
    if args.base_url:
        from lowbit.runtime.api_url import api_base

        base_url, api_key = api_base(args.base_url), args.api_key
    else:
        base_url, server = start_local_server(args, failure)
        api_key = None
    settings = Settings(system_prompt=args.system, temperature=args.temperature, max_tokens=args.max_tokens)
    app = ChatApp(ChatClient(base_url, api_key), store, settings,
                  startup_error=lambda: (f"{type(failure[0]).__name__}: {failure[0]}" if failure else None))
    try:
        app.run()
    finally:
        store.close()
        if server is not None:
            stop_local_server(server)
    if failure:
        raise LowbitError(f"the model did not load: {failure[0]}")
    if server is not None:
        # The engine's threads hold native state (torch thread pools, the KV pool); letting the
        # interpreter finalize around them aborted the process at exit ("terminate called without an
        # active exception", status 134) in 5 of 5 tries after a chat. Everything worth keeping is
        # written (the history commits per exchange), so leave without finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
