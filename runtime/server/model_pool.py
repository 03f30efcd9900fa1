"""The models one port offers, loaded on demand and unloaded to stay within a memory budget.

Open WebUI's model picker, Continue (chat, autocomplete and embedding models on one endpoint) and Ollama
clients expect one port serving several models (llama-server's router mode, Ollama, LM Studio). Each
offer is a name and a loader (runtime/cli/engine_args.py builds one per `--models` entry); a request
naming a model that is not loaded loads it on a worker thread (requests for it queue meanwhile, a progress
line is logged), after unloading the least recently used idle models until the estimated bytes of the
loaded ones (weights + KV pool) fit `--memory`. A model that cannot fit even alone is a 400 naming the bytes,
never an OOM kill. A model is idle when its engine has no request; a busy one is never unloaded. Ollama's
`keep_alive` (0: unload now; a duration: unload once idle that long) and `--idle-unload` set when an idle
model goes; unloading closes its engine's step thread and drops the model, so its memory returns.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from lowbit.runtime.server.errors import APIError

log = logging.getLogger("lowbit.server")


class ModelNotFound(APIError):
    """A 404 for a model the port does not offer; `name` lets each dialect word it (Ollama's own)."""

    def __init__(self, name: str, names: list[str]):
        listed = ", ".join(repr(n) for n in names)
        super().__init__(404, f"The model '{name}' does not exist (this server serves {listed}).",
                         "invalid_request_error", "model", "model_not_found")
        self.name = name


@dataclass
class Offer:
    name: str
    load: Callable[[], object]  # → Served (runtime/server/frontend.py), on a worker thread
    bytes: int  # the estimate the budget counts: the file's bytes + the KV pool's
    aliases: tuple[str, ...] = ()
    reloadable: bool = True  # False: a model handed over loaded (ModelPool.of), which is never unloaded


@dataclass
class Loaded:
    served: object
    bytes: int
    expires: float | None = None  # monotonic time to unload at once idle (None: kept)


class ModelPool:
    def __init__(self, offers: list[Offer], memory: int | None = None, idle_unload: float | None = None,
                 on_change: Callable[[str, str], None] = lambda what, name: None):
        """offers: in order, the first the default; memory: the budget in bytes (None: no limit);
        idle_unload: seconds an idle model stays (None: until evicted); on_change(what, name): "load" and
        "unload" events (the /metrics counters)."""
        self.offers = {o.name: o for o in offers}
        self.default = offers[0].name if offers else None
        self.memory, self.idle_unload, self.on_change = memory, idle_unload, on_change
        self.loaded: OrderedDict[str, Loaded] = OrderedDict()  # least recently used first
        self._loading: dict[str, asyncio.Future] = {}
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None

    @classmethod
    def of(cls, served) -> ModelPool:
        """A pool of one model, already loaded (`lowbit serve MODEL`, tests)."""
        pool = cls([Offer(served.model_name, lambda: served, 0, served.aliases, reloadable=False)])
        pool.loaded[served.model_name] = Loaded(served, 0)
        return pool

    def name_of(self, name: str | None) -> str:
        """The offer a request's `model` names (None: the default) → its name; a 404 for none."""
        if name is None:
            return self.default
        for offer in self.offers.values():
            names = (offer.name, *offer.aliases)
            if name in names or name.removesuffix(":latest") in names:  # Ollama's tag: `x` and `x:latest` are one
                return offer.name
        raise ModelNotFound(name, self.names())

    def names(self) -> list[str]:
        """Every name a request may use: each offer's, then its aliases."""
        return [n for o in self.offers.values() for n in (o.name, *o.aliases)]

    def loaded_default(self):
        """The default model's Served when it is loaded, else None (/health, the metrics' engine gauges)."""
        held = self.loaded.get(self.default) if self.default else None
        return held.served if held is not None else (next(iter(self.loaded.values())).served if self.loaded else None)

    async def get(self, name: str | None, keep_alive: float | None = None):
        """The Served of the model `name` names, loading it first when it is not loaded."""
        name = self.name_of(name)
        while name not in self.loaded:
            pending = self._loading.get(name)
            if pending is None:
                pending = self._loading[name] = asyncio.get_running_loop().create_future()
                asyncio.get_running_loop().create_task(self._load(name, pending))
            await asyncio.shield(pending)  # raises what the load raised
        held = self.loaded[name]
        self.loaded.move_to_end(name)
        self._keep(name, held, keep_alive)
        return held.served

    def _keep(self, name: str, held: Loaded, keep_alive: float | None) -> None:
        """When the model goes once idle: keep_alive (seconds, < 0 forever), else --idle-unload."""
        seconds = keep_alive if keep_alive is not None else self.idle_unload
        held.expires = None if seconds is None or seconds < 0 else time.monotonic() + seconds
        if held.expires is not None and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _load(self, name: str, done: asyncio.Future) -> None:
        offer = self.offers[name]
        try:
            async with self._lock:  # one load at a time: each frees room for itself first
                await self._make_room(offer)
                log.info("loading %s (%.2f GB estimated) for a request", name, offer.bytes / 1e9)
                t0 = time.perf_counter()
                served = await asyncio.to_thread(offer.load)
                self.loaded[name] = Loaded(served, offer.bytes)
                log.info("loaded %s in %.1f s", name, time.perf_counter() - t0)
                self.on_change("load", name)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - every waiting request gets it
            done.set_exception(e)
        finally:
            self._loading.pop(name, None)

    async def _make_room(self, offer: Offer) -> None:
        if self.memory is None:
            return
        if offer.bytes > self.memory:
            raise APIError(400, f"The model '{offer.name}' needs about {_size(offer.bytes)} (weights and KV cache); "
                                f"this server may hold {_size(self.memory)} (--memory).",
                           "invalid_request_error", "model", "model_too_large")
        for name in list(self.loaded):  # least recently used first
            if sum(h.bytes for h in self.loaded.values()) + offer.bytes <= self.memory:
                return
            if not self._busy(name) and self.offers[name].reloadable:
                await self.unload(name)
        if sum(h.bytes for h in self.loaded.values()) + offer.bytes > self.memory:
            raise APIError(503, f"The model '{offer.name}' does not fit beside the models serving requests now; "
                                "retry shortly.", "server_error", "model", "model_busy", headers={"Retry-After": "2"})

    def _busy(self, name: str) -> bool:
        return self.loaded[name].served.engine.engine.has_work()

    async def unload(self, name: str) -> bool:
        """Unload `name` (running requests end with an error) → whether it was loaded."""
        if name not in self.loaded or not self.offers[name].reloadable:
            return False
        held = self.loaded.pop(name)
        await asyncio.to_thread(held.served.engine.close)
        del held
        # the request that asked for this (keep_alive 0) still holds the model until it answers: give the
        # memory back once it has (measured: RSS 586 -> 556 MB trimmed at once, -> 358 MB a second later)
        asyncio.get_running_loop().call_later(1.0, _release)
        log.info("unloaded %s", name)
        self.on_change("unload", name)
        return True

    async def _reap(self) -> None:
        """Unload models idle past their time, checking each second."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for name, held in list(self.loaded.items()):
                if held.expires is not None and held.expires <= now and not self._busy(name):
                    await self.unload(name)


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive: seconds (a number), a Go duration ("5m", "1h30m", "90s", "0"), negative for
    forever → seconds (-1: forever), or None when absent or unreadable (the server's default then)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return -1.0 if value < 0 else float(value)
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith("-"):
        return -1.0
    parts = re.fullmatch(r"((?:\d+(?:\.\d+)?(?:h|ms|m|s))+|\d+(?:\.\d+)?)", text)
    if parts is None:
        return None
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * unit[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text))


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)" if n >= 2**30 else f"{n / 2**20:.1f} MiB ({n:,} bytes)"


def _release() -> None:
    """Collect what an unloaded model left and hand the freed heap pages back to the system (glibc keeps them
    in its arenas otherwise: RSS would not fall)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
