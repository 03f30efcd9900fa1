"""Fill-in-the-middle prompts: editor autocomplete asks for the text between a prefix and a suffix.

The prompt is the one code models are trained on and llama-server's /infill writes (prefix-suffix-middle):
[BOS] <fim_prefix> prefix <fim_suffix> suffix <fim_middle> [what the user already typed of the middle],
with the model's own marker ids (Tokenizer.fim: GGUF's tokenizer.ggml.fim_*_token_id, or the markers found
by their text). Extra context chunks (llama-server's `input_extra`: other files of the project) lead the
prefix, each as a "filename\\ntext" block (not every model has repo-level markers).
"""

from __future__ import annotations

from lowbit.runtime.server.errors import bad_request


def fim_prompt(tok, prefix: str, suffix: str, middle: str = "", extra: list | None = None,
               limit: int | None = None) -> list[int]:
    """The FIM prompt's ids; a 400 when the model has no FIM markers. limit: refuse past it from the length
    alone (runtime/load/tokenizer.py PromptTooLong)."""
    fim = getattr(tok, "fim", None)
    if fim is None:
        raise bad_request("this model has no fill-in-the-middle tokens (a code model such as Qwen2.5-Coder, "
                          "StarCoder 2 or Codestral has them)", "suffix")
    pre, suf, mid = fim
    context = "".join(f"{c['filename']}\n{c['text']}\n" for c in _extra(extra))
    kw = {} if limit is None else {"limit": limit}
    ids = [pre, *tok.encode(context + prefix, add_special=False, **kw), suf,
           *tok.encode(suffix, add_special=False, **kw), mid, *tok.encode(middle, add_special=False, **kw)]
    return ([tok.bos_id] if tok.add_bos else []) + ids


def _extra(extra) -> list[dict]:
    """input_extra: a list of {"filename": str, "text": str} (filename optional)."""
    if extra is None:
        return []
    if not isinstance(extra, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                              and isinstance(c.get("filename", ""), str) for c in extra):
        raise bad_request("input_extra must be a list of {\"filename\": str, \"text\": str}", "input_extra")
    return [{"filename": c.get("filename", ""), "text": c["text"]} for c in extra]
