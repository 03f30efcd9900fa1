"""Tokenizer: text <-> token ids and chat prompts, for a GGUF or a HF tokenizer directory.

The ids come from a HF `tokenizers.Tokenizer`: built in memory from GGUF metadata so that it
gives llama.cpp's ids (see tokenizer_gguf.py), or loaded from `tokenizer.json`. Decoding goes
through a table of each token's raw bytes (`token_bytes`) rather than the HF decoder, so
`decode` and a streaming detokenizer always agree. The chat template lives in chat_template.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from .chat_template import ChatTemplate
from .tokenizer_gguf import (  # noqa: F401  (token types re-exported for callers and tests)
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    byte_level_bytes,
    end_of_turn_ids,
    gpt2_byte_decoder,
    spm_bytes,
    tokenizer_parts,
)


class PromptTooLong(Exception):
    """A text that cannot fit `limit` tokens, told from its length alone: it spells at least `at_least`."""

    def __init__(self, at_least: int):
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class Tokenizer:
    """Encode/decode plus the model's chat template. Build with `from_gguf`,
    `from_gguf_metadata` or `from_hf_dir`, not the constructor."""

    def __init__(self, backend: tokenizers.Tokenizer, pieces: Sequence[bytes], *,
                 special_ids: frozenset[int], bos_id: int | None, eos_ids: frozenset[int],
                 add_bos: bool, add_space_prefix: bool, chat_template: str | None,
                 template_tokens: Mapping[str, str | None], fim: tuple[int, int, int] | None = None):
        self._backend = backend
        self._pieces = tuple(pieces)            # id -> raw bytes of that token
        self.vocab_size: int = len(self._pieces)
        self.special_ids = special_ids          # ids `decode(skip_special=True)` drops
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        # SentencePiece: encode prepends '▁' to the text, so decode drops one leading space.
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template, template_tokens) if chat_template else None
        # fill-in-the-middle: the (prefix, suffix, middle) token ids, from GGUF metadata or found by their text
        # (runtime/server/fim.py builds the prompt); None: the model was not trained for it
        self.fim = fim or _fim_by_text(self._pieces)
        # Characters per token at most, for a bound on a text's token count before it is encoded (None: no
        # bound): a token spells at most the longest piece's bytes (SmolLM2: 81) and a character is at least one
        # byte, unless the normalizer shrinks the text — NFC/NFKC compose up to 3 characters into 1 (Hangul
        # jamo); other steps that may delete text (a Replace of a longer pattern, BERT's cleaning) give no bound.
        self._chars_per_token = _chars_per_token(backend, max((len(p) for p in self._pieces), default=1))

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from lowbit.runtime.errors import LowbitError
        from lowbit.runtime.load.gguf_file import GGUFFile

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        try:
            meta = GGUFFile(path).metadata
        except LowbitError as e:
            raise ValueError(str(e)) from None
        return cls.from_gguf_metadata({k: v for k, v in meta.items() if k.startswith("tokenizer.")})

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        return cls(**tokenizer_parts(meta))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own Exception type with a long message
            raise ValueError(f"cannot load {path / 'tokenizer.json'}: {_one_line(e)}") from None
        spec = json.loads(backend.to_str())
        kind = (spec.get("model") or {}).get("type")
        if kind not in ("BPE", "Unigram"):  # WordPiece/WordLevel: encoder models, not LLMs
            raise ValueError(f"unsupported tokenizer.json model type {kind!r} in {path}")
        config = _read_json(path / "tokenizer_config.json")
        specials_map = _read_json(path / "special_tokens_map.json")
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        text_of = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
        n = max(text_of) + 1
        byte_level = _has_step(spec.get("decoder"), "ByteLevel")
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        decoder = gpt2_byte_decoder()
        # Added tokens print as written (as llama.cpp prints special and user-defined tokens);
        # an id with no token (a hole in the vocabulary) prints nothing.
        pieces = [text_of.get(i, "").encode() if i in added or i not in text_of
                  else byte_level_bytes(text_of[i], decoder) if byte_level
                  else spm_bytes(text_of[i], byte_fallback) for i in range(n)]
        special = frozenset(i for i, t in added.items() if t.special)

        def named(name: str) -> tuple[str | None, int | None]:
            value = config.get(name, specials_map.get(name))
            value = value.get("content") if isinstance(value, dict) else value
            return (value, backend.token_to_id(value)) if isinstance(value, str) else (None, None)

        names = {k: named(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos, eos = names["bos_token"][1], names["eos_token"][1]
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No flag: the post-processor (TemplateProcessing) decides whether HF adds BOS.
            with_special = backend.encode("a", add_special_tokens=True).ids
            plain = backend.encode("a", add_special_tokens=False).ids
            add_bos = bos is not None and with_special[:1] == [bos] and plain[:1] != [bos]
        ends = {eos} if eos is not None else set()
        for extra in ("generation_config.json", "config.json"):  # these list every end id
            value = _read_json(path / extra).get("eos_token_id")
            ends.update(v for v in (value if isinstance(value, list) else [value])
                        if isinstance(v, int) and 0 <= v < n)
        ends |= end_of_turn_ids({text_of[i]: i for i in special if i in text_of})
        return cls(backend, pieces, special_ids=special, bos_id=bos, eos_ids=frozenset(ends),
                   add_bos=add_bos and bos is not None,
                   add_space_prefix=_strips_leading_space(spec.get("decoder")),
                   chat_template=_hf_chat_template(path, config),
                   template_tokens={k: v[0] for k, v in names.items() if v[0] is not None})

    # ---- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, limit: int | None = None) -> list[int]:
        """ids of `text`. limit: raise PromptTooLong, without encoding, when the text's length alone shows it
        spells more than `limit` tokens (a 7 MB prompt: at least 86k tokens, told in microseconds where
        encoding takes 4.7 s)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        if limit is not None and self._chars_per_token is not None:
            at_least = -(-len(text) // self._chars_per_token)
            if at_least > limit:
                raise PromptTooLong(at_least)
        # the batch call releases the GIL while it encodes (`encode` holds it: 4.4 s without a switch for
        # 7 MB of text, against a longest 0.34 s pause, measured), so the server's streams keep flowing
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, id: int) -> bytes:
        """Raw bytes of one token (may be part of a UTF-8 character). Special tokens give their
        text; SentencePiece pieces keep the space that '▁' stands for (see `add_space_prefix`)."""
        if not 0 <= id < self.vocab_size:
            raise ValueError(f"token id {id} is outside the vocabulary (size {self.vocab_size})")
        return self._pieces[id]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; `skip_special` drops control/unknown tokens (not user-defined ones)."""
        pieces = [self.token_bytes(int(i)) for i in ids
                  if not (skip_special and int(i) in self.special_ids)]
        if self.add_space_prefix and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        # A sequence can end inside a multi-byte character (e.g. mid-generation).
        return b"".join(pieces).decode("utf-8", errors="replace")

    # ---- chat -----------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template (tokenizer.chat_template); "
                             "format the prompt yourself (lowbit run --raw)")
        return self._template.render(messages, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, limit: int | None = None,
                    **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        ids = self.encode(text, add_special=False, limit=limit)
        # Many templates write `{{ bos_token }}` themselves; adding another would double it.
        if self.add_bos and not (ids and ids[0] == self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The HF tokenizer doing the encoding (special tokens already added; no BOS added)."""
        return self._backend


# the FIM markers of the code families, as their tokenizers spell them: (prefix, suffix, middle)
FIM_TEXTS = ((b"<|fim_prefix|>", b"<|fim_suffix|>", b"<|fim_middle|>"),  # Qwen2.5/3-Coder, CodeGemma
             (b"<fim_prefix>", b"<fim_suffix>", b"<fim_middle>"),  # StarCoder 2, Granite Code
             ("<｜fim▁begin｜>".encode(), "<｜fim▁hole｜>".encode(), "<｜fim▁end｜>".encode()),  # DeepSeek-Coder
             (b"[PREFIX]", b"[SUFFIX]", b"[MIDDLE]"),  # Codestral
             (b" <PRE>", b" <SUF>", b" <MID>"))  # Code Llama (SentencePiece's '\u2581<PRE>')


def _fim_by_text(pieces: Sequence[bytes]) -> tuple[int, int, int] | None:
    """The first FIM_TEXTS triple the vocabulary holds whole, as ids (what llama.cpp's vocab loader guesses
    when a GGUF names none)."""
    ids = {p: i for i, p in enumerate(pieces) if len(p) < 32}
    for triple in FIM_TEXTS:
        if all(t in ids for t in triple):
            return tuple(ids[t] for t in triple)
    return None


def _chars_per_token(backend: tokenizers.Tokenizer, longest: int) -> int | None:
    """The most characters of input one token can stand for (see Tokenizer.__init__), or None."""
    model = json.loads(backend.model.__getstate__())
    if model.get("type") in ("WordPiece", "WordLevel") or (model.get("unk_token") is not None and not model.get(
            "byte_fallback") and (model.get("fuse_unk") or model.get("type") == "Unigram")):
        return None  # an unknown token may stand for a whole word (or a run of unknown characters)
    if backend.normalizer is None:
        return longest
    shrink = 1
    for step in _steps(json.loads(backend.normalizer.__getstate__())):
        kind = step.get("type")
        if kind in ("NFC", "NFKC"):
            shrink = 3
        elif kind == "Replace":  # one character for a non-empty string: never shorter (SentencePiece's ' ' → '▁')
            pattern = step.get("pattern", {})
            if not (len(pattern.get("String", "")) == 1 and step.get("content")):
                return None
        elif kind not in ("Prepend", "Lowercase", "NFD", "NFKD"):
            return None
    return longest * shrink


# ---- reading a HF tokenizer directory -------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot parse {path}: {_one_line(e)}") from None
    return value if isinstance(value, dict) else {}


def _steps(node: Any) -> list[dict]:
    """A decoder/normalizer JSON node flattened: Sequence nodes list their parts."""
    if not isinstance(node, dict):
        return []
    parts = node.get("decoders") or node.get("normalizers") or node.get("pretokenizers")
    return [s for p in parts for s in _steps(p)] if isinstance(parts, list) else [node]


def _has_step(node: Any, kind: str) -> bool:
    return any(s.get("type") == kind for s in _steps(node))


def _strips_leading_space(decoder: Any) -> bool:
    # Llama-style: Strip(' ', start=1); Metaspace decoders drop the prepended '▁' themselves.
    for s in _steps(decoder):
        if s.get("type") == "Strip" and s.get("start", 0) > 0:
            return True
        if s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never":
            return True
    return False


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it apart
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": …}, …]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
