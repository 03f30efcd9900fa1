"""The SentencePiece (`tokenizer.ggml.model = "llama"`) path, on a tiny llama-style vocabulary
written here with gguf.GGUFWriter and checked against llama.cpp loading the same file."""

import ctypes
import importlib
import random
from pathlib import Path

import gguf
import pytest

from lowbit.runtime.load.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Tokenizer

_WORDS = ("the quick brown fox jumps over lazy dog hello world token izer piece sentence running "
          "runner ing tion ation and or but café").split()
_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'-\n\t\u2581é"


def _vocab() -> list[tuple[str, float, int]]:
    """(text, score, type): specials, 256 byte tokens, a user-defined token, single characters,
    then every prefix of each word (with and without '▁') so each piece is reachable by a merge;
    earlier pieces score higher."""
    vocab = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    vocab += [(f"<0x{b:02X}>", 0.0, BYTE) for b in range(256)]
    vocab += [("<|user|>", 0.0, USER_DEFINED)]
    vocab += [(c, -1000.0 - i, NORMAL) for i, c in enumerate(_ALPHABET)]
    pieces: list[str] = []
    for w in _WORDS:
        for word in ("\u2581" + w, w):
            pieces += [word[:k] for k in range(2, len(word) + 1) if word[:k] not in pieces]
    pieces += ["\u2581\u2581", "\u2581\u2581\u2581\u2581", "\n\n", "\u2581the\u2581"]
    return vocab + [(p, -float(i), NORMAL) for i, p in enumerate(pieces)]


def _write(path: Path, add_space_prefix: bool, vocab=None) -> Path:
    vocab = vocab or _vocab()
    w = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads the model's hyperparameters even with vocab_only; no tensors are needed.
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    w.add_tokenizer_model("llama")
    w.add_token_list([t for t, _, _ in vocab])
    w.add_token_scores([s for _, s, _ in vocab])
    w.add_token_types([ty for _, _, ty in vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    w.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _strings() -> list[str]:
    fixed = ["", " ", "  ", "the quick brown fox", "  hello  world ", "héllo wörld 日本 😀",
             "<s>the<|user|>running</s>x", "\n\nthe\tdog", "runner's tokenizer", "The Café",
             "thethethe", "sentencepiece", "a<|user|>", "<|user|><|user|>", "</s>", "ñ", "\u2581x"]
    rng = random.Random(7)
    pool = list(_WORDS) + ["<s>", "</s>", "<|user|>", "é", "😀", "日本", "Z", "12", "!?", "'"]
    seps = ["", " ", "  ", "\n", "\t", " \n"]
    mixed = ["".join(rng.choice(pool) + rng.choice(seps) for _ in range(rng.randint(1, 10)))
             for _ in range(120)]
    return fixed + mixed


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_space_prefix"])
def pair(request, tmp_path_factory):
    llama_cpp = importlib.import_module("llama_cpp")
    path = _write(tmp_path_factory.mktemp("spm") / "tiny.gguf", request.param)
    return Tokenizer.from_gguf(path), llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def test_spm_ids_match_llama_cpp(pair):
    tok, llama = pair
    assert tok.vocab_size == llama.n_vocab() and tok.add_bos and tok.bos_id == 1
    strings = _strings()
    for add_special in (False, True):
        bad = [(s, ids, ref) for s in strings
               if (ids := tok.encode(s, add_special)) != (ref := llama.tokenize(
                   s.encode(), add_bos=add_special, special=True))]
        assert not bad, f"{len(bad)}/{len(strings)} differ, first: {bad[:3]!r}"


def test_spm_pieces_and_decode(pair):
    import llama_cpp

    tok, llama = pair
    vocab = llama_cpp.llama_model_get_vocab(llama.model)
    buf = ctypes.create_string_buffer(64)
    for i in range(tok.vocab_size):
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, 64, 0, True)
        assert tok.token_bytes(i) == buf.raw[:n], i
    assert tok.token_bytes(3 + 0x41) == b"A"  # <0x41>: byte tokens start after 3 specials
    for s in _strings():
        # A '▁' is read as a space, and every special token gets a '▁' after it: skip those.
        if "<" not in s and "\u2581" not in s:
            assert tok.decode(tok.encode(s), skip_special=True) == s
    assert tok.eos_ids == {2}


def test_spm_chat(pair):
    tok, llama = pair
    msgs = [{"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<s>hello world</s>"
    ids = tok.encode_chat(msgs)
    assert ids == llama.tokenize(text.encode(), add_bos=False, special=True) and ids.count(1) == 1


# ---- a vocabulary trained by SentencePiece itself -----------------------------------------

_ENGLISH = ("the of and to in is was for that with as on by at from his her it an were are which "
            "this be has had not but first one their its new after also who they two been year "
            "city school team season game music film album song war river village church between "
            "during under would could people world national known called played released "
            "Tokyo café naïve Zürich São Paulo Kraków über déjà vu 東京 日本語 Москва 😀").split()


def _corpus(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_ENGLISH) for _ in range(rng.randint(3, 25))]
        words += [str(rng.randint(0, 10 ** rng.randint(1, 6)))] if rng.random() < 0.5 else []
        rng.shuffle(words)
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", " ;", "  --"]))
    return lines


def test_trained_sentencepiece_matches_spm_and_llama_cpp(tmp_path):
    """Real SentencePiece BPE (byte fallback, a user-defined symbol): ids must equal both the
    sentencepiece library's and llama.cpp's on the same vocabulary."""
    import io

    spm = importlib.import_module("sentencepiece")
    llama_cpp = importlib.import_module("llama_cpp")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus(3000)), model_writer=model, vocab_size=800, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, user_defined_symbols=["<|user|>"],
        allow_whitespace_only_pieces=True, hard_vocab_limit=False, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())

    def kind(i: int) -> int:
        return (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else BYTE if sp.is_byte(i)
                else USER_DEFINED if sp.id_to_piece(i) == "<|user|>" else NORMAL)

    vocab = [(sp.id_to_piece(i), sp.get_score(i), kind(i)) for i in range(sp.get_piece_size())]
    path = _write(tmp_path / "spm.gguf", True, vocab)
    tok = Tokenizer.from_gguf(path)
    llama = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    strings = _corpus(150, seed=11) + _strings()
    for s in strings:
        ids = tok.encode(s, add_special=False)
        assert ids == llama.tokenize(s.encode(), add_bos=False, special=True), s
        if "<" not in s:  # sentencepiece knows nothing of special tokens in text
            assert ids == sp.encode(s), s
            assert tok.decode(ids) == s or "\u2581" in s
