"""The `lowbit` command: run, chat, serve, bench, eval, fit, quantize, pull, models, info (one file each under cli/).

Every user-facing failure is a LowbitError (or a bad flag value) and ends as one line on stderr
with exit status 1 — never a traceback (set LOWBIT_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import MappingProxyType

from lowbit.runtime.cli.bench import add_bench_parser, cmd_bench
from lowbit.runtime.cli.chat import add_chat_parser, cmd_chat
from lowbit.runtime.cli.eval import add_eval_parser, cmd_eval
from lowbit.runtime.cli.fit import add_fit_parser, cmd_fit
from lowbit.runtime.cli.models import add_models_parsers, cmd_info, cmd_models, cmd_pull
from lowbit.runtime.cli.quantize import add_quantize_parser, cmd_quantize
from lowbit.runtime.cli.run import add_run_parser, cmd_run
from lowbit.runtime.cli.serve import add_serve_parser, cmd_serve
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.version import lowbit_version


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lowbit", description="Quantization-first local LLM runtime.")
    ap.add_argument("--version", action="version", version=f"lowbit {lowbit_version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    add_run_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_chat_parser(sub)
    add_eval_parser(sub)
    add_fit_parser(sub)
    add_quantize_parser(sub)
    add_models_parsers(sub)
    return ap


COMMANDS = MappingProxyType({"run": cmd_run, "serve": cmd_serve, "chat": cmd_chat, "bench": cmd_bench,
                             "eval": cmd_eval, "fit": cmd_fit, "quantize": cmd_quantize, "pull": cmd_pull,
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
