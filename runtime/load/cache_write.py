"""A model cache that cannot be written (read-only, a file where a directory should be, a full disk)
→ one line that names the directory, the cause and the setting that moves the cache.

A pull writes under lowbit's cache ($LOWBIT_MODELS, registry.py) or huggingface_hub's (HF_HUB_CACHE /
HF_HOME, hub.py). The OSError that mkdir or write raises there is the user's to fix, not a bug, so it
must not reach the CLI as an "internal error".
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lowbit.runtime.errors import LowbitError

# A full disk or quota: write() raises these without a file name, so they are the cache's by errno alone.
_FULL = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
_DISK_WIDE = _FULL | {errno.EROFS}


def _where(e: OSError, cache: Path) -> Path | None:
    """The path e names when it is the cache, inside it or one of its parents (mkdir(parents=True)
    fails on the first parent it cannot create); None when e is about some other file."""
    for name in (e.filename, e.filename2):
        if name is None or isinstance(name, int):  # an fd, not a path
            continue
        p = Path(os.path.abspath(os.fsdecode(name)))
        if p == cache or cache in p.parents or p in cache.parents:
            return p
    return None


def _file_in_the_way(path: Path) -> Path | None:
    """The first of path and its parents that exists and is not a directory."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def is_cache_write_error(e: OSError, cache: Path) -> bool:
    cache = Path(os.path.abspath(cache))
    return e.errno in _DISK_WIDE or _where(e, cache) is not None


def cache_write_error(e: OSError, cache: Path, setting: str) -> LowbitError:
    """The one line for e; setting: the env var(s) that move the cache."""
    cache = Path(os.path.abspath(cache))
    cause = e.strerror or type(e).__name__
    where = _where(e, cache)
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and where is not None:
        blocker = _file_in_the_way(where)
        if blocker is not None:  # mkdir names the directory it wanted, not the file that stopped it
            cause = f"{blocker} is a file, not a directory"
    elif where is not None and where in cache.parents:
        cause += f" at {where}"  # the cache itself does not exist yet: say which parent stopped it
    fix = (f"free space there, or set {setting} to a directory on another disk" if e.errno in _FULL
           else f"set {setting} to a writable directory")
    return LowbitError(f"cannot write the model cache {cache}: {cause} ({fix})")


@contextmanager
def cache_writes(cache: Path, setting: str) -> Iterator[None]:
    """OSErrors of writing into `cache` become cache_write_error; any other OSError passes through."""
    try:
        yield
    except OSError as e:
        if not is_cache_write_error(e, cache):
            raise
        raise cache_write_error(e, cache, setting) from None
