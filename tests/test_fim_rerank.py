"""Fill-in-the-middle (server/fim.py) and rerank (server/llama_server.py) on the port.

FIM's oracle is transformers' tokenizer: the model's markers written out as text around the prefix and
suffix and encoded by it give the ids lowbit's prompt must have; every route that takes a suffix
(/v1/completions, llama-server's /infill, Ollama's /api/generate) must generate what that id prompt
generates. The model is a tiny random Llama behind the default model's tokenizer with Qwen2.5-Coder's
three FIM markers added (the default model has none: it answers 400). Rerank's oracle is the model's own
embeddings: /v1/embeddings of the query and of each document, their cosines, which rerank must order by.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import httpx
import jsonschema
import pytest
import torch

from lowbit.models.llama import Llama
from lowbit.models.synthetic import random_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import AsyncEngine, Engine
from lowbit.runtime.load.tokenizer import Tokenizer
from lowbit.runtime.server.app import Served, build_app
from tests.conftest import SERVE_KEY
from tests.helpers import serving
from tests.test_server import CFG

transformers = importlib.import_module("transformers")
MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def coder(default_gguf, tmp_path_factory):
    """(the transformers tokenizer, lowbit's, the base URL) of the tiny model with FIM markers."""
    d = tmp_path_factory.mktemp("fim")
    hf = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    hf.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    hf.save_pretrained(d)
    tok = Tokenizer.from_hf_dir(d)
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size, max_seq_len=512)
    model = Llama(cfg, random_weights(cfg, "int4-g32", "int8-g32", seed=0, scale=0.1)).eval()
    engine = Engine(model, tok, EngineConfig(kv_memory=16 << 20, max_num_seqs=4, exact=True))
    with serving(build_app(Served(AsyncEngine(engine), tok, "coder", 512))) as base:
        yield hf, tok, base


def _want(hf) -> list[int]:
    return hf.encode(f"{MARKERS[0]}{PREFIX}{MARKERS[1]}{SUFFIX}{MARKERS[2]}", add_special_tokens=True)


def test_the_fim_markers_are_found_and_the_prompt_is_the_models(coder, default_gguf):
    from lowbit.runtime.load.gguf_file import GGUFFile
    from lowbit.runtime.server.fim import fim_prompt

    hf, tok, _ = coder
    assert tok.fim == tuple(hf.convert_tokens_to_ids(list(MARKERS)))
    assert fim_prompt(tok, PREFIX, SUFFIX) == _want(hf)
    # a GGUF names its markers in metadata (llama.cpp's converter writes them): those ids, whatever their text
    meta = dict(GGUFFile(default_gguf).metadata)
    assert Tokenizer.from_gguf_metadata(meta).fim is None
    meta.update({"tokenizer.ggml.fim_pre_token_id": 5, "tokenizer.ggml.fim_suf_token_id": 6,
                 "tokenizer.ggml.fim_mid_token_id": 7})
    assert Tokenizer.from_gguf_metadata(meta).fim == (5, 6, 7)


def test_every_suffix_route_generates_from_the_fim_prompt(coder):
    hf, _, base = coder
    ids = _want(hf)
    greedy = {"temperature": 0, "max_tokens": 12}
    want = httpx.post(base + "/v1/completions", json={"prompt": ids, **greedy}, timeout=60).json()
    got = httpx.post(base + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, **greedy}, timeout=60).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == len(ids)
    infill = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 12}
    r = httpx.post(base + "/infill", json=infill, timeout=60).json()
    assert r["content"] == want["choices"][0]["text"] and r["stop"] and r["tokens_evaluated"] == len(ids)
    assert r["stop_type"] == "limit" and r["tokens_predicted"] == 12
    with httpx.stream("POST", base + "/infill", json={**infill, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert "".join(c["content"] for c in chunks) == r["content"] and chunks[-1]["stop"]
    assert not any(c["stop"] for c in chunks[:-1])
    # as GET /openapi.json describes them (the default model, with no FIM tokens, cannot show them there)
    ok = httpx.get(base + "/openapi.json", timeout=60).json()["paths"]["/infill"]["post"]["responses"]["200"]["content"]
    jsonschema.Draft202012Validator(ok["application/json"]["schema"]).validate(r)
    event = jsonschema.Draft202012Validator(ok["text/event-stream"]["schema"]["properties"]["data"]["contentSchema"])
    for c in chunks:
        event.validate(c)
    ollama = httpx.post(base + "/api/generate", json={"model": "coder", "prompt": PREFIX, "suffix": SUFFIX,
                                                      "stream": False, "options": {"temperature": 0,
                                                                                   "num_predict": 12}},
                        timeout=60).json()
    assert ollama["response"] == want["choices"][0]["text"]


def test_a_model_without_fim_markers_says_so(lowbit_server):
    h = {"Authorization": f"Bearer {SERVE_KEY}"}
    r = httpx.post(lowbit_server[0] + "/v1/completions", headers=h, timeout=60,
                   json={"prompt": "def f(", "suffix": "):\n", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_rerank_orders_documents_by_the_models_own_scores(lowbit_server):
    """On the default model: the order and scores are the cosines of /v1/embeddings' vectors (rows do not
    depend on their company: README), top_n cuts, documents come back unless asked not to."""
    base, h = lowbit_server[0], {"Authorization": f"Bearer {SERVE_KEY}"}
    query = "How do I bake bread?"
    docs = ["Knead the dough, let it rise, then bake at 220 C.", "The stock market fell on Tuesday.",
            "Bread needs flour, water, yeast and salt.", "Cats sleep most of the day.", "Preheat the oven."]
    vec = httpx.post(base + "/v1/embeddings", headers=h, json={"input": [query, *docs]}, timeout=120).json()["data"]
    v = torch.tensor([d["embedding"] for d in vec])
    cos = (v[1:] @ v[0]).tolist()
    want = sorted(range(len(docs)), key=lambda i: -cos[i])
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(base + path, headers=h, json={"query": query, "documents": docs}, timeout=120).json()
        assert [x["index"] for x in r["results"]] == want
        assert all(abs(x["relevance_score"] - cos[x["index"]]) < 1e-5 for x in r["results"])
        assert r["results"][0]["document"]["text"] == docs[want[0]]
    r = httpx.post(base + "/v1/rerank", headers=h, timeout=120,
                   json={"query": query, "documents": [{"text": d} for d in docs], "top_n": 2,
                         "return_documents": False}).json()
    assert [x["index"] for x in r["results"]] == want[:2] and "document" not in r["results"][0]
    bad = httpx.post(base + "/v1/rerank", headers=h, json={"query": query, "documents": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
