"""A saved reference (`lowbit eval reference MODEL --out ref.lbref`): the reference model's next-token
distributions over a text, kept small enough to ship, so that any number of files (other quantizers,
other bit widths, other layouts) can be scored against one original without holding it in memory.

Per scored token (the second half of each window, as `lowbit eval` scores) the file keeps the top-k
log-probabilities and their token ids (k = 64 by default), the log of the probability mass left outside
them (the tail), m tokens drawn from the tail in proportion to their probability with their
log-probabilities (m = 128), and the log-probability of the token that came next. llama-perplexity's
`--kl-divergence-base` keeps every logit instead: 11 GiB for 40 windows of a 152k vocabulary, where this
is 16 MB (10,240 tokens x 192 x 8 bytes). KL against it is exact on the top-k and estimated, with its
standard error, on the tail (runtime/eval/topk_kl.py).

The file is safetensors (tensors below, strings in its metadata), with the window token ids, so that the
text itself is not needed to score against it, and the tokenizer's pieces (id -> bytes), so that a
candidate whose tokenizer differs is refused by name rather than scored against other tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.runtime.eval.evaluate import perplexity, window_logprobs, windows

FORMAT = "lowbit-reference/1"
ROWS = ("top_ids", "top_lp", "log_tail", "tail_ids", "tail_lp", "target_lp")  # per scored token
DEFAULT_TOP_K = 64
DEFAULT_TAIL_DRAWS = 128  # per token: the mean KL's tail estimate then has a standard error of ~1% of int8's KL
SEED = 0  # the draws are the same on every run of the same model and text


@dataclass
class SavedReference:
    ids: torch.Tensor  # [W, ctx] int32: the windows' token ids
    top_ids: torch.Tensor  # [N, k] int32: per scored token, the reference's k likeliest next tokens, likeliest first
    top_lp: torch.Tensor  # [N, k] fp32: their log-probabilities
    log_tail: torch.Tensor  # [N] fp32: log of the mass outside the top k (-inf: none)
    tail_ids: torch.Tensor  # [N, m] int32: tokens drawn from the tail, each in proportion to its probability
    tail_lp: torch.Tensor  # [N, m] fp32: their log-probabilities
    target_lp: torch.Tensor  # [N] fp32: log-probability of the token that came next
    pieces: list[bytes]  # the tokenizer's id -> bytes
    meta: dict  # model, weights, kv, text, text_sha256, ctx, top_k, weight_elements, ppl, ...

    @property
    def ctx(self) -> int:
        return int(self.ids.shape[1])

    @property
    def scored_per_window(self) -> int:
        return self.ctx - self.ctx // 2

    def window(self, i: int) -> tuple[list[int], dict]:
        """(window i's ids, the saved rows of its scored tokens by name)."""
        n = self.scored_per_window
        rows = slice(i * n, (i + 1) * n)
        return self.ids[i].tolist(), {k: getattr(self, k)[rows] for k in ROWS}


def pieces_of(tokenizer) -> list[bytes]:
    return [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]


def tokenizer_mismatch(saved: list[bytes], pieces: list[bytes]) -> str | None:
    """Why a candidate's tokenizer cannot be scored against the reference's (None: the same pieces)."""
    if saved == pieces:
        return None
    if len(saved) != len(pieces):
        return f"its vocabulary has {len(pieces):,} tokens, the reference's {len(saved):,}"
    i = next(i for i, (a, b) in enumerate(zip(saved, pieces)) if a != b)
    n = sum(a != b for a, b in zip(saved, pieces))
    return f"{n:,} of its {len(pieces):,} tokens differ from the reference's (the first: id {i}, {pieces[i]!r} " \
           f"where the reference has {saved[i]!r})"


@torch.inference_mode()
def build_reference(model, tokenizer, ids: list[int], ctx: int, max_windows: int | None, top_k: int = DEFAULT_TOP_K,
                    tail_draws: int = DEFAULT_TAIL_DRAWS, progress=None) -> SavedReference:
    """Run `model` (exact path, f16 KV as `lowbit eval`'s reference) over the windows of `ids` and keep the
    top-k of each scored token's distribution. progress: a tqdm-like object updated once per window."""
    wins = windows(ids, ctx, max_windows)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {ctx}")
    if not 1 <= top_k < tokenizer.vocab_size:
        raise ValueError(f"--top-k must be in 1..{tokenizer.vocab_size - 1}, got {top_k}")
    if tail_draws < 2:
        raise ValueError(f"--tail-draws must be >= 2 (the standard error needs two), got {tail_draws}")
    half = ctx // 2
    draw = torch.Generator().manual_seed(SEED)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ROWS}
    for w in wins:
        lp = window_logprobs(model, w, "f16")[half - 1:-1]  # [n, V]: position t predicts token t + 1
        vals, idx = lp.topk(top_k, -1)  # sorted, likeliest first
        tail = lp.scatter(1, idx, float("-inf"))
        log_tail = tail.logsumexp(-1)  # the tail's mass, not 1 - sum(top): no cancellation
        drawn = torch.multinomial((tail - log_tail[:, None]).exp(), tail_draws, replacement=True, generator=draw)
        for k, v in (("top_ids", idx.int()), ("top_lp", vals), ("log_tail", log_tail), ("tail_ids", drawn.int()),
                     ("tail_lp", lp.gather(1, drawn)), ("target_lp", lp.gather(1, torch.tensor(w[half:])[:, None])[:, 0])):
            out[k].append(v)
        if progress is not None:
            progress.update(1)
    rows = {k: torch.cat(v) for k, v in out.items()}
    nll = -rows["target_lp"].double()
    return SavedReference(torch.tensor(wins, dtype=torch.int32), **rows, pieces=pieces_of(tokenizer), meta=
                          {"ctx": ctx, "windows": len(wins), "top_k": top_k, "tail_draws": tail_draws,
                           "tokens": int(nll.numel()),
                           **dict(zip(("ppl", "ppl_stderr"), perplexity(nll)))})


def save(ref: SavedReference, path: Path) -> int:
    """Write `ref` → the file's size in bytes."""
    from safetensors.torch import save_file

    blob = b"".join(ref.pieces)
    offsets = torch.tensor([0] + [len(p) for p in ref.pieces], dtype=torch.int64).cumsum(0)
    tensors = {"ids": ref.ids, **{k: getattr(ref, k) for k in ROWS},
               "pieces": torch.frombuffer(bytearray(blob), dtype=torch.uint8), "piece_offsets": offsets}
    meta = {**ref.meta, "format": FORMAT, "tokenizer_sha256": hashlib.sha256(blob + offsets.numpy().tobytes()).hexdigest()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"lowbit": json.dumps(meta)})
    return path.stat().st_size


def read(path: Path) -> SavedReference:
    """A saved reference; ValueError (one line) for a file that is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("lowbit", "{}"))
        t = load_file(str(path))
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a lowbit reference file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a lowbit reference file (made by `lowbit eval reference`; "
                         f"format {meta.get('format')!r}, this lowbit reads {FORMAT!r})")
    blob, off = t["pieces"].numpy().tobytes(), t["piece_offsets"].tolist()
    pieces = [blob[off[i]:off[i + 1]] for i in range(len(off) - 1)]
    return SavedReference(t["ids"], **{k: t[k] for k in ROWS}, pieces=pieces, meta=meta)


def text_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
