"""The `lowbit` command: run, chat, serve, bench, eval, pull, models, info.

Every user-facing failure is a LowbitError (or a bad flag value) and ends as one line on stderr
with exit status 1 — never a traceback (set LOWBIT_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import MappingProxyType

from lowbit.runtime.bench_cli import add_bench_parser, cmd_bench
from lowbit.runtime.chat_cli import add_chat_parser, cmd_chat
from lowbit.runtime.engine_args import check_engine_args, load_served, parse_size
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.eval_cli import add_eval_parser, cmd_eval
from lowbit.runtime.registry import DEFAULT_MODEL
from lowbit.runtime.run_cli import cmd_run

WEIGHTS_HELP = ("weight layout: auto (GGUF: keep Q4_0/Q4_1/Q8_0 losslessly, requantize K-quants; "
                "safetensors: int4-g32), int4-g32, int4-g64, int4-g128, int4-sym-g32/64/128, int8, "
                "int8-g32/64/128, bf16, f16, f32, and on CPU bitsandbytes' bnb-nf4, bnb-int8")
SPECULATIVE_HELP = ("speculative decoding: 'ngram,k=4' (prompt lookup: drafts copied from the request's own "
                    "context, n=3 longest suffix), 'draft=MODEL,k=4' (a small model with the same vocabulary) or "
                    "'draft=self:int4-g128,k=4' (a low-bit copy of this model's own weights); greedy replies stay "
                    "exactly the same, sampled ones keep the model's distribution (default: off)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"alias, path to a .gguf, or a Hugging Face model directory (default: {DEFAULT_MODEL})")
    p.add_argument("--weights", default="auto", help=WEIGHTS_HELP)
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when a GPU and Triton are there, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                   help="activation dtype on CUDA (default float16; the CPU path computes in fp32)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: run the model as N processes, each holding a slice of every layer "
                        "(CPU, gloo; the threads are split among them; see docs/tp.md). Default 1")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache", default="k8v4", choices=("f16", "k8v8", "k8v4", "k4v4"),
                   help="KV cache format of the paged engine (default k8v4)")
    p.add_argument("--kv-memory", default="256MiB",
                   help="memory for the KV cache pool: bytes, a size like 512MiB or 2GiB, or on CUDA a share "
                        "of the free GPU memory like 90%% (default 256MiB)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most requests decoded together (default 16)")
    p.add_argument("--ctx-size", type=int, default=None,
                   help="most tokens per request, prompt and reply together (default: the model's context)")
    p.add_argument("--speculative", default=None, metavar="SPEC", help=SPECULATIVE_HELP)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lowbit", description="Quantization-first local LLM runtime.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="answer one prompt, streaming the reply to stdout",
                         description="Render the prompt with the model's chat template, stream the reply "
                                     "to stdout, then print one stats line on stderr.")
    run.add_argument("prompt", nargs="?", help="the user message (read from stdin when omitted)")
    _add_model_args(run)
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    run.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    run.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    run.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    run.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("--fast-greedy", action="store_true",
                     help="with --temperature 0, skip the exact verification of greedy tokens (faster; the fast "
                          "kernels' rounding may then pick the other token of a near-tie)")
    run.add_argument("--kv-cache", default="k8v4", choices=("f16", "k8v8", "k8v4", "k4v4"),
                     help="KV cache format of the paged engine (default k8v4: 8-bit keys, 4-bit values)")
    run.add_argument("--kv-memory", default="256MiB",
                     help="memory for the KV cache pool: bytes, a size like 512MiB or 2GiB, or on CUDA a share "
                          "of the free GPU memory like 90%% (default 256MiB)")
    run.add_argument("--speculative", default=None, metavar="SPEC",
                     help=SPECULATIVE_HELP + "; with --temperature 0 the reply goes through the engine, as with "
                                             "--fast-greedy")

    serve = sub.add_parser("serve", help="serve the model on an OpenAI-compatible HTTP port",
                           description="Load the model and serve /v1/chat/completions, /v1/completions and "
                                       "/v1/models (OpenAI's API) plus /health. Point OpenAI clients at the "
                                       "logged base URL (OPENAI_BASE_URL).")
    serve.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                       help="alias, .gguf path or HF directory (same as --model)")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $LOWBIT_API_KEY; none when unset)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send and /v1/models lists (default: the model's file name)")
    _add_engine_args(serve)
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="log level (default info)")

    add_bench_parser(sub)
    add_chat_parser(sub, _add_model_args, _add_engine_args)
    add_eval_parser(sub)

    pull = sub.add_parser("pull", help="download a model into the model cache",
                          description="Fetch a model by alias and verify its sha256. The cache is "
                                      "$LOWBIT_MODELS or the user cache directory.")
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"alias (default: {DEFAULT_MODEL})")

    sub.add_parser("models", help="list cached models with format and size",
                   description="List the models in the model cache ($LOWBIT_MODELS or the user cache dir).")

    info = sub.add_parser("info", help="show a model's config, layouts and memory",
                          description="Load a model and print its architecture, weight layouts and bytes held.")
    info.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="alias, .gguf path or HF directory")
    info.add_argument("--weights", default="auto", help=WEIGHTS_HELP)
    info.add_argument("--device", default="cpu", help="where to load it: cpu (default), cuda or cuda:N")
    info.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"), help="activation dtype on CUDA")
    return ap


def cmd_serve(args) -> int:
    import logging
    import threading

    try:
        import uvicorn

        from lowbit.runtime.server import build_app
    except ImportError as e:
        raise LowbitError(f"`lowbit serve` needs fastapi and uvicorn ({e})") from None
    if not 0 < args.port < 65536:
        raise LowbitError(f"--port must be in 1..65535, got {args.port}")
    check_engine_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lowbit.server")
    kv_memory = parse_size(args.kv_memory)
    api_key = args.api_key if args.api_key is not None else (os.environ.get("LOWBIT_API_KEY") or None)
    app = build_app(None, api_key)  # answers 503 (GET /health too) until the model is loaded
    url = f"http://{args.host if ':' not in args.host else '[' + args.host + ']'}:{args.port}/v1"
    failure: list[BaseException] = []

    def load_and_serve(server: uvicorn.Server) -> None:
        try:
            served = load_served(args, kv_memory)
            app.state.lowbit.ready(served)
            log.info("serving %s at %s (export OPENAI_BASE_URL=%s)%s", served.model_name, url, url,
                     "" if api_key else "; no API key required")
        except BaseException as e:  # noqa: BLE001 - reported by cmd_serve once uvicorn has stopped
            failure.append(e)
            server.should_exit = True

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # the port is ours: load now, answering /health with 503 meanwhile
                log.info("loading the model; %s/health answers 503 until it is ready", url.removesuffix("/v1"))
                threading.Thread(target=load_and_serve, args=(self,), name="lowbit-load", daemon=True).start()

    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run()
    if failure:
        e = failure[0]
        if isinstance(e, LowbitError):
            raise e
        raise LowbitError(str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}") from e
    if not server.started:
        raise LowbitError(f"could not listen on {args.host}:{args.port} (is the port in use?)")
    return 0


def cmd_pull(args) -> int:
    from lowbit.runtime.registry import pull

    path = pull(args.model, progress=lambda s: print(f"lowbit: {s}", file=sys.stderr))
    print(path)
    return 0


def cmd_models(args) -> int:
    from lowbit.runtime.registry import list_models, models_dir

    rows = list_models()
    if not rows:
        print(f"no models in {models_dir()} (run: lowbit pull)", file=sys.stderr)
        return 0
    print(f"{'NAME':<24} {'FORMAT':<12} {'SIZE':>10}  PATH")
    for m in rows:
        print(f"{m.name:<24} {m.format:<12} {m.size / 1e6:>8.1f}MB  {m.path}")
    return 0


def cmd_info(args) -> int:
    from lowbit.runtime.loader import load

    lm = load(args.model, args.weights, device=args.device, dtype=args.dtype)
    c = lm.config
    layouts = sorted({m.spec_name for m in lm.model.modules() if hasattr(m, "spec_name")})
    print(f"path: {lm.path}\nformat: {lm.source}\narchitecture: {c.arch}\n"
          f"layers {c.n_layers}, dim {c.dim}, heads {c.n_heads}/{c.n_kv_heads} (q/kv), head_dim {c.head_dim}, "
          f"hidden {c.hidden_dim}, vocab {c.vocab_size}, context {c.max_seq_len}, tied embeddings {c.tie_embeddings}\n"
          f"weights: {lm.weights} (layouts: {', '.join(layouts)})\n"
          f"device: {lm.model.device} ({lm.model.backend.name} kernels)\n"
          f"bytes held by weight tensors: {lm.weight_bytes:,}\nload time: {lm.load_seconds:.2f} s")
    return 0


COMMANDS = MappingProxyType({"run": cmd_run, "serve": cmd_serve, "chat": cmd_chat, "bench": cmd_bench, "eval": cmd_eval, "pull": cmd_pull,
                             "models": cmd_models, "info": cmd_info})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        threads = getattr(args, "threads", None)
        if threads is not None:
            if threads < 1:
                raise LowbitError(f"--threads must be >= 1, got {threads}")
            import torch

            torch.set_num_threads(threads)
        return COMMANDS[args.command](args)
    except LowbitError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not a user error: still one line unless asked for more
        if os.environ.get("LOWBIT_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        print(f"lowbit: internal error: {type(e).__name__}: {msg} (LOWBIT_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
