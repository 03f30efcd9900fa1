"""Each family's own chat format, end to end: its real template (llama.cpp's `models/templates/` from
the llama-cpp-python sdist, or tests/data/templates/ for Gemma 3 and Phi-4) renders as transformers
renders it, the server finds its tool-call format and think tags in it, and the tiny model of the
family (tests/family_models.py), converted by llama.cpp's converter with that template in the file,
answers through the `openai` client — plain, with tools required and auto — and the `ollama` client.

What a tiny random model can show: a required call always parses (the grammar constrains it) and
its arguments match the schema; what it writes unconstrained is noise, so `auto` is checked to
answer, not to call. The reasoning split itself is tested on scripted replies (test_reply_parser.py);
here each template's tags are found and Qwen3's `enable_thinking` reaches its template.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import jsonschema
import pytest

from lowbit.runtime.load.chat_template import ChatTemplate
from lowbit.runtime.server.reply import think_tags
from lowbit.runtime.server.tools import template_format
from tests import llama_cpp_source
from tests.family_models import build, save
from tests.helpers import serving

transformers = importlib.import_module("transformers")
openai = pytest.importorskip("openai")

DATA = Path(__file__).parent / "data" / "templates"
# family → (template file: llama.cpp's models/templates/ name, or data/… for the vendored ones;
#           its tool-call format; its think tags or None)
TEMPLATES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", "hermes", ("<think>", "</think>")),
    # llama.cpp keeps Unsloth's edit of SmolLM3's template, without its tool prompts: the generic format
    "smollm3": ("HuggingFaceTB-SmolLM3-3B.jinja", "generic", ("<think>", "</think>")),
    "gemma3": ("data/gemma-3-it.jinja", "generic", None),
    "phi3": ("data/phi-4.jinja", "generic", None),
    "ministral3": ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral", ("[THINK]", "[/THINK]")),
    "qwen3moe": ("Qwen-Qwen3-0.6B.jinja", "hermes", ("<think>", "</think>")),  # Qwen3-30B-A3B's is Qwen3's
    # harmony: reasoning is the analysis channel, not tags (runtime/server/harmony.py; tests/test_harmony.py)
    "gpt-oss": ("openai-gpt-oss-120b.jinja", "harmony", None),
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather in Paris?"}]
CALLED = CHAT + [  # a call and its result in the history (formats with tools)
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


@pytest.fixture(scope="session")
def converter() -> Path:
    return llama_cpp_source.converter_dir()


def template_text(converter: Path, family: str) -> str:
    name = TEMPLATES[family][0]
    path = DATA / name[5:] if name.startswith("data/") else converter / "models" / "templates" / name
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_template_renders_as_transformers_and_names_its_formats(family, converter, default_gguf):
    source = template_text(converter, family)
    fmt, tags = TEMPLATES[family][1:]
    assert template_format(source) == fmt and think_tags(source) == tags
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.chat_template = source
    ours = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    with_tools = [(CHAT, {"tools": TOOLS}), (CALLED, {"tools": TOOLS})]
    cases = [(CHAT, {}), (CHAT, {"tools": TOOLS})] if fmt == "generic" else with_tools
    if family in ("qwen3", "smollm3"):
        cases.append((CHAT, {"enable_thinking": False}))
    for messages, kw in cases:
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, bos_token="<s>",
                                       eos_token="</s>", **kw)
        assert ours.render(messages, True, **kw) == want, (family, kw)
    if family == "gemma3":  # the system prompt folds into the first user turn
        assert "<start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>" in ours.render(CHAT, True)
    if family == "qwen3":  # thinking off: an empty think block already in the prompt
        assert ours.render(CHAT, True, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, converter, default_gguf, tmp_path_factory):
    """The family's tiny model, its GGUF made by llama.cpp's converter with the family's template in the
    file (tokenizer.chat_template), quantized to Q8_0 and served in-process → (family, base URL)."""
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import AsyncEngine, Engine
    from lowbit.runtime.load.loader import load
    from lowbit.runtime.server.app import Served, build_app

    family = request.param
    d = tmp_path_factory.mktemp(f"chat-{family}")
    tok_dir = d / "tokenizer"
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.chat_template = template_text(converter, family)
    tok.save_pretrained(tok_dir)
    model = build(family, len(tok), seed=11)
    hf = save(model, tok_dir, d / "hf", family)
    f32 = llama_cpp_source.convert(converter, hf, d / "F32.gguf")
    q8 = llama_cpp_source.quantize(f32, d / "Q8_0.gguf", "Q8_0")
    lm = load(str(q8), "auto", progress=False)
    assert lm.tokenizer.chat_template == tok.chat_template  # the converter carried it into the file
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(kv_memory=16 << 20, max_num_seqs=4))
    with serving(build_app(Served(AsyncEngine(engine), lm.tokenizer, family, 2048))) as base:
        yield family, base


def test_openai_client_chats_and_calls_tools(served):
    family, base = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    plain = client.chat.completions.create(model=family, messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content is not None and plain.usage.completion_tokens >= 1
    required = client.chat.completions.create(model=family, messages=CHAT, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, temperature=0, parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls", required
    for c in calls:
        assert c.function.name == "get_weather"
        jsonschema.validate(json.loads(c.function.arguments), WEATHER)
    auto = client.chat.completions.create(model=family, messages=CALLED if TEMPLATES[family][1] != "generic" else CHAT,
                                          tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if family == "qwen3":  # enable_thinking reaches the template: the prompt grows by the empty think block
        off = client.chat.completions.create(model=family, messages=CHAT, max_tokens=1, temperature=0,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.usage.prompt_tokens > plain.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            client.chat.completions.create(model=family, messages=CHAT, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"messages": []}})


def test_ollama_client_chats_and_sees_thinking(served):
    ollama = pytest.importorskip("ollama")
    family, base = served
    client = ollama.Client(host=base, timeout=120)
    shown = client.show(family)
    caps = shown.capabilities or []
    info = shown.modelinfo or {}
    if family in ("qwen3moe", "gpt-oss"):  # what a token reads, beside what the model has (8 experts, 2 a token)
        arch = info["general.architecture"]
        assert info[f"{arch}.expert_count"] == 8 and info[f"{arch}.expert_used_count"] == 2
        assert info["lowbit.active_parameter_count"] < info["general.parameter_count"]
        size = next(m.size for m in client.list().models if m.model.startswith(family))
        assert 0 < info["lowbit.weight_bytes_per_token"] < size
    assert ("thinking" in caps) == (TEMPLATES[family][2] is not None or TEMPLATES[family][1] == "harmony"), caps
    r = client.chat(family, messages=CHAT, options={"temperature": 0, "num_predict": 8},
                    **({"think": False} if family == "qwen3" else {}))
    assert r.message.role == "assistant" and r.done
