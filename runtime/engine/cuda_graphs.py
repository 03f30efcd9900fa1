"""Graphed decode steps: a pure decode step replayed as a CUDA graph captured once per batch size.

On CUDA a decode step of the default model is ~300 kernel launches (30 layers of ~10, then the
head); launched one by one from Python they cost ~13x the step's GPU time (docs/perf.md: 29.8
eager against 400.3 graphed steps/s at B = 1 on an H200, measured on the retired contiguous-cache
loop). A CUDA graph records the launches once and replays them with one call, which asks three
things of the step:

- fixed shapes: a step of n sequences is padded to the smallest bucket B >= n of 1, 2, 4, 8, 16, ...,
  max_num_seqs, and each bucket's graph is captured the first time a step needs it;
- inputs at fixed addresses: every step copies its token ids, positions, slots, context lengths and
  block tables into static buffers, which every bucket's graph reads (bucket B: their first B rows);
- no host sync and nothing shaped by device data inside: the fused attention takes its batch
  tensors from those buffers (PagedBatch.kernel_tensors) and its max_query_len (1) from the
  batch's query_lens list, fixed per bucket — never a .tolist() of a device tensor.

Padding rows run token 0 at position 0: their K/V go to slot 0 of the scratch page, the pool's last
page, which the engine keeps from its page manager (engine.py), so no sequence owns it; each attends
over that one slot, and their logits are dropped.

Only pure decode steps are graphed (`DecodeGraphs.eligible`): every chunk one token wanting its
logits, none attended one by one (speculative) or exact. Prefill, mixed and exact steps, and every
model that is not a single-process Llama with the fused (Triton) attention on CUDA, run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lowbit.models.attention import PagedBatch
from lowbit.models.llama import Llama

# captures: the step's forward pass → (replay, the output tensor every replay rewrites)
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]

# eager runs before a capture, on a side stream as PyTorch's CUDA-graph docs do it: the first compiles
# this bucket's Triton kernels (M is a specialized argument: 1 and multiples of 16 compile apart),
# the second runs them compiled, so lazy initialization never lands inside the capture
WARMUP_RUNS = 2


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: powers of two below max_num_seqs, then max_num_seqs itself (16: 1, 2, 4,
    8, 16; 12: 1, 2, 4, 8, 12). A step pads at most to twice its size; 5 graphs for the default 16."""
    out = [1]
    while out[-1] * 2 < max_num_seqs:
        out.append(out[-1] * 2)
    return out + [max_num_seqs] if out[-1] < max_num_seqs else out


class CUDAGraphCapture:
    """The CUDA capture: torch.cuda.CUDAGraph and torch.cuda.graph, every bucket's graph in one memory
    pool. Sharing is safe here because graphs never replay concurrently and each graph's output, the
    only tensor that outlives a replay, stays allocated for the graph's life."""

    def __init__(self, device: torch.device):
        self.device, self.pool = device, None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine captures on its own thread while the server's threads keep running
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out


def why_eager(model, pool, on_cuda: bool = True) -> str | None:
    """Why this model's decode steps cannot be graphed (None: they can). on_cuda=False drops the
    device check (tests capture with a stand-in on CPU, the Triton kernels under the interpreter)."""
    if not isinstance(model, Llama) or model.tp is not None:
        return "the model runs tensor parallel"
    if not model.backend.fused_paged_attention:
        return "the model's attention is not the fused Triton path (the CPU backend)"
    if on_cuda and model.device.type != "cuda":
        return f"the model is on {model.device}, not CUDA"
    if pool.num_pages < 2:
        return "the KV pool has no page to spare for the padding rows"
    if getattr(pool, "states", None) is not None:  # padding rows would need a state slot; not captured yet
        return "the model has recurrent layers (a hybrid model's DeltaNet state is not graphed)"
    if any(layer.moe is not None and layer.moe.grouped is None for layer in model.layers):
        # the per-expert loop reads the routing on the host (models/moe.py), which a capture forbids
        return "the model's experts are not GGUF blocks (only those take the grouped kernel, kernels/moe_triton.py)"
    return None


def decode_graphs(model, pool, config, max_model_len: int, capture: Capture | None = None) -> DecodeGraphs | None:
    """The engine's graphed decode steps under `config.cuda_graphs` (runtime/engine/config.py), or None
    (eager). capture: the graph capture (default: CUDAGraphCapture on the model's device)."""
    if config.cuda_graphs is False:
        return None
    why = why_eager(model, pool, on_cuda=capture is None)
    if why is not None:
        if config.cuda_graphs:
            raise ValueError(f"cuda_graphs=True, but {why}")
        return None
    # block tables as wide as the longest sequence the engine admits: 8,192 tokens of the default
    # model in 16-token pages are 512 entries, [16, 512] int32 = 32 KiB, allocated once; a step copies
    # only its longest table's columns, and the kernel reads no entry past a sequence's context, so
    # the width costs neither a copy nor a re-capture as sequences grow
    width = min(-(-max_model_len // pool.page_size), pool.num_pages - 1)
    return DecodeGraphs(model, pool, config.max_num_seqs, width, capture or CUDAGraphCapture(model.device))


class DecodeGraphs:
    """Decode steps of `model` over `pool`, replayed as graphs. The pool's last page is scratch: the
    caller must never hand it to a sequence."""

    def __init__(self, model, pool, max_num_seqs: int, max_pages: int, capture: Capture):
        self.model, self.pool, self.capture = model, pool, capture
        self.buckets = buckets(max_num_seqs)
        self.max_pages = max_pages  # block-table width: the most pages a graphed sequence may hold
        self.scratch_page = pool.num_pages - 1
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # bucket → (replay, logits [B, V])
        self._static = None  # the buffers, allocated at first use (inside the runner's inference mode)

    def eligible(self, chunks, exact) -> bool:
        """Whether this step runs graphed: 1..max bucket chunks, each one decode token wanting its logits,
        none speculative or exact, and the step's `exact` the fast path throughout."""
        return (exact is False or exact is None) and 0 < len(chunks) <= self.buckets[-1] and all(
            len(c.tokens) == 1 and c.logits == 1 and not c.one_by_one and c.exact == 0
            and len(c.pages) <= self.max_pages for c in chunks)

    def run(self, chunks) -> torch.Tensor:
        """An eligible step's chunks → logits fp32 [n, V], one row per chunk, as the eager step gives."""
        n = len(chunks)
        B = next(b for b in self.buckets if b >= n)
        s = self._buffers()
        ps, pad = self.pool.page_size, B - n
        scratch_slot = self.scratch_page * ps
        # tokens, positions, slots [3, B] in one copy; padding rows: token 0 at position 0, the scratch slot
        s["ids"][:, :B].copy_(torch.tensor([[c.tokens[0] for c in chunks] + [0] * pad,
                                            [c.start for c in chunks] + [0] * pad,
                                            [c.slots[0] for c in chunks] + [scratch_slot] * pad]))
        s["ctx"][:B].copy_(torch.tensor([c.start + 1 for c in chunks] + [1] * pad, dtype=torch.int32))
        cols = max(len(c.pages) for c in chunks)  # columns past these are stale and never read
        table = torch.full((B, cols), self.scratch_page, dtype=torch.int32)  # [B, cols]
        for i, c in enumerate(chunks):
            table[i, :len(c.pages)] = torch.tensor(c.pages, dtype=torch.int32)
        s["tables"][:B, :cols].copy_(table)
        if B not in self.graphs:
            self.graphs[B] = self.capture(self._step(B))
        replay, logits = self.graphs[B]
        replay()
        # a copy: the next replay of this bucket rewrites `logits` (16 x 49,152 fp32 = 3 MiB, a few us)
        return logits[:n].clone()

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The static inputs, sized for the largest bucket N (16) and the widest table (max_pages)."""
        if self._static is None:
            N, dev = self.buckets[-1], self.model.device
            self._static = {
                "ids": torch.zeros(3, N, dtype=torch.long, device=dev),  # [3, N]: tokens, positions, slots
                "ctx": torch.ones(N, dtype=torch.int32, device=dev),  # [N] context lengths
                "tables": torch.full((N, self.max_pages), self.scratch_page, dtype=torch.int32,
                                     device=dev),  # [N, max_pages] page ids
                # constant: one query row per sequence, and every row's logits
                "cu": torch.arange(N + 1, dtype=torch.int32, device=dev),  # [N + 1]
                "alone": torch.arange(N, dtype=torch.int32, device=dev),  # [N] split_rows: row s is sequence s
                "rows": torch.arange(N, dtype=torch.long, device=dev),  # [N]
            }
        return self._static

    def _step(self, B: int) -> Callable[[], torch.Tensor]:
        """Bucket B's forward pass over the first B rows of the static buffers → logits fp32 [B, V].
        Everything it reads is fixed at this call: views of the buffers and Python values."""
        s = self._buffers()
        tokens, positions, slots = s["ids"][0, :B], s["ids"][1, :B], s["ids"][2, :B]
        batch = PagedBatch(positions=positions, slots=slots, query_lens=[1] * B, context_lens=[], block_tables=[],
                           logits_rows=s["rows"][:B],
                           kernel_tensors=(s["cu"][:B + 1], s["ctx"][:B], s["tables"][:B], s["alone"][:B], None))
        model, pool = self.model, self.pool

        def step() -> torch.Tensor:
            return model.forward_paged(tokens, batch, pool, False)

        return step
