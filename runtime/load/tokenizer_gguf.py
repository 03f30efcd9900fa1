"""GGUF tokenizer metadata -> the parts of a `Tokenizer` (same ids as llama.cpp).

A GGUF carries no tokenizer.json, only llama.cpp's description of one (`tokenizer.ggml.*`:
tokens, merges, scores, token types, special ids). We rebuild a HF `tokenizers.Tokenizer` in
memory from it, choosing the pieces the way llama.cpp's llama-vocab.cpp does:

- `gpt2` (byte-level BPE): the file's merges; the text is split by llama.cpp's regex list for
  `tokenizer.ggml.pre`, each regex cutting the pieces the previous one left, then mapped to
  GPT-2's byte alphabet. llama3-style vocabularies also skip merging a piece that already is a
  token (`ignore_merges`).
- `llama` (SentencePiece BPE): spaces become '▁', a '▁' is prepended to every run of text
  (llama.cpp does this after each special token too, not just at the start), merges are
  rebuilt from the scores (best-scoring merged piece first), and characters outside the
  vocabulary fall back to `<0xNN>` byte tokens.

Tokens typed CONTROL, USER_DEFINED or UNKNOWN are matched whole in the text before anything
else, like llama.cpp's `tokenize(parse_special=True)`. Each token's bytes are what llama.cpp's
token_to_piece prints, so `decode` and a streaming detokenizer agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes, copied from llama.cpp's llm_tokenizer_bpe (llama-vocab.cpp), which
# adapted the HF originals to std::regex (e.g. `(?i:'s|…)` spelled out as `'[sS]|…`).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's tekken, as in its tokenizer.json (llama.cpp approximates \p{Lu}/\p{Ll} with [^a-z]
# tricks because std::regex lacks them; Oniguruma has them, so we keep the original).
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)  # starcoder-family vocabularies: one digit per token


def _pre(regexes: tuple[str, ...], llama3_style: bool = False) -> tuple[tuple[str, ...], bool]:
    return regexes, llama3_style


# `tokenizer.ggml.pre` -> (regexes applied in turn, llama3_style), grouped as llama.cpp does.
# llama3_style: `ignore_merges` (a piece that is already a token is not merged up from its
# characters) and BOS added by default.
_PRE_TOKENIZERS = MappingProxyType({
    "default": _pre(_DEFAULT),
    **{n: _pre((_GPT2,)) for n in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais")},
    **{n: _pre(_DIGITS_THEN_GPT2) for n in (
        "smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")},
    **{n: _pre((_LLAMA3,), True) for n in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral")},
    **{n: _pre((_LLAMA3,)) for n in ("dbrx", "smaug-bpe")},
    **{n: _pre((_QWEN2,)) for n in ("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan")},
    "tekken": _pre((_TEKKEN,), True),
    "falcon": _pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
})

# Token texts that end a turn, from llama.cpp's end-of-generation list (FIM tokens left out:
# they end an infill, not a chat turn). Matched only on CONTROL/special tokens.
_END_OF_TURN_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "</s>", "<eos>"))


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet reversed: printable bytes stand for themselves, the other 68 are
    shifted to U+0100.. so that every byte is a visible character ('Ġ' is the space)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def _meta(meta: Mapping[str, Any], key: str, kind: type, default: Any = ...) -> Any:
    value = meta.get(key)
    value = default if value is None else value
    if value is ...:
        raise ValueError(f"GGUF metadata has no {key!r}; cannot build the tokenizer")
    if kind is list and isinstance(value, tuple):
        value = list(value)
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"GGUF metadata {key!r} should be {kind.__name__}, "
                         f"got {type(value).__name__}")
    return value


def tokenizer_parts(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `Tokenizer(...)` from `tokenizer.*` metadata (key -> python value)."""
    model = _meta(meta, "tokenizer.ggml.model", str)
    tokens = list(_meta(meta, "tokenizer.ggml.tokens", list))
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF 'tokenizer.ggml.tokens' must be a non-empty list of strings")
    n = len(tokens)
    types = list(_meta(meta, "tokenizer.ggml.token_type", list, None) or [NORMAL] * n)
    if len(types) != n:
        raise ValueError(f"GGUF 'tokenizer.ggml.token_type' has {len(types)} entries, "
                         f"for {n} tokens")

    def special_id(name: str, default: int | None) -> int | None:
        value = _meta(meta, f"tokenizer.ggml.{name}_token_id", int, None)
        value = default if value is None else value
        # llama.cpp, too, treats an id outside the vocabulary as no token at all.
        return value if value is not None and 0 <= value < n else None

    vocab = {t: i for i, t in enumerate(tokens)}  # duplicates: the last id wins, as in llama.cpp
    if model == "gpt2":
        backend, add_bos_default = _byte_level_bpe(meta, vocab)
        add_space_prefix, defaults = False, (None, None, None)
        alphabet = gpt2_byte_decoder()
        text_pieces = [byte_level_bytes(t, alphabet) for t in tokens]
    elif model == "llama":
        add_space_prefix = _meta(meta, "tokenizer.ggml.add_space_prefix", bool, True)
        scores = list(_meta(meta, "tokenizer.ggml.scores", list))
        if len(scores) != n:
            raise ValueError(f"GGUF 'tokenizer.ggml.scores' has {len(scores)} entries, "
                             f"for {n} tokens")
        add_bos_default, defaults = True, (1, 2, 0)  # llama.cpp's SPM defaults: bos, eos, unk
        backend = _sentencepiece_bpe(tokens, vocab, scores, special_id("unknown", defaults[2]),
                                     add_space_prefix)
        text_pieces = [spm_bytes(t, ty == BYTE) for t, ty in zip(tokens, types)]
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r} "
                         "(supported: 'gpt2', 'llama')")

    # Control/unknown/user-defined tokens are matched whole before BPE, like parse_special.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in range(n) if types[i] in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i in range(n) if types[i] == USER_DEFINED])
    # As llama.cpp's token_to_piece: specials as written, UNUSED/undefined types as nothing.
    pieces = [t.encode() if ty in (CONTROL, UNKNOWN, USER_DEFINED)
              else piece if ty in (NORMAL, BYTE) else b""
              for t, ty, piece in zip(tokens, types, text_pieces)]
    special = frozenset(i for i in range(n) if types[i] in (CONTROL, UNKNOWN))

    bos, eos = special_id("bos", defaults[0]), special_id("eos", defaults[1])
    ends = {i for i in (eos, special_id("eot", None), special_id("eom", None)) if i is not None}
    ends |= end_of_turn_ids({tokens[i]: i for i in special})
    add_bos = _meta(meta, "tokenizer.ggml.add_bos_token", bool, add_bos_default)
    if add_bos and bos is None:
        raise ValueError("GGUF metadata asks for a BOS token (add_bos_token) but "
                         "'tokenizer.ggml.bos_token_id' is missing")
    template = _meta(meta, "tokenizer.chat_template", str, None)
    names = {"bos_token": bos, "eos_token": eos, "unk_token": special_id("unknown", defaults[2]),
             "pad_token": special_id("padding", None)}
    fim = tuple(special_id(f"fim_{part}", None) for part in ("pre", "suf", "mid"))  # llama.cpp's converter's
    return dict(backend=backend, pieces=pieces, special_ids=special, bos_id=bos,
                eos_ids=frozenset(ends), add_bos=add_bos, add_space_prefix=add_space_prefix,
                chat_template=template, fim=fim if None not in fim else None,
                template_tokens={k: tokens[v] for k, v in names.items() if v is not None})


# ---- building the HF tokenizer from GGUF metadata -------------------------------------------

def _merge_pairs(merges: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp's split: the first space after position 0
        if cut < 0:
            raise ValueError(f"bad merge {m!r} in 'tokenizer.ggml.merges' (expected 'left right')")
        a, b = m[:cut], m[cut + 1:]
        # A merge whose result is not a token can never be emitted; HF would refuse the model.
        if a in vocab and b in vocab and a + b in vocab:
            pairs.append((a, b))
    return pairs


def _byte_level_bpe(meta: Mapping[str, Any],
                    vocab: dict[str, int]) -> tuple[tokenizers.Tokenizer, bool]:
    """The HF tokenizer, and whether BOS is added by default."""
    pre = _meta(meta, "tokenizer.ggml.pre", str, None) or "default"  # as llama.cpp: missing
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 vocabulary "
                         f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})")
    regexes, llama3_style = _PRE_TOKENIZERS[pre]
    merges = _merge_pairs(_meta(meta, "tokenizer.ggml.merges", list), vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=llama3_style))
    # Each regex re-splits the pieces the previous one produced, keeping matches and the text
    # between them, exactly like llama.cpp's unicode_regex_split over a list of expressions.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, llama3_style


def byte_level_bytes(token: str, decoder: Mapping[str, int]) -> bytes:
    try:
        return bytes(decoder[c] for c in token)
    except KeyError:  # not spelled in the byte alphabet (a raw added token): take it verbatim
        return token.encode()


def _sentencepiece_bpe(tokens: list[str], vocab: dict[str, int], scores: list[float],
                       unk: int | None, add_space_prefix: bool) -> tokenizers.Tokenizer:
    # SentencePiece (and llama.cpp's port) repeatedly merges the adjacent pair whose joined
    # text is the best-scoring token. HF BPE applies merges by rank, so rank every
    # (left, right) split of every token by that token's score: same merges, same order.
    ranked = []
    for i, t in enumerate(tokens):
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[i]), i, vocab[a], a, b))
    ranked.sort()
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], byte_fallback=True,
                     unk_token=tokens[unk] if unk is not None else None, fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    # A normalizer, not Metaspace(prepend_scheme="first"): added tokens split the text first and
    # each remaining run is normalized alone, so every run gets its '▁', as in llama.cpp.
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok


def spm_bytes(token: str, is_byte: bool) -> bytes:
    if is_byte and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode()


def end_of_turn_ids(special_text_to_id: Mapping[str, int]) -> set[int]:
    ids = {i for t, i in special_text_to_id.items() if t in _END_OF_TURN_TEXTS}
    # gpt-oss ends a turn with <|return|>/<|call|>; its <|end|> only closes a message.
    if "<|return|>" in special_text_to_id and "<|call|>" in special_text_to_id:
        ids.discard(special_text_to_id.get("<|end|>"))
    return ids
