"""The models `lowbit serve` offers on its port (server/model_pool.py): `MODEL`, or `--models M1 M2 ...`,
`--models-dir DIR` and, with either, every model in lowbit's cache and the hub cache (`lowbit models`).

Each offer is named by its file (or directory) name, a cached one as `lowbit models` names it (an alias,
an `hf:` ref) and costs, for the memory budget, its weights' bytes on disk plus the KV
pool the flags give it (--kv-memory; `auto` counts DEFAULT_KV_MEMORY). `--memory` defaults to 80% of what
the device has free at start: room for activations, the page cache and other programs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowbit.runtime.errors import LowbitError

FREE_SHARE = 0.8  # --memory's default: this share of the memory free at start


def add_pool_args(parser) -> None:
    """--models, --models-dir, --memory and --idle-unload (`lowbit serve`, and `lowbit chat`'s own server)."""
    multi = parser.add_argument_group("several models on one port", "Requests name a model (`model`); one not "
                                      "loaded loads on demand, the least recently used idle ones unloading to fit "
                                      "--memory.")
    multi.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                       help="models to offer besides MODEL (the first is the default); with this or --models-dir, "
                            "the models in lowbit's cache and the hub cache are offered too")
    multi.add_argument("--models-dir", default=None, metavar="DIR",
                       help="offer every .gguf file and safetensors directory in DIR")
    multi.add_argument("--memory", default=None, metavar="SIZE",
                       help="the weights + KV caches loaded models may hold (default: 80%% of the free memory at "
                            "start); a model that cannot fit alone is refused with a 400 naming the bytes")
    multi.add_argument("--idle-unload", type=float, default=None, metavar="S",
                       help="unload a model idle for S seconds (default: keep it until evicted; Ollama's "
                            "keep_alive sets it per request)")


def open_pool(args, kv_memory, load_served, progress):
    """The pool of the models the flags offer, its default model loaded (with `progress`, as load_served
    takes it) → ModelPool."""
    from lowbit.runtime.server.model_pool import Loaded, ModelPool

    offers = model_offers(args, kv_memory, load_served)
    pool = ModelPool(offers, memory_budget(args), args.idle_unload)
    pool.loaded[offers[0].name] = Loaded(offers[0].load(progress=progress), offers[0].bytes)
    return pool


def model_offers(args, kv_memory, load_served) -> list:
    """Offers (server/model_pool.py) in order (the first, MODEL or the first --models entry, is the default)."""
    from lowbit.runtime.load.registry import list_models, resolve
    from lowbit.runtime.server.model_pool import Offer

    refs = list(args.models or [])
    if args.model_pos or args.model or not refs and not args.models_dir:
        refs.insert(0, args.model_pos or args.model)
    paths: list[tuple[str, Path]] = []
    for ref in refs:
        try:
            path = resolve(ref)
        except (LowbitError, ValueError, OSError) as e:
            raise LowbitError(f"--models {ref}: {e}") from None
        paths.append((path.name, path))  # as `lowbit serve MODEL` always named it
    if args.models_dir:
        paths += [(p.name, p) for p in _model_files(Path(args.models_dir))]
    if args.models or args.models_dir:  # several models: the caches' too
        paths += [(m.name, Path(m.path)) for m in list_models()]
    offers, seen = [], set()
    for i, (name, path) in enumerate(paths):
        if path.resolve() in seen or any(o.name == name for o in offers):
            continue
        seen.add(path.resolve())
        aliases = tuple(getattr(args, "served_model_name", None) or ()) if i == 0 else ()
        offers.append(Offer(aliases[0] if aliases else name, _loader(args, kv_memory, load_served, path, aliases, i == 0),
                            _bytes(path) + _kv_bytes(kv_memory), aliases[1:]))
    return offers


def memory_budget(args) -> int | None:
    """--memory in bytes: the flag, or FREE_SHARE of the device's free memory (None where unknown)."""
    from lowbit.runtime.cli.engine_args import parse_size
    from lowbit.runtime.load.fits import available_bytes

    if args.memory is not None:
        size = parse_size(args.memory)
        if not isinstance(size, int) or size <= 0:
            raise LowbitError(f"--memory must be a size such as 12GiB, got {args.memory!r}")
        return size
    free = available_bytes("cuda" if str(args.device).startswith("cuda") else "cpu")
    return None if free is None else int(free * FREE_SHARE)


def _loader(args, kv_memory, load_served, path: Path, names: tuple[str, ...], first: bool):
    """→ load(progress=False): the Served of `path` under the serve flags, named `names` (its file name if
    none); quiet when loaded on demand, with the progress bar for the default model at start. A --recipe is
    the first (default) model's: it names that model's tensors."""
    flags = argparse.Namespace(**{**vars(args), "model_pos": str(path), "model": str(path),
                                  "served_model_name": list(names) or [path.name],
                                  "recipe": getattr(args, "recipe", None) if first else None})
    return lambda progress=False: load_served(flags, kv_memory, progress=progress)


def _model_files(folder: Path) -> list[Path]:
    """GGUF files (the first part of a split one) and safetensors directories in `folder`, sorted."""
    if not folder.is_dir():
        raise LowbitError(f"--models-dir {folder}: not a directory")
    out = [p for p in folder.iterdir() if p.suffix == ".gguf" and "-of-" not in p.name or "-00001-of-" in p.name]
    out += [p for p in folder.iterdir() if p.is_dir() and (p / "config.json").is_file()]
    return sorted(out)


def _bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def _kv_bytes(kv_memory) -> int:
    from lowbit.runtime.engine.config import DEFAULT_KV_MEMORY

    return int(kv_memory) if isinstance(kv_memory, int) else DEFAULT_KV_MEMORY
