"""Tokenizer tests: ids against llama.cpp (llama-cpp-python, vocab_only), chat templates
against transformers, the tokenizer.json path against the GGUF path, and a tiny
SentencePiece-style GGUF written here against llama.cpp."""

import importlib
import json
import random
from pathlib import Path

import gguf
import pytest

from lowbit.runtime.load.tokenizer import Tokenizer

# ---- test strings ---------------------------------------------------------------------------

_FIXED = [
    "", " ", "  ", "\n", "\t", "\r\n", "Hello world", " Hello world", "Hello world ", "  leading",
    "trailing  ", "   both   ", "Hello, world! How's it going?", "I'm sure you're right; they'll "
    "see we've done what I'd've said.", "DON'T SHOUT, IT'S RUDE", "She said 'hi' and 'bye'.",
    "rock 'n' roll", "'s 't 're 've 'm 'll 'd", "o'clock y'all ma'am",
    # numbers
    "0", "7", "42", "3.14159", "1,000,000", "-273.15°C", "2024-06-01T12:34:56Z", "v1.2.3-rc4",
    "+1 (555) 123-4567", "1e-9", "0xDEADBEEF", "9" * 40, "12 345 678", "x1y22z333w4444",
    "١٢٣٤ ٥٦٧", "१२३ ४५६", "Ⅻ ½ ² ③", "３．１４", "4/5 = 0.8 and 50%",
    # whitespace runs
    "a  b   c    d", "a\tb\t\tc", "line1\nline2\n\nline4\n\n\n", "a \n b \t\n c", "\n\n\n",
    "    indented code", "\t\tdouble tab", "trailing newline\n", "mixed \t \n \r\n end",
    " " * 17 + "x", "x" + " " * 9, "\u00a0nbsp\u00a0here", "ideo\u3000space", "em\u2003space",
    "line\u2028sep", "vtab\x0bform\x0cfeed", "nul\x00byte", "bell\x07 esc\x1b[0m",
    # scripts
    "Привет, мир! Как дела?", "Γειά σου Κόσμε", "שלום עולם", "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया", "হ্যালো বিশ্ব", "สวัสดีชาวโลก", "ສະບາຍດີ", "ሰላም ልዑል", "Բարեւ աշխարհ",
    "გამარჯობა", "你好，世界！今天天气很好。", "こんにちは世界、カタカナとひらがな", "안녕하세요 세계",
    "Tiếng Việt có dấu", "Zażółć gęślą jaźń", "Ærøskøbing straße façade naïve", "İstanbul ıi",
    "e\u0301 vs é (combining)", "Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇", "ﬁ ligature ﬂ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙",
    "ᚠᛇᚻ᛫ᛒᛦᚦ", "ꦲꦤꦕꦫꦏ", "𓀀𓀁𓀂 hieroglyphs", "Ελληνικά και English mixed 中文",
    # emoji
    "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "🇯🇵🇺🇸🇩🇪", "❤️‍🔥", "🧑🏿‍🚀 astronaut",
    "emoji😀inside😃words", "1️⃣2️⃣#️⃣", "👩‍💻👨🏻‍🍳🙋‍♀️", "☺︎ vs ☺️",
    # code
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "fn main() -> Result<(), Box<dyn Error>> {\n    let v: Vec<u8> = vec![1, 2];\n    Ok(())\n}",
    "const add = (a, b) => a + b; // arrow fn\nconsole.log(`sum=${add(1, 2)}`);",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\"}}",
    "$ ls -la | grep '^d' && echo \"done\" >> /tmp/log 2>&1",
    "x = [i**2 for i in range(10) if i % 2 == 0]",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}",
    "\\begin{equation} E = mc^2 \\end{equation}", "a != b && c <= d || !e", "::->=>>>=<<=...",
    "@decorator\nclass Foo(Bar, metaclass=Meta):\n    pass", "    # comment\n        deeper",
    "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.co.uk",
    # special tokens and chat-templated prompts
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|><|im_end|>",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "text<|endoftext|>more text", " <|im_end|> spaced ", "<|im_start|user", "<|im_end|>>",
    "<repo_name>lowbit<file_sep>main.py", "<|im_start|>assistant\nSure! Here's code:\n```py\nprint(1)\n```<|im_end|>",
    # long words
    "a" * 300, "supercalifragilisticexpialidocious" * 8, "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "ab" * 150, "🙂" * 50, "日本" * 80, "x_" * 100 + "end", "-" * 64, "=" * 80 + "\n",
]

_FRAGMENTS = [
    "the", "The", " quick", "brown", " fox", "jumps", "over", "lazy", "dog", "don't", "I'll",
    "hello", "World", "naïve", "café", "über", "Москва", "東京", "서울", "مرحبا", "हिन्दी",
    "😀", "👨‍👩‍👧", "🇫🇷", "123", "4567", "3.14", "1,024", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "()", "{}", "[]", "=>", "->", "::", "#", "$", "%", "&&", "||", "'",
    "\"", "`", "\\", "/", ".", ",", "!", "?", ";", ":", "…", "—", "–", "«", "»", "©", "™",
]
_SEPARATORS = ["", " ", "  ", "\n", "\t", " \n", "\n\n", "   ", "\r\n", "\u00a0", " \t "]
_CHARS = ("abcXYZ019 \n\t.,'\"!?-_" "éüßçñøå" "абвгд" "αβγ" "你好世界" "かなカナ" "한국"
          "ابت" "अआइ" "กขค" "😀🎉👍🏽" "\u200d\ufe0f\u0301" "∑∫√≤≥" "€£¥")


def _random_strings(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        if k % 3 == 2:  # raw character soup: odd joiners, combining marks, scripts side by side
            out.append("".join(rng.choice(_CHARS) for _ in range(rng.randint(1, 40))))
        else:
            parts = [rng.choice(_FRAGMENTS) + rng.choice(_SEPARATORS) for _ in range(rng.randint(1, 12))]
            out.append("".join(parts))
    return out


STRINGS = _FIXED + _random_strings(220)


# ---- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_meta(default_gguf: Path) -> dict:
    # GGUFReader takes seconds on a 49k vocabulary, so read once; from_gguf() itself (the same
    # reader plus from_gguf_metadata) runs on the tiny files of test_tokenizer_spm.py.
    reader = gguf.GGUFReader(default_gguf)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def tok(smol_meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_meta)


@pytest.fixture(scope="module")
def llama(default_gguf: Path):
    llama_cpp = importlib.import_module("llama_cpp")
    return llama_cpp.Llama(str(default_gguf), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def hf_tok(default_gguf: Path):
    transformers = importlib.import_module("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


def _mismatches(ours, theirs, strings):
    return [(s, a, b) for s, a, b in zip(strings, ours, theirs) if a != b]


# ---- default model: ids, bytes, round trips -------------------------------------------------

def test_ids_match_llama_cpp(tok, llama):
    assert len(STRINGS) >= 300
    ours = [tok.encode(s, add_special=False) for s in STRINGS]
    theirs = [llama.tokenize(s.encode(), add_bos=False, special=True) for s in STRINGS]
    bad = _mismatches(ours, theirs, STRINGS)
    assert not bad, f"{len(bad)}/{len(STRINGS)} differ, first: {bad[:3]!r}"


def test_add_special_matches_llama_cpp(tok, llama):
    assert tok.add_bos is False and tok.bos_id == 1  # SmolLM2's GGUF: add_bos_token = false
    for s in STRINGS[:40]:
        assert tok.encode(s) == llama.tokenize(s.encode(), add_bos=True, special=True)


def test_decode_round_trip(tok):
    for s in STRINGS:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert b"".join(tok.token_bytes(i) for i in ids) == s.encode()


def _llama_piece(llama, i: int) -> bytes:
    # Llama.detokenize() gives b"" for pieces over 32 bytes (a fixed buffer), so call the C API.
    import ctypes

    import llama_cpp

    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(llama_cpp.llama_model_get_vocab(llama.model), i, buf, 512, 0, True)
    return buf.raw[:n]


def test_token_bytes_match_llama_cpp(tok, llama):
    assert tok.vocab_size == llama.n_vocab() == 49152
    bad = [i for i in range(tok.vocab_size) if tok.token_bytes(i) != _llama_piece(llama, i)]
    assert not bad, f"{len(bad)} token pieces differ, first ids {bad[:10]}"


def test_eos_ids_within_llama_cpp_eog(tok, llama):
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    eog = {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    # llama.cpp also stops on FIM tokens (here <reponame>, id 4); a chat never emits those.
    assert tok.eos_ids == eog - {4} == {0, 2}


def test_skip_special_and_specials(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and ids[-2] == 2 and {1, 2} <= tok.special_ids
    assert tok.decode(ids, skip_special=True) == "user\nhi\n"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)
    assert tok.decode([tok.encode("😀")[0]]) == "\ufffd"  # a partial character, not an exception


# ---- chat template --------------------------------------------------------------------------

_CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
     {"role": "user", "content": "Tell me a joke about <tags> & \"quotes\"."}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "x"},
     {"role": "assistant", "content": "y", "tool_calls": None}],
]


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", range(len(_CHATS)))
def test_chat_template_matches_transformers(tok, hf_tok, llama, chat, gen):
    messages = _CHATS[chat]
    text = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.encode_chat(messages, add_generation_prompt=gen) == llama.tokenize(
        text.encode(), add_bos=True, special=True)


def test_chat_template_literal(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
                                   add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n")


_TEMPLATES = [
    # Llama-3-like: whitespace control, namespace, strftime_now, tools through tojson(indent)
    "{{- bos_token }}{%- set ns = namespace(sys='') %}{%- for m in messages %}"
    "{%- if m.role == 'system' %}{%- set ns.sys = m.content %}{%- endif %}{%- endfor %}"
    "<|start|>system\nDate: {{ strftime_now('%Y') | length }}\n{{ ns.sys }}"
    "{%- if tools is not none %}\nTools:\n{{ tools | tojson(indent=4) }}{%- endif %}<|end|>\n"
    "{%- for m in messages if m.role != 'system' %}\n<|start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content | trim }}"
    "{%- elif m.content is defined %}{{ m.content | tojson }}{%- endif %}"
    "{%- if m.tool_calls is defined %}[calls: {{ m.tool_calls | map(attribute='name') | join(',') }}]"
    "{%- endif %}<|end|>{%- endfor %}{%- if add_generation_prompt %}\n<|start|>assistant\n{%- endif %}",
    # Qwen3-like: reasoning_content alias, loop controls, raise_exception on a bad role
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role') }}{% endif %}{% if loop.index0 > 5 %}{% break %}{% endif %}\n"
    "  <|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
    "</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>{% endif %}{% endif %}",
]
_RICH_CHAT = [
    {"role": "system", "content": "  Be <brief> & \"exact\".  "},
    {"role": "user", "content": "Weather in Zürich? 日本"},
    {"role": "assistant", "content": None, "reasoning": "use the tool",
     "tool_calls": [{"name": "weather", "arguments": {"city": "Zürich"}}]},
    {"role": "tool", "content": [{"type": "text", "text": "21°C"}]},
]


@pytest.mark.parametrize("template", range(len(_TEMPLATES)))
def test_template_environment_matches_transformers(tok, template):
    cu = importlib.import_module("transformers.utils.chat_template_utils")
    source = _TEMPLATES[template]
    ours = _with_template(tok, source)
    specials = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    for gen, kwargs in [(True, {}), (False, {"tools": tools}), (True, {"enable_thinking": False})]:
        chat = [{k: v for k, v in m.items() if v is not None} for m in _RICH_CHAT]
        (want,), _ = cu.render_jinja_template(
            conversations=[chat], chat_template=source, add_generation_prompt=gen,
            **{**specials, **kwargs})
        assert ours.apply_chat_template(_RICH_CHAT, add_generation_prompt=gen, **kwargs) == want


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.backend, [tok.token_bytes(i) for i in range(tok.vocab_size)],
                     special_ids=tok.special_ids, bos_id=tok.bos_id, eos_ids=tok.eos_ids,
                     add_bos=True, add_space_prefix=False, chat_template=template,
                     template_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})


def test_chat_template_features_and_errors(tok):
    msgs = [{"role": "user", "content": "hi"}]
    t = _with_template(tok, "{{ bos_token }}{{ messages[0] | tojson }}|{{ extra }}|{{ strftime_now('%Y') | length }}")
    assert t.apply_chat_template(msgs, extra="kw") == '<|im_start|>{"role": "user", "content": "hi"}|kw|4'
    ids = t.encode_chat(msgs, extra="kw")
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's BOS is not doubled
    with pytest.raises(ValueError, match=r"^chat template error: no system role$"):
        _with_template(tok, "{{ raise_exception('no system\n role') }}").apply_chat_template(msgs)
    with pytest.raises(ValueError, match="chat template error"):
        _with_template(tok, "{{ messages.__class__.__mro__ }}").apply_chat_template(msgs)
    with pytest.raises(ValueError, match="does not compile"):
        _with_template(tok, "{% for %}")
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tok, None).apply_chat_template(msgs)
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])


# ---- other pre-tokenizers: SmolLM2's vocabulary re-labelled, against llama.cpp --------------

@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2", "tekken", "falcon"])
def test_pre_tokenizers_match_llama_cpp(smol_meta, pre, tmp_path):
    """Same tokens and merges, another `tokenizer.ggml.pre`: the regex split (and, for llama-bpe
    and tekken, ignore_merges and BOS) must still follow llama.cpp."""
    llama_cpp = importlib.import_module("llama_cpp")
    path = tmp_path / f"{pre}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_context_length, 64), (w.add_embedding_length, 8),
                       (w.add_block_count, 1), (w.add_feed_forward_length, 16),
                       (w.add_head_count, 2), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_dimension_count, 4)]:
        add(value)  # llama.cpp reads hyperparameters even with vocab_only
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(smol_meta["tokenizer.ggml.tokens"])
    w.add_token_types(smol_meta["tokenizer.ggml.token_type"])
    w.add_token_merges(smol_meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    meta = {**smol_meta, "tokenizer.ggml.pre": pre}
    del meta["tokenizer.ggml.add_bos_token"]  # let the pre type pick the default, as llama.cpp
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.add_bos == (pre in ("llama-bpe", "tekken"))
    ours = [tok.encode(s) for s in STRINGS]
    theirs = [llama.tokenize(s.encode(), add_bos=True, special=True) for s in STRINGS]
    bad = _mismatches(ours, theirs, STRINGS)
    assert not bad, f"{len(bad)}/{len(STRINGS)} differ, first: {bad[:3]!r}"


# ---- metadata errors ------------------------------------------------------------------------

def test_bad_metadata_errors():
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({})
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    assert Tokenizer.from_gguf_metadata(base).encode("abba") == [2, 1, 0]
    with pytest.raises(ValueError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata({k: v for k, v in base.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(ValueError, match="token_type"):
        Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.token_type": [1]})
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_gguf("/nonexistent/model.gguf")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir("/nonexistent")


# ---- tokenizer.json path --------------------------------------------------------------------

def test_hf_dir_follows_tokenizer_json(hf_tok, tmp_path):
    # Whatever tokenizer.json says is what from_hf_dir does: same ids as transformers itself.
    hf_tok.save_pretrained(tmp_path)
    hf = Tokenizer.from_hf_dir(tmp_path)
    ours = [hf.encode(s, add_special=False) for s in STRINGS]
    theirs = [hf_tok.encode(s, add_special_tokens=False) for s in STRINGS]
    bad = _mismatches(ours, theirs, STRINGS)
    assert not bad, f"{len(bad)} differ, first: {bad[:3]!r}"


def test_hf_dir_matches_gguf(tok, hf_tok, tmp_path):
    hf_tok.save_pretrained(tmp_path)
    # transformers converts the GGUF with plain GPT-2 splitting, but SmolLM2's own
    # tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) first cuts every digit apart;
    # without that, 34 of these strings differ (e.g. "a   123"). Put the repo's splitter back.
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert (hf.vocab_size, hf.bos_id, hf.eos_ids, hf.add_bos) == (
        tok.vocab_size, tok.bos_id, tok.eos_ids, tok.add_bos)
    assert hf.special_ids == tok.special_ids and hf.chat_template == tok.chat_template
    ours = [hf.encode(s) for s in STRINGS]
    bad = _mismatches(ours, [tok.encode(s) for s in STRINGS], STRINGS)
    assert not bad, f"{len(bad)} differ, first: {bad[:3]!r}"
    assert all(hf.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size))
    assert hf.apply_chat_template(_CHATS[1]) == tok.apply_chat_template(_CHATS[1])


def test_a_text_too_long_for_the_limit_is_refused_before_it_is_encoded(tok):
    """PromptTooLong's bound (the text's length / the longest token's bytes, 81 here) is a true lower bound
    (never above the real count) on every test string and on long ones of repeated pieces, refuses past the
    limit without encoding, and lets through what fits; a normalizer that may delete text gives no bound."""
    from tokenizers import normalizers

    from lowbit.runtime.load.tokenizer import PromptTooLong, _chars_per_token

    longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
    pieces = sorted(range(tok.vocab_size), key=lambda i: -len(tok.token_bytes(i)))[:50]
    texts = STRINGS + [tok.decode(pieces * 40), "x" * 50_000, " " * 9_000, "é" * 9_000]
    for text in texts:
        n = len(tok.encode(text, add_special=False))
        assert -(-len(text) // longest) <= n, (text[:40], n)
        assert tok.encode(text, add_special=False, limit=n) == tok.encode(text, add_special=False)
    with pytest.raises(PromptTooLong) as e:
        tok.encode("a" * 700_000, limit=8191)
    assert e.value.at_least == -(-700_000 // longest) == 8642
    # the normalizer decides whether the bound holds (each case by hand: what it can do to a text's length)
    backend = tok.backend
    cases = [(None, 81), (normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]), 81),
             (normalizers.NFC(), 243), (normalizers.Replace("ab", ""), None), (normalizers.BertNormalizer(), None)]
    for normalizer, want in cases:
        backend.normalizer = normalizer
        try:
            assert _chars_per_token(backend, longest) == want, normalizer
        finally:
            backend.normalizer = None
