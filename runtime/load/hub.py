"""`hf:ORG/REPO[:QUANT]`: a model on the Hugging Face hub, pulled into the huggingface_hub cache.

runtime/load/hub_ref.py parses the reference and picks the repo's files (a GGUF by its quant token,
default Q4_K_M; or config, tokenizer files and shards of a safetensors repo, which lowbit quantizes
at load); this module finds them in the cache or downloads them. Files land in the standard cache (HF_HOME / HF_HUB_CACHE), so `hf:` refs resolve offline
afterwards and other tools share the download.

Resuming: huggingface_hub >= 1.x downloads into a process-unique `<etag>.<uuid>.incomplete` file and
deletes it on failure, so an interrupted multi-GB pull starts over. lowbit fills the cache blob
itself first, appending to `blobs/<etag>.incomplete` with an HTTP Range request, checks the bytes
against the etag (sha256 for LFS files, git blob sha1 for small ones), and then lets
`hf_hub_download` link the finished blob into the snapshot and write `refs/main`.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.hub_ref import (HF_SIDE_FILES, INDEX_NAME, PREFIX, SPLIT_PART, HubRef, gguf_files, is_hf_dir,
                                         parse_ref, pick_gguf, quant_of, shard_names)

# ---- the local cache: no network -----------------------------------------------------------------

def _storage(repo_id: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    # read at call time, not import time: HF_HUB_CACHE is where huggingface_hub writes right now
    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def _snapshot(ref: HubRef) -> Path | None:
    """The cached snapshot `refs/<revision>` points at (huggingface_hub's documented cache layout)."""
    storage = _storage(ref.repo_id)
    try:
        commit = (storage / "refs" / ref.revision).read_text().strip()
    except OSError:
        return None
    snap = storage / "snapshots" / commit
    return snap if snap.is_dir() else None


def _files_in(snap: Path) -> list[str]:
    # is_file() follows the symlink: an entry whose blob was deleted (`hf cache delete`) is not there
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def cached(ref: HubRef, exact_only: bool) -> Path | None:
    """The cached file or directory `ref` names, without the network. exact_only: only an exact quant
    match (a repo's "only GGUF" is only known from the hub's full file list)."""
    snap = _snapshot(ref)
    if snap is None:
        return None
    files = _files_in(snap)
    if gguf_files(files):
        if exact_only:
            try:
                return snap / pick_gguf(files, ref, "in the cache", only_fallback=False)
            except LowbitError:
                return None
        return snap / pick_gguf(files, ref, f"in the cache ({snap})")
    if ref.quant is None and is_hf_dir(files):
        index = snap / INDEX_NAME
        if all((snap / f).is_file() for f in shard_names(files, index if index.is_file() else None)):
            return snap  # every shard there: an interrupted pull leaves some missing
    return None


# ---- errors --------------------------------------------------------------------------------------

def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection and timeout errors of the HTTP client huggingface_hub uses (httpx2 in 2.x, httpx in
    1.x); OfflineModeIsEnabled is a ConnectionError."""
    out: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for name in ("httpx2", "httpx"):
        try:
            out.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


@contextmanager
def _hub_errors(ref: HubRef, doing: str) -> Iterator[None]:
    """huggingface_hub's exceptions → one line that says what to do. doing: 'list' or 'download'."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    endpoint, repo = constants.ENDPOINT, ref.repo_id
    try:
        yield
    except OfflineModeIsEnabled:
        raise LowbitError(f"{ref} is not in the cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; "
                          f"unset it and run: lowbit pull {ref}") from None
    except GatedRepoError:
        raise LowbitError(f"{ref}: {repo} is gated on {endpoint}: accept its terms at {endpoint}/{repo} "
                          "and set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise LowbitError(f"{ref}: repo {repo} not found on {endpoint} (if it is private, set HF_TOKEN "
                          "to a token with access)") from None
    except RevisionNotFoundError:
        raise LowbitError(f"{ref}: {repo} has no revision {ref.revision!r} on {endpoint}") from None
    except HfHubHTTPError as e:
        code = e.response.status_code if e.response is not None else None
        if code in (401, 403):
            raise LowbitError(f"{ref}: {endpoint} refused access to {repo} (HTTP {code}); set HF_TOKEN to a "
                              "token with read access") from None
        raise LowbitError(f"{ref}: {endpoint} answered HTTP {code} ({_first_line(e)})") from None
    except _transport_errors() as e:
        if doing == "list":
            raise LowbitError(f"{ref}: cannot reach the Hugging Face hub at {endpoint} ({_first_line(e)})") from None
        raise LowbitError(f"{ref}: the download from {endpoint} broke off ({_first_line(e)}); run the same "
                          "command again to resume it") from None
    except OSError as e:  # a short file (size check), a full disk, an answer without hub headers
        raise LowbitError(f"{ref}: {'listing' if doing == 'list' else 'downloading'} {repo} from {endpoint} "
                          f"failed ({_first_line(e)})") from None


# ---- downloading ---------------------------------------------------------------------------------

def _shown_bar():
    """A tqdm class that draws on stderr even when it is not a terminal: huggingface_hub's own bars
    pass disable=None, which hides them there, and a multi-GB pull in a CI log would say nothing for
    minutes. HF_HUB_DISABLE_PROGRESS_BARS=1 still hides it."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from tqdm import tqdm

    class ShownBar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub's bar-group name; plain tqdm rejects it
            kwargs["disable"] = are_progress_bars_disabled()
            kwargs.setdefault("file", sys.stderr)
            if not sys.stderr.isatty():
                kwargs.setdefault("mininterval", 5.0)  # a log line every 5 s, not ten a second
            super().__init__(*args, **kwargs)

    return ShownBar


def _matches_etag(path: Path, etag: str) -> bool:
    """The hub's etag is the sha256 of an LFS file, the git blob sha1 of a small one; anything else
    (a mirror's own etags) cannot be checked and passes."""
    if re.fullmatch(r"[0-9a-f]{64}", etag):
        h = hashlib.sha256()
    elif re.fullmatch(r"[0-9a-f]{40}", etag):
        h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    else:
        return True
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest() == etag


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def _fill_blob(ref: HubRef, filename: str, say: Callable[[str], None], bar) -> None:
    """Download `filename` into its cache blob, resuming a `blobs/<etag>.incomplete` left by an earlier
    run. The lock is the one hf_hub_download takes for this blob, so two pulls never append together."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(ref.repo_id, filename, revision=ref.revision, endpoint=constants.ENDPOINT)
    meta = get_hf_file_metadata(url, endpoint=constants.ENDPOINT)  # HEAD; sends HF_TOKEN when set
    if not meta.etag or not meta.commit_hash:
        return  # not a hub-shaped answer: hf_hub_download raises its own error for it
    storage = _storage(ref.repo_id)
    blob = storage / "blobs" / meta.etag
    if blob.exists():
        return
    part = blob.with_name(blob.name + ".incomplete")
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / storage.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():  # another process finished it while we waited
            return
        have = part.stat().st_size if part.exists() else 0
        if meta.size is not None and have > meta.size:
            part.unlink()  # longer than the file: not a prefix of it
            have = 0
        size = f" ({_size(meta.size)})" if meta.size is not None else ""
        say(f"{'resuming' if have else 'downloading'} {filename}{size} from {constants.ENDPOINT}/{ref.repo_id}"
            + (f" at {_size(have)}" if have else ""))
        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # byte offsets of a Range must be offsets into the file
        hub_hosts = {urlsplit(url).hostname, *getattr(constants, "HF_URL_HOSTS", ())}  # the set is 2.x's
        if urlsplit(meta.location).hostname not in hub_hosts:
            headers.pop("authorization", None)  # a signed CDN URL: the token stays on the hub
        with open(part, "ab") as f:  # append: the bytes already there are the file's first `have`
            http_get(meta.location, f, resume_size=have, headers=headers, expected_size=meta.size,
                     displayed_filename=Path(filename).name, tqdm_class=bar)
        if not _matches_etag(part, meta.etag):
            part.unlink()
            raise LowbitError(f"{ref}: {filename} does not match the hub's hash {meta.etag}; removed the "
                              "partial download, run the pull again")
        os.replace(part, blob)  # atomic: a half-written blob is never seen as the file


def _fetch(ref: HubRef, filename: str, say: Callable[[str], None], bar) -> Path:
    """One repo file → its path in the cache snapshot (downloaded unless already there)."""
    from huggingface_hub import constants, hf_hub_download

    with _hub_errors(ref, "download"):
        _fill_blob(ref, filename, say, bar)
        # the blob is there now: this only links it into snapshots/<commit>/ and writes refs/<revision>
        return Path(hf_hub_download(ref.repo_id, filename, revision=ref.revision, cache_dir=constants.HF_HUB_CACHE,
                                    endpoint=constants.ENDPOINT, tqdm_class=bar))


def pull(ref_text: str, progress: Callable[[str], None] | None = None) -> Path:
    """Fetch what `ref_text` names into the hub cache → the .gguf file or the snapshot directory.
    With the hub unreachable (or HF_HUB_OFFLINE=1) a cached copy is used instead."""
    ref = parse_ref(ref_text)
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    say = progress or (lambda s: None)
    if constants.is_offline_mode():
        try:
            local = cached(ref, exact_only=False)
        except LowbitError as e:  # a snapshot without the quant asked for
            raise LowbitError(f"{e}; HF_HUB_OFFLINE is set, so the hub was not asked") from None
        if local is None:
            with _hub_errors(ref, "list"):
                raise OfflineModeIsEnabled(str(ref))
        return local
    try:
        with _hub_errors(ref, "list"):
            # a bounded wait: the client's default is none, and a firewalled hub would hang here
            info = HfApi(endpoint=constants.ENDPOINT).model_info(ref.repo_id, revision=ref.revision,
                                                                 timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except LowbitError as e:
        try:
            local = cached(ref, exact_only=False)  # no answer from the hub, but a copy here: run offline
        except LowbitError:
            local = None  # a snapshot without the quant asked for: the hub's error is the one to see
        if local is None:
            raise e from None
        say(f"{e}; using the cached {local}")
        return local
    files = [s.rfilename for s in info.siblings or []]
    bar = _shown_bar() if progress is not None else None
    if gguf_files(files):
        return _fetch(ref, pick_gguf(files, ref, f"in {ref.repo_id}"), say, bar)
    if not is_hf_dir(files):
        shown = ", ".join(files[:8]) + (", …" if len(files) > 8 else "")
        raise LowbitError(f"{ref}: {ref.repo_id} has neither .gguf files nor config.json + *.safetensors "
                          f"(files: {shown or 'none'})")
    if ref.quant is not None:
        raise LowbitError(f"{ref}: {ref.repo_id} has no GGUF files, only safetensors; drop :{ref.quant} and "
                          "lowbit quantizes it at load (--weights picks the layout)")
    side = [f for f in (*HF_SIDE_FILES, INDEX_NAME) if f in files]
    paths = {f: _fetch(ref, f, say, bar) for f in side}  # small files first: the index names the shards
    for f in shard_names(files, paths.get(INDEX_NAME)):
        paths[f] = _fetch(ref, f, say, bar)
    return paths["config.json"].parent


def resolve(ref_text: str, auto_pull: bool = True, progress: Callable[[str], None] | None = None) -> Path:
    """`hf:` ref → a local path: the cached copy without touching the network when the ref names it
    exactly, else a pull (which falls back to the cache when the hub cannot be reached)."""
    ref = parse_ref(ref_text)
    local = cached(ref, exact_only=True)
    if local is not None:
        return local
    if not auto_pull:
        raise LowbitError(f"model {str(ref)!r} is not in the cache; run: lowbit pull {ref}")
    return pull(ref_text, progress)


# ---- lowbit models -------------------------------------------------------------------------------

def cached_models() -> list[tuple[str, str, int, Path]]:
    """(name, format, bytes, path) for each model in the hub cache, named as `hf:` refs that resolve
    to it. Empty without a cache."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(constants.HF_HUB_CACHE)
    except (CacheNotFound, OSError):
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = (next((r for r in repo.revisions if "main" in r.refs), None)
               or max(repo.revisions, key=lambda r: r.last_modified))
        by_name = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
        ggufs = [f for f in gguf_files(list(by_name)) if not SPLIT_PART.search(f)]
        quants = [quant_of(f) for f in ggufs]
        for f, q in zip(ggufs, quants):
            tag = q if q is not None and quants.count(q) == 1 else f
            out.append((f"{PREFIX}{repo.repo_id}:{tag}", "gguf", by_name[f].size_on_disk, by_name[f].file_path))
        if not ggufs and is_hf_dir(list(by_name)):
            size = sum(v.size_on_disk for k, v in by_name.items() if k.endswith(".safetensors"))
            out.append((f"{PREFIX}{repo.repo_id}", "safetensors", size, rev.snapshot_path))
    return out
