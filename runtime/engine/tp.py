"""Tensor parallelism, the process side: `--tp N` runs the model as N processes (ranks), each
holding one slice of every layer (models/sharding.py says which), on CPU over torch.distributed's
gloo backend.

Rank 0 is the process the user started (`lowbit run`, `serve`, `chat`). It loads its own slice
first, so a split the model cannot take is refused before anything starts; then it starts ranks
1..N-1 with torch.multiprocessing (spawn) and all N meet in torch.distributed's default group.
The scheduler and the sampler exist on rank 0 only: the engine calls `TPModel` as it calls a
Llama, and TPModel broadcasts each step (tokens, positions, cache slots, block tables, which rows
are exact) before running rank 0's slice. The other ranks run theirs from the same message, and
the all-reduces inside the forward pass keep all N in step; rank 0 gathers the logits. Continuous
batching, prefix caching and speculative decoding see one model, as without --tp. Each rank keeps
its own KV pool with only its KV heads, with the same pages and slots as rank 0's.

A rank that dies: rank 0 watches the processes and, when one ends unasked, says which and how and
exits with status 1 (a server would otherwise wait forever in its next all-reduce). Ranks 1..N-1
exit when rank 0 is gone: their next broadcast fails, and a thread watches their parent.

CPU cores are split evenly: with T threads (--threads, default all cores) each rank runs T // N
intra-op threads (at least one), and where the process may use at least N cores, rank r is pinned
to the r-th of N equal groups of them (rank 0's own pinning is undone when the group closes). CUDA
ranks (NCCL) are not built yet: --tp refuses a GPU device.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lowbit.models.attention import PagedBatch
from lowbit.models.sharding import Shard
from lowbit.quant.linear import ExactRows
from lowbit.runtime.engine.runner import paged_batch
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.ports import free_port

# A server's ranks wait in a broadcast for as long as no request comes: no collective timeout of
# practical size, so a dead rank is found by watching processes, not by gloo timing out.
IDLE_TIMEOUT = timedelta(days=365)
WATCH_S = 0.2  # how often rank 0 looks at the other ranks' processes


def load_tp(ref: str | None, weights: str, tp: int, progress: bool | None = None, device: str = "auto",
            dtype: str = "float16", threads: int | None = None):
    """Load the model as `tp` ranks → a LoadedModel whose model is rank 0's TPModel."""
    from lowbit.runtime.load.loader import load
    from lowbit.runtime.load.registry import resolve

    if tp < 1:
        raise LowbitError(f"--tp must be >= 1, got {tp}")
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        raise LowbitError(f"--tp {tp} runs its ranks on CPU (gloo); tensor parallelism over GPUs (NCCL) is not "
                          "built yet: pass --device cpu")
    if dist.is_initialized():
        raise LowbitError("a tensor-parallel group is already running in this process")
    path = resolve(ref)
    per_rank = max(1, (threads or os.cpu_count() or 1) // tp)
    lm = load(str(path), weights, progress, "cpu", dtype, shard=Shard(0, tp))  # a bad split stops here
    groups = _core_groups(tp)
    if progress or (progress is None and sys.stderr.isatty()):
        where = f", cores {groups}" if groups else ""
        print(f"lowbit: tensor parallel: starting ranks 1..{tp - 1} ({per_rank} threads each{where})", file=sys.stderr)
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = _spawn(tp - 1, (tp, init, str(path), weights, dtype, per_rank, groups))
    model = TPModel(lm.model, ctx, _pin(groups, 0))  # pinned after the spawn: the ranks inherit no mask
    torch.set_num_threads(per_rank)
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=tp, timeout=IDLE_TIMEOUT)
        errors = [None] * tp
        dist.gather_object(None, errors, dst=0)  # every rank's load: None or its error line
    except BaseException:
        model.close()
        raise
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        model.close()
        raise LowbitError(f"tensor-parallel rank {failed[0][0]} could not load the model: {failed[0][1]}")
    return dataclasses.replace(lm, model=model)


def _spawn(n: int, args: tuple):
    """Start ranks 1..n with torch.multiprocessing. multiprocessing's resource tracker hands
    sys.stderr's file descriptor to its own process; under `lowbit chat`, Textual's stderr is not a
    file (fileno() -1, and the spawn fails), so the real one stands in while the ranks start."""
    saved = sys.stderr
    try:
        if not _has_fd(saved):
            sys.stderr = sys.__stderr__
        return torch.multiprocessing.start_processes(_worker, args=args, nprocs=n, join=False, daemon=True,
                                                     start_method="spawn")
    finally:
        sys.stderr = saved


def _has_fd(stream) -> bool:
    try:
        return stream.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        return False


def _core_groups(world: int) -> list[list[int]] | None:
    """N equal groups of the cores this process may use, or None when there are fewer than N."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // world
    return [cores[r * per:(r + 1) * per] for r in range(world)] if per else None


def _pin(groups: list[list[int]] | None, rank: int) -> set[int] | None:
    """Pin this process to its group of cores → the cores it could use before (None: not pinned)."""
    if groups is None:
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, groups[rank])
    return before


class TPModel:
    """Rank 0's model: what the engine calls (forward_paged, config, device, backend, kv_heads),
    with every step also sent to ranks 1..N-1. Steps and queries are serialized by one lock: the
    ranks must see the collectives in the same order."""

    def __init__(self, shard_model, ctx, cores_before: set[int] | None = None):
        self.shard = shard_model
        self.config, self.backend, self.kv_heads = shard_model.config, shard_model.backend, shard_model.kv_heads
        self.world = shard_model.tp.shard.world
        self._ctx = ctx
        self._cores_before = cores_before
        self._lock = threading.Lock()
        self._closing = False
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="lowbit-tp-watch", daemon=True).start()

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self._ctx.processes]

    def buffers(self):
        """Rank 0's tensors (LoadedModel.weight_bytes counts them: rank 0's share)."""
        return self.shard.buffers()

    def forward_paged(self, tokens: torch.Tensor, batch: PagedBatch, pool, exact=None) -> torch.Tensor:
        with self._lock:
            self._send(("step", _pack_step(tokens, batch, pool, exact)))
            return self.shard.forward_paged(tokens, batch, pool, exact)

    def __call__(self, *args, **kwargs):
        raise LowbitError("with --tp, the model runs only through the engine (continuous batching)")

    forward = decode = __call__

    def rank_info(self, pool=None) -> list[dict]:
        """Per rank: pid, KV heads and bytes of its pool (rank 0's is `pool`; the others' the pool
        of their last step), bytes of its weights, the vocabulary range it holds."""
        with self._lock:
            self._send(("info", None))
            out = [None] * self.world
            dist.gather_object(_rank_info(self.shard, pool), out, dst=0)
            return out

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the group (also at interpreter exit)."""
        if self._closing:
            return
        self._closing = True
        if dist.is_initialized():  # the group is up: the ranks are waiting for a message
            try:
                with self._lock:
                    self._send(("stop", None))
            except Exception:  # noqa: BLE001 - a rank already gone: terminate below
                pass
        for p in self._ctx.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._cores_before is not None:
            os.sched_setaffinity(0, self._cores_before)

    def _send(self, msg) -> None:
        dist.broadcast_object_list([msg], src=0)

    def _watch(self) -> None:
        """A rank that ends while rank 0 still needs it: report it and exit, never hang."""
        while not self._closing:
            for rank, p in enumerate(self._ctx.processes, start=1):
                code = p.exitcode
                if code is not None and not self._closing:
                    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                    print(f"lowbit: error: tensor-parallel rank {rank} (pid {p.pid}) died ({how}); stopping all "
                          f"{self.world} ranks", file=sys.stderr, flush=True)
                    for q in self._ctx.processes:
                        if q.is_alive():
                            q.kill()
                    os._exit(1)
            time.sleep(WATCH_S)


def _pack_step(tokens: torch.Tensor, batch: PagedBatch, pool, exact) -> dict:
    """One engine step as plain lists: what every rank needs to run the same forward pass."""
    return {"tokens": tokens.tolist(), "positions": batch.positions.tolist(), "slots": batch.slots.tolist(),
            "query_lens": list(batch.query_lens), "context_lens": list(batch.context_lens),
            "block_tables": [t.tolist() for t in batch.block_tables], "logits_rows": batch.logits_rows.tolist(),
            "one_by_one": batch.one_by_one,
            "exact": exact.mask.tolist() if isinstance(exact, ExactRows) else exact,
            "pool": _pool_key(pool)}


def _pool_key(pool) -> tuple:
    """What a rank needs to build its own pool like rank 0's: the format's name, each layer's format name
    where the layers differ (an engine's kv_layers; None: every layer in the one format), pages, page size."""
    layers = tuple(f.name for f in pool.formats)
    return pool.fmt.name, None if set(layers) == {pool.fmt.name} else layers, pool.num_pages, pool.page_size


def _rank_pool(model, key: tuple):
    """A rank's pool for rank 0's `_pool_key`: the same formats, pages and slots, this rank's KV heads."""
    from lowbit.quant.kv import parse_kv_format
    from lowbit.runtime.engine.kv_cache import KVPool

    fmt, layers, pages, page_size = key
    c = model.config
    return KVPool(parse_kv_format(fmt), c.n_kv_layers, model.kv_heads, c.head_dim, pages, page_size,
                  layer_formats=None if layers is None else [parse_kv_format(n) for n in layers])


def _unpack_step(m: dict) -> tuple[torch.Tensor, PagedBatch, object]:
    batch = paged_batch(m["positions"], m["slots"], m["query_lens"], m["context_lens"], m["block_tables"],
                        m["logits_rows"], m["one_by_one"])
    exact = m["exact"]
    if isinstance(exact, list):
        exact = ExactRows(torch.tensor(exact, dtype=torch.bool))
    return torch.tensor(m["tokens"], dtype=torch.long), batch, exact


def _rank_info(model, pool) -> dict:
    return {"rank": model.tp.shard.rank, "pid": os.getpid(), "kv_heads": None if pool is None else pool.n_kv_heads,
            "pool_bytes": None if pool is None else pool.nbytes,
            "weight_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "vocab_range": model.vocab_range}


def _worker(index: int, world: int, init: str, path: str, weights: str, dtype: str, threads: int,
            groups: list[list[int]] | None) -> None:
    """Rank index + 1: load its slice, then run the steps rank 0 broadcasts until told to stop."""
    from lowbit.runtime.load.loader import load

    rank = index + 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops the others
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), name="lowbit-tp-parent", daemon=True).start()
    _pin(groups, rank)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=IDLE_TIMEOUT)
    error = None
    try:
        model = load(path, weights, progress=False, device="cpu", dtype=dtype, shard=Shard(rank, world)).model
    except Exception as e:  # noqa: BLE001 - reported by rank 0 as one line
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    dist.gather_object(error, None, dst=0)
    pool, pool_key = None, None
    with torch.inference_mode():
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=0)
            op, body = msg[0]
            if op == "stop":
                break
            if error is not None:  # rank 0 only stops a rank whose load failed
                continue
            if op == "info":
                dist.gather_object(_rank_info(model, pool), None, dst=0)
            elif op == "step":
                if body["pool"] != pool_key:  # rank 0's engine made a pool: the same pages, this rank's heads
                    pool_key = body["pool"]
                    pool = _rank_pool(model, pool_key)
                tokens, batch, exact = _unpack_step(body)
                model.forward_paged(tokens, batch, pool, exact)
    dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """Rank 0 gone (killed before it could stop this rank): exit rather than linger."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)
