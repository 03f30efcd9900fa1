"""`lowbit serve`: the OpenAI-compatible HTTP port, answering 503 until the model is loaded."""

from __future__ import annotations

import errno
import os

from lowbit.runtime.cli.offers import add_pool_args
from lowbit.runtime.cli.engine_args import (add_engine_args, add_model_args, add_sampling_args, check_engine_args,
                                            load_served, parse_size)
from lowbit.runtime.errors import LowbitError


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model on an OpenAI-compatible HTTP port",
                           description="Load the model and serve OpenAI's API (/v1/chat/completions with tools "
                                       "and reasoning, /v1/completions, /v1/responses, /v1/embeddings, "
                                       "/v1/models), /tokenize, /detokenize, /health, /metrics, and Ollama's "
                                       "/api/* on the same port. Point OpenAI clients at the logged base URL "
                                       "(OPENAI_BASE_URL), Ollama clients at OLLAMA_HOST (e.g. --port 11434).")
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                       help="alias, .gguf path or HF directory (same as --model)")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $LOWBIT_API_KEY; none when unset)")
    serve.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                       help="the model id clients send and /v1/models lists; more names are aliases of it "
                            "(default: the model's file name)")
    serve.add_argument("--pooling", default="mean", choices=("mean", "last"),
                       help="/v1/embeddings: mean of the final hidden states over the text's tokens, or the "
                            "last token's (default mean)")
    serve.add_argument("--cors-origins", default=None, metavar="ORIGINS",
                       help="comma-separated origins a browser page may call the port from, or * for any "
                            "(default: http(s)://localhost and 127.0.0.1 on any port)")
    serve.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                       help="comma-separated Host names the server answers besides this machine's own, or * for "
                            "any (default: bound to loopback, only localhost and loopback addresses — a guard "
                            "against DNS rebinding; bound beyond loopback, any)")
    serve.add_argument("--max-body", default="8MiB", metavar="SIZE",
                       help="largest request body; larger ones get a 413 before they are read (default 8MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                       help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are "
                            "stopped with an error (new requests get 503 meanwhile; a second signal stops "
                            "them at once; default 10)")
    add_engine_args(serve)
    add_pool_args(serve)
    add_sampling_args(serve, "OpenAI's temperature 1, top-p 1; a request's own values win over all")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="log level (default info)")


def cors_origins(text: str | None) -> list[str] | None:
    """--cors-origins → the origins (None: the default, this machine's pages); one-line errors."""
    if text is None:
        return None
    origins = [o.strip().rstrip("/") for o in text.split(",") if o.strip()]
    for o in origins:
        if o != "*" and not (o.startswith(("http://", "https://")) and len(o.split("/")) == 3):
            raise LowbitError(f"--cors-origins: {o!r} is not an origin (scheme://host[:port], or *)")
    if not origins:
        raise LowbitError("--cors-origins is empty; give origins or *")
    return origins


def bind(host: str, port: int):
    """The listening socket, bound here so that a taken port or a bad address is one lowbit line
    (uvicorn would log its own and exit with status 3)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LowbitError(f"--host {host!r} is not an address of this machine: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = " (is another server running on it? choose another with --port)" if e.errno == errno.EADDRINUSE else ""
        raise LowbitError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def cmd_serve(args) -> int:
    import logging
    import threading
    import time

    try:
        import uvicorn

        from lowbit.runtime.cli.offers import open_pool
        from lowbit.runtime.server.app import build_app
        from lowbit.runtime.server.drain import Drain
        from lowbit.runtime.server.guard import is_loopback
    except ImportError as e:
        raise LowbitError(f"`lowbit serve` needs fastapi and uvicorn ({e})") from None
    if not 0 < args.port < 65536:
        raise LowbitError(f"--port must be in 1..65535, got {args.port}")
    check_engine_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lowbit.server")
    kv_memory = parse_size(args.kv_memory)
    api_key = args.api_key if args.api_key is not None else (os.environ.get("LOWBIT_API_KEY") or None)
    hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts else None
    max_body = parse_size(args.max_body)
    if not isinstance(max_body, int) or max_body < 1024:
        raise LowbitError(f"--max-body must be a size of at least 1KiB, got {args.max_body!r}")
    if args.shutdown_timeout < 0:
        raise LowbitError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    sock = bind(args.host, args.port)  # a taken port is one line here, before the model loads
    if not is_loopback(args.host) and api_key is None:
        log.warning("serving on %s beyond this machine with no API key: anyone who can reach the port can use "
                    "it (set --api-key or $LOWBIT_API_KEY)", args.host)
    app = build_app(None, api_key, cors_origins(args.cors_origins), bind_host=args.host, allowed_hosts=hosts,
                    max_body=max_body)  # answers 503 until the model is loaded
    drain = Drain(app)
    url = f"http://{args.host if ':' not in args.host else '[' + args.host + ']'}:{args.port}/v1"
    failure: list[BaseException] = []

    def load_and_serve(server: uvicorn.Server) -> None:
        try:
            pool = open_pool(args, kv_memory, load_served, progress=None)
            app.state.lowbit.offer(pool)
            served = pool.loaded_default()
            if len(pool.offers) > 1:
                names = list(pool.offers)
                log.info("offering %d models (%s); loaded: %s", len(names), ", ".join(names[:8])
                         + (", ..." if len(names) > 8 else ""), names[0])
            log.info("serving %s at %s (export OPENAI_BASE_URL=%s; Ollama clients: OLLAMA_HOST=%s)%s",
                     served.model_name, url, url, url.removesuffix("/v1"), "" if api_key else "; no API key required")
        except BaseException as e:  # noqa: BLE001 - reported by cmd_serve once uvicorn has stopped
            failure.append(e)
            server.should_exit = True

    class _Server(uvicorn.Server):
        """uvicorn's server, stopping gracefully: the first SIGTERM/SIGINT drains (503 to new requests,
        running ones finish for up to --shutdown-timeout s, then end with an error event and
        [DONE]); a second one ends them at once. The process then exits 0, the signal handled."""

        stopping = False

        def handle_exit(self, sig, frame):
            if self.stopping:
                stop_now.set()
                return
            self.stopping, drain.draining = True, True
            log.info("shutting down: %d request(s) running get up to %g s to finish (signal again to stop now)",
                     drain.in_flight, args.shutdown_timeout)
            threading.Thread(target=self.drain_and_exit, name="lowbit-drain", daemon=True).start()

        def drain_and_exit(self):
            deadline = time.monotonic() + args.shutdown_timeout
            while drain.in_flight and time.monotonic() < deadline and not stop_now.is_set():
                time.sleep(0.05)
            pool = app.state.lowbit.pool
            if drain.in_flight and pool is not None:
                stopped = sum(held.served.engine.shutdown() for held in list(pool.loaded.values()))
                log.info("stopping %d running request(s)", stopped)
                deadline = time.monotonic() + 2  # their error events written
                while drain.in_flight and time.monotonic() < deadline:
                    time.sleep(0.02)
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # the port is ours: load now, answering /health with 503 meanwhile
                log.info("loading the model; %s/health answers 503 until it is ready", url.removesuffix("/v1"))
                threading.Thread(target=load_and_serve, args=(self,), name="lowbit-load", daemon=True).start()

    stop_now = threading.Event()
    server = _Server(uvicorn.Config(drain, host=args.host, port=args.port, log_level=args.log_level))
    server.run(sockets=[sock])
    if failure:
        e = failure[0]
        if isinstance(e, LowbitError):
            raise e
        raise LowbitError(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}") from e
    if not server.started:
        raise LowbitError(f"could not listen on {args.host}:{args.port} (is the port in use?)")
    return 0
