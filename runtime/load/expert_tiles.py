"""A GGUF expert tensor [E, N, K] packed into the CPU's tiles a chunk of experts per C call, not one
expert per call.

Why: a mixture of experts' layer holds 3 x E matrices (Qwen3-30B-A3B: 384 a layer), each of which was
packed by its own lowbit_tiles_pack call, each a parallel region with a read buffer per thread. On this
project's 2 shared cores that cost ~22 ms a call with 2 threads against ~0.8 ms of packing (measured: one
layer's 128 Q4_K gate matrices 768 x 2048, AMD EPYC, busy machine: 2.9 s one by one, 0.09 s in one call; the
8-layer Qwen3-30B-A3B-shaped file, 2 threads, same machine: 65-124 s a load one by one, 22-24 s in chunks).
The experts of one tensor are consecutive in the file, and each expert's N rows are whole 16-row tiles
(N % 16 == 0), so a run of experts packs in one call into tiles that split at expert boundaries; each
expert's weight then copies its own tiles out (~0.1 ms a matrix) into the buffer its layer packs into
(the fused gate+up stacks two of them). A chunk is at most CHUNK_BYTES of tiles and is dropped once all
its experts have taken theirs, so a load holds at most one chunk per tensor beyond the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

CHUNK_BYTES = 32 << 20  # 32 MiB of tiles a call: 8-40 experts at Qwen3-30B-A3B's sizes, ~1/10 of a layer


class ExpertPacks:
    """One 3-D tensor's experts (E of N rows each, `row_bytes` a row in the file, expert 0 at `offset`
    of `path`), packed a chunk at a time as its experts ask."""

    def __init__(self, path: str, offset: int, E: int, N: int, row_bytes: int):
        self.path, self.offset, self.E, self.N, self.row_bytes = path, offset, E, N, row_bytes
        self._chunks: dict[int, list] = {}  # chunk → [tiles uint8 [experts x T, tile bytes], {experts yet to take}]

    def take(self, e: int, qtype: int, K: int, out: torch.Tensor, native) -> None:
        """Expert e's tiles (out: uint8 [T, tile bytes], T = N / 16) — its chunk packed first if need be."""
        T, size = out.shape
        per = max(1, CHUNK_BYTES // max(1, T * size))
        c = e // per
        held = self._chunks.get(c)
        if held is None:
            e0, e1 = c * per, min(self.E, (c + 1) * per)
            tiles = torch.empty((e1 - e0) * T, size, dtype=torch.uint8)
            rows = SimpleNamespace(path=self.path, offset=self.offset + e0 * self.N * self.row_bytes, perm=None)
            native.tiles_pack(qtype, rows, (e1 - e0) * self.N, K, tiles)
            held = self._chunks[c] = [tiles, set(range(e0, e1))]
        i = e - c * per
        # numpy's copy: one thread (torch's copy_ of ~1 MB wakes its OpenMP team: ~7 ms a copy on the busy
        # 2-core machine, more than the packing it saves)
        out.numpy()[...] = held[0][i * T:(i + 1) * T].numpy()
        # a set, not a count: an expert asked for twice (runtime/load/gguf.py LazyWeights reads again when asked
        # again) must not free the chunk before its neighbours have taken theirs
        held[1].discard(e)
        if not held[1]:
            del self._chunks[c]


@dataclass(frozen=True)
class ExpertRows:
    """Expert `expert`'s rows in the file (`rows`: its runtime/load/gguf.py TensorRows, what every other use
    reads) and the tensor's ExpertPacks, which packs them with their neighbours (kernels/kq_mm.py
    tiles_pack_rows calls `pack_tiles`)."""

    rows: object
    packs: ExpertPacks
    expert: int

    N = property(lambda self: self.rows.N)
    path = property(lambda self: self.rows.path)
    offset = property(lambda self: self.rows.offset)
    perm = property(lambda self: self.rows.perm)

    def read(self) -> torch.Tensor:
        return self.rows.read()

    def with_rows(self, index: torch.Tensor):
        return self.rows.with_rows(index)  # a subset of the rows packs on its own

    def pack_tiles(self, qtype: int, K: int, out: torch.Tensor, native) -> None:
        if out.shape[0] * 16 != self.N:  # not whole tiles: the expert's tiles would not split off
            native.tiles_pack(qtype, self.rows, self.N, K, out)
        else:
            self.packs.take(self.expert, qtype, K, out, native)
