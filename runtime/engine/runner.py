"""The model runner: a step's chunks in, the model's logits out.

DESIGN.md's loop is `batch = scheduler.schedule(); out = runner.run(batch)`. A chunk is one
sequence's run of tokens this step (a prefill piece, the pending token of a decode, or the
pending token and its drafts); `prepare` lays the chunks end to end as the token-major rows every
kernel takes and describes them in one PagedBatch (positions, pool slots, page tables, the rows
whose logits are wanted). The engine, the draft model's proposer, `lowbit eval` and the
tensor-parallel ranks all build their batches here, so a change to the batch's layout is made once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.models.attention import PagedBatch
from lowbit.quant.kv import KV_FORMATS
from lowbit.quant.linear import ExactRows
from lowbit.runtime.engine.kv_cache import KVPool
from lowbit.runtime.engine.state_cache import StateCache


@dataclass(frozen=True)
class Chunk:
    """One sequence's tokens in one step: tokens[i] sits at position start + i and writes its K/V
    to pool slot slots[i]; the sequence's pages, in order, are `pages`."""

    tokens: list[int]
    start: int
    slots: list[int]
    pages: list[int]
    logits: int = 1  # logits wanted at the last `logits` positions (0: none, a prefill piece mid-prompt)
    one_by_one: bool = False  # attention row by row (a speculating chunk: bit-equal to decoding each token)
    # how many of the tokens, the first ones, the engine runs exactly on CPU: its prompt tokens, or
    # every token of a verified-greedy request
    exact: int = 0
    state_slot: int = -1  # the sequence's recurrent-state slot (hybrid models; runtime/engine/state_pool.py)


def paged_batch(positions: list[int], slots: list[int], query_lens: list[int], context_lens: list[int],
                pages: list[list[int]], logits_rows: list[int], one_by_one: list[bool] | None = None,
                device: torch.device | str = "cpu", state_slots: list[int] | None = None) -> PagedBatch:
    """Plain lists → the PagedBatch tensors on `device`."""
    def ids(x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return PagedBatch(positions=ids(positions), slots=ids(slots), query_lens=list(query_lens),
                      context_lens=list(context_lens), block_tables=[ids(p) for p in pages],
                      logits_rows=ids(logits_rows), one_by_one=one_by_one, state_slots=state_slots)


def prepare(chunks: list[Chunk], device: torch.device | str) -> tuple[torch.Tensor, PagedBatch]:
    """→ (tokens int [M], the batch): M is the chunks' tokens laid end to end, and the logits rows are
    each chunk's last `logits` rows, in chunk order."""
    tokens, positions, slots, rows = [], [], [], []
    for c in chunks:
        tokens += c.tokens
        positions += range(c.start, c.start + len(c.tokens))
        slots += c.slots
        rows += range(len(tokens) - c.logits, len(tokens))
    batch = paged_batch(positions, slots, [len(c.tokens) for c in chunks], [c.start + len(c.tokens) for c in chunks],
                        [c.pages for c in chunks], rows, [c.one_by_one for c in chunks], device,
                        [c.state_slot for c in chunks])
    return torch.tensor(tokens, dtype=torch.long, device=device), batch


def fresh_pool(model, texts: list[list[int]], logits: list[int] | None = None, kv_format: str = "f32",
               page_size: int = 16) -> tuple[KVPool, list[Chunk]]:
    """Each text whole, from position 0, on pages of its own in a new pool just large enough → (the
    pool, one chunk per text); logits: the rows each wants (default: all of them). One-off passes
    (embeddings, prompt scoring) use it with the lossless f32 format."""
    chunks, first = [], 0
    for i, ids in enumerate(texts):
        pages = list(range(first, first + -(-len(ids) // page_size)))
        slots = [pages[p // page_size] * page_size + p % page_size for p in range(len(ids))]
        chunks.append(Chunk(list(ids), 0, slots, pages, logits=len(ids) if logits is None else logits[i], state_slot=i))
        first += len(pages)
    c = model.config
    states = StateCache(c, len(texts), model.device) if c.deltanet is not None else None  # a slot per text
    pool = KVPool(KV_FORMATS[kv_format], c.n_kv_layers, model.kv_heads, c.head_dim, num_pages=max(first, 1),
                  page_size=page_size, device=model.device, states=states)
    return pool, chunks


def exact_rows(chunks: list[Chunk], device: torch.device | str) -> bool | ExactRows:
    """The chunks' `exact` rows as the per-row choice `Llama.forward_paged` takes."""
    return ExactRows.of([i < c.exact for c in chunks for i in range(len(c.tokens))], device)


@dataclass
class Runner:
    """A model over one paged pool."""

    model: object  # models.llama.Llama, or the tensor-parallel wrapper of runtime/engine/tp.py
    pool: object  # runtime.engine.kv_cache.KVPool
    # runtime/engine/cuda_graphs.py DecodeGraphs: pure decode steps replayed as CUDA graphs (None: all eager)
    graphs: object | None = None

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], exact) -> torch.Tensor:
        """→ logits fp32 [R, V], one row per wanted position (see `prepare`); exact as
        `Llama.forward_paged` takes it. A step the graphs take gives the same logits as the eager one."""
        if self.graphs is not None and self.graphs.eligible(chunks, exact):
            return self.graphs.run(chunks)
        tokens, batch = prepare(chunks, self.model.device)
        if getattr(self.pool, "states", None) is not None:
            self.pool.states.begin_step()
        return self.model.forward_paged(tokens, batch, self.pool, exact)
