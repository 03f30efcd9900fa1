"""Several models behind one port (server/model_pool.py, `lowbit serve --models`), as users start it.

The real command in a subprocess offers the default model and two tiny ones (the Qwen3-MoE and gpt-oss
GGUFs llama.cpp's converter and quantizer make in tests/conftest.py), with --memory set to hold one at a
time. The judges: the `openai` and `ollama` packages list all three and answer from each; requests that
alternate between them swap them in and out (the log's and /metrics' loads and unloads, /api/ps), with no
5xx and no page left in use; Ollama's `keep_alive: 0` unloads the model, and the server's RSS falls.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.helpers import serve_process

pytestmark = pytest.mark.slow
KV = 128 << 20  # --kv-memory: each model's estimate is its file plus this


def _rss(pid: int) -> int:
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


@pytest.fixture(scope="module")
def pool_server(default_gguf, moe_gguf, oss_quants, tmp_path_factory):
    models = [default_gguf, moe_gguf, oss_quants["Q8_0"]]
    memory = max(p.stat().st_size for p in models) + KV + (1 << 20)  # one model at a time
    log = tmp_path_factory.mktemp("pool") / "serve.log"
    with serve_process([str(models[0]), "--models", *map(str, models[1:]), "--kv-memory", "128MiB",
                        "--memory", str(memory)], log, ready_s=180) as (base, proc):
        yield base, models, proc, log


def _loaded(base: str) -> list[str]:
    return [m["name"] for m in httpx.get(base + "/api/ps", timeout=30).json()["models"]]


def _events(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for event, value in re.findall(r'lowbit_model_events_total\{event="(\w+)",model="[^"]+"\} ([\d.]+)', text):
        out[event] = out.get(event, 0) + float(value)
    return out


def test_every_client_lists_the_models_and_requests_swap_them(pool_server):
    import ollama
    import openai

    base, paths, _, log = pool_server
    names = [p.name for p in paths]
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=180)
    listed = [m.id for m in client.models.list().data]
    assert set(names) <= set(listed) and listed[0] == names[0]  # the default first
    assert set(names) <= {m.model for m in ollama.Client(host=base).list().models}
    assert _loaded(base) == [names[0]]
    order = [names[1], names[2], names[0], names[1], names[0]]
    for name in order:
        r = client.chat.completions.create(model=name, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Say hi."}])
        assert r.model == name and r.choices[0].finish_reason in ("stop", "length")
        assert _loaded(base) == [name], "--memory holds one model: the others were unloaded"
    events = _events(base)
    # each request but the last to the default swapped a model in (the default was loaded at start)
    assert events.get("load") == len(order) and events.get("unload") == len(order), events
    assert "loading Q4_K_M.gguf" in log.read_text()  # the progress line of an on-demand load
    pages = re.search(r"lowbit_kv_pages_used ([\d.]+)", httpx.get(base + "/metrics", timeout=30).text)
    assert pages is not None and float(pages.group(1)) == 0


def test_a_model_not_offered_is_a_404_naming_the_offers(pool_server):
    base, paths = pool_server[:2]
    r = httpx.post(base + "/v1/chat/completions", timeout=60,
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"] and paths[1].name in r.text


def test_keep_alive_zero_unloads_and_frees_memory(pool_server):
    import ollama

    base, paths, proc, _ = pool_server
    name = paths[0].name
    c = ollama.Client(host=base)
    c.chat(model=name, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert _loaded(base) == [name]
    before = _rss(proc.pid)
    r = c.chat(model=name, messages=[], keep_alive=0)
    assert r.done_reason == "unload" and _loaded(base) == []
    want, deadline = 0.5 * paths[0].stat().st_size, time.time() + 10  # the memory goes back a second after
    while (freed := before - _rss(proc.pid)) < want and time.time() < deadline:
        time.sleep(0.25)
    print(f"keep_alive 0: RSS {before / 1e6:.0f} -> {(before - freed) / 1e6:.0f} MB ({freed / 1e6:.0f} MB freed)")
    assert freed >= want, freed  # the weights (98 MB for the default model) went
    assert c.generate(model=name, prompt="hi", options={"num_predict": 2}).done  # and it loads again
    assert _loaded(base) == [name]


# ---- the pool's rules, on stand-in models (no weights) ------------------------------------------------

class _Engine:
    def __init__(self):
        self.busy, self.closed, self.engine = False, False, self

    def has_work(self):
        return self.busy

    def close(self):
        self.closed = True


class _Served:
    def __init__(self, name):
        self.model_name, self.aliases, self.engine = name, (), _Engine()


def _pool(sizes: dict, memory: int, loads: list, **kw):
    from lowbit.runtime.server.model_pool import ModelPool, Offer

    def loader(name):
        def load():
            loads.append(name)
            return _Served(name)
        return load

    return ModelPool([Offer(n, loader(n), b) for n, b in sizes.items()], memory, **kw)


def test_the_pool_loads_once_evicts_the_least_recently_used_idle_model_and_refuses_what_cannot_fit():
    import asyncio

    from lowbit.runtime.server.errors import APIError

    async def run():
        loads: list = []
        pool = _pool({"a": 40, "b": 40, "c": 40, "huge": 200}, 100, loads)
        a, a2 = await asyncio.gather(pool.get("a"), pool.get(None))  # the default is "a": one load for both
        assert a is a2 and loads == ["a"]
        b = await pool.get("b")
        await pool.get("a")  # a is now the most recently used
        await pool.get("c")  # 120 > 100: b (least recently used, idle) goes
        assert list(pool.loaded) == ["a", "c"] and b.engine.closed and not a.engine.closed
        pool.loaded["a"].served.engine.busy = pool.loaded["c"].served.engine.busy = True
        try:
            await pool.get("b")
        except APIError as e:  # both busy: never unloaded under a running request
            assert e.status == 503 and e.code == "model_busy"
        else:
            raise AssertionError("a busy model was evicted")
        try:
            await pool.get("huge")
        except APIError as e:
            assert e.status == 400 and "(200 bytes)" in e.message and "(100 bytes) (--memory)" in e.message
            assert e.code == "model_too_large"
        else:
            raise AssertionError("a model over the budget loaded")

    asyncio.run(run())


def test_keep_alive_unloads_an_idle_model_when_its_time_is_up():
    import asyncio

    from lowbit.runtime.server.model_pool import keep_alive_seconds

    assert [keep_alive_seconds(v) for v in (0, "0", "5m", "1h30m", "90s", "250ms", -1, "-1m", None, "soon", 2.5)] \
        == [0.0, 0.0, 300.0, 5400.0, 90.0, 0.25, -1.0, -1.0, None, None, 2.5]

    async def run():
        pool = _pool({"a": 1, "b": 1}, 100, [], idle_unload=None)
        await pool.get("a", keep_alive=0.5)
        await pool.get("b", keep_alive=-1)  # forever
        await asyncio.sleep(2.0)  # the reaper looks each second
        assert list(pool.loaded) == ["b"]

    asyncio.run(run())
