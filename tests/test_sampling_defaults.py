"""The model's own sampling defaults (runtime/load/sampling_defaults.py): read from generation_config.json and
from GGUF's general.sampling.* keys — the oracle for the latter is llama.cpp's converter, which writes them
from the same generation_config.json — applied to requests that omit them, under `lowbit serve`'s flags,
and never over a request's own values."""

from __future__ import annotations

import importlib
import json

import pytest

from lowbit.runtime.cli.engine_args import sampling_defaults
from lowbit.runtime.cli.main import build_parser
from lowbit.runtime.load.sampling_defaults import hf_defaults
from lowbit.runtime.server.request import RequestParser
from tests import llama_cpp_source
from tests.family_models import build, save

transformers = importlib.import_module("transformers")

QWEN3_CARD = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
              "repetition_penalty": 1.05}  # Qwen3's thinking-mode values, plus a penalty to carry


@pytest.fixture(scope="module")
def card_model(default_gguf, tmp_path_factory):
    """A tiny Qwen3 with Qwen3's generation_config.json, and the GGUF llama.cpp's converter makes of it."""
    d = tmp_path_factory.mktemp("card")
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(d / "tok")
    hf = save(build("qwen3", len(tok), seed=3), d / "tok", d / "hf", "qwen3")
    (hf / "generation_config.json").write_text(json.dumps({**QWEN3_CARD, "bos_token_id": 1, "max_new_tokens": 64}))
    return hf, llama_cpp_source.convert(llama_cpp_source.converter_dir(), hf, d / "F32.gguf")


def test_the_models_defaults_load_from_its_directory_and_from_its_gguf(card_model):
    from lowbit.runtime.load.loader import load

    hf, gguf_path = card_model
    want = {k: v for k, v in QWEN3_CARD.items() if k != "do_sample"}
    assert load(str(hf), "f32", progress=False).sampling == want
    assert load(str(gguf_path), "auto", progress=False).sampling == want


def test_values_a_sampler_would_refuse_are_dropped(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": 0.05, "repetition_penalty": "high"}))
    assert hf_defaults(tmp_path) == {"min_p": 0.05}
    (tmp_path / "generation_config.json").write_text("not json")
    assert hf_defaults(tmp_path) == {}


def test_a_request_gets_the_models_defaults_and_keeps_its_own(byte_tokenizer):
    model = {k: v for k, v in QWEN3_CARD.items() if k != "do_sample"}
    args = build_parser().parse_args(["serve", "--top-k", "5"])
    parser = RequestParser(byte_tokenizer, "m", 512, defaults=sampling_defaults(args, model, {}))
    msgs = [{"role": "user", "content": "hi"}]
    p = parser.chat({"messages": msgs}).params[0]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.95, 5, 0.0, 1.05)
    p = parser.chat({"messages": msgs, "temperature": 1.0, "top_k": 0}).params[0]
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 0, 0.95)
    # a model with no card: OpenAI's defaults, as before
    p = RequestParser(byte_tokenizer, "m", 512).chat({"messages": msgs}).params[0]
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)


def test_a_bad_default_flag_is_one_line(capsys):
    from lowbit.runtime.cli.main import main

    assert main(["run", "--temperature", "-1", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lowbit: error:") and "temperature" in err and err.count("\n") == 1
