"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of the default model is ~30 layers x ~10 kernel launches = ~300 launches for
~100 MB of weights; at ~5 us per launch from Python that is ~1.5 ms of launch overhead against
~0.03 ms of memory traffic on an H200, so without graphs the GPU idles. `Llama.decode` has static
shapes (positions are a tensor, attention reads the whole cache under a mask), so one capture per
batch size replays any step: the inputs are copied into fixed buffers, the graph is replayed, and
the logits are read from its fixed output buffer.

A batch of B sequences runs in the smallest bucket >= B; the spare rows decode token 0 at position
0 of the cache's spare slots, which no live sequence owns (the cache holds one slot per row of
the largest bucket). Captures happen lazily, on a bucket's first step, after a warm-up run with
that step's real inputs (it compiles the Triton kernels; writing the same K/V twice is harmless).
Off CUDA (`use_graphs=False`) the same buffers and buckets run eagerly, which is what the CPU tests
exercise.
"""

from __future__ import annotations

import torch

from lowbit.models.llama import KVCache, Llama

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


class GraphedDecode:
    def __init__(self, model: Llama, cache: KVCache, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None):
        slots = cache.k.shape[1]
        self.buckets = sorted({b for b in buckets if b < slots} | {slots})
        self.model, self.cache = model, cache
        device = cache.k.device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # [slots] static inputs
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # one memory pool shared by all captures

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch of {batch} sequences exceeds the cache's {self.buckets[-1]} slots")

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions int [B] (sequence b in cache slot b) → logits fp32 [B, V]."""
        B = tokens.shape[0]
        if positions.shape != tokens.shape:
            raise ValueError("tokens and positions must both be [B]")
        b = self.bucket(B)
        self.tokens[:B].copy_(tokens)
        self.positions[:B].copy_(positions)
        self.tokens[B:b].zero_()
        self.positions[B:b].zero_()
        if not self.use_graphs:
            return self._step(b)[:B]
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:B]

    def _step(self, b: int) -> torch.Tensor:
        return self.model.decode(self.tokens[:b], self.positions[:b], self.cache.rows(b))  # [b, V]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: compiles kernels, settles the allocator
            self._step(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(b)
        self.pool = graph.pool()
        return graph, out
