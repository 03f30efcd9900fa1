"""Attention over the engine's paged, quantized pool (runtime/engine/kv_cache.py).

A step's batch is any mix of sequences, each bringing some new tokens (a prefill chunk, one decode
token, or several speculative tokens) at its own positions; `PagedBatch` carries everything
attention needs, as DESIGN.md asks: one dataclass, never a global. New K/V are written first, then
every query attends over keys and values read back from the cache — its own included — so what a
token sees is exactly what a later token will see (llama.cpp's convention; the quality test relies
on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from lowbit.kernels.kv_write import kv_write
from lowbit.kernels.paged_attention import batch_tensors, paged_attention, split_rows

GATHER_PAGES = 1024  # pages read and dequantized at once (16-token pages, k8v4: ~25 MB of fp32, transient)
# A sequence's chunk of at most this many new tokens is attended row by row by the C kernel, as decode
# rows are (each row its own keys up to its position), not gathered for SDPA: a short prompt then runs
# its whole step in one C call (1.7B shapes, 16-token prompt: SDPA and its gathers cost ~30 ms of a
# ~230 ms first token), and its rows are the ones decoding the same tokens one by one would give.
C_ROWS_MAX = 32


@dataclass
class PagedBatch:
    positions: torch.Tensor  # int64 [M]: position of each new token, sequences concatenated
    slots: torch.Tensor  # int64 [M]: cache slot each new token's K/V goes to
    query_lens: list[int]  # new tokens per sequence (sum = M)
    context_lens: list[int]  # tokens in the cache per sequence once this step's are written
    block_tables: list[torch.Tensor]  # int64 page ids per sequence, covering context_lens
    logits_rows: torch.Tensor  # int64 [R]: rows of M whose logits are wanted
    # per sequence: attend its queries one at a time, each exactly as a single-token decode step
    # would (a speculative chunk: its rows then match plain decoding bit for bit); None = all False
    one_by_one: list[bool] | None = None
    # the fused path's (cu_query_lens int32 [S + 1], context_lens int32 [S], block_tables int32
    # [S, max_pages], split_rows int32 [M], alone int64 [R] or None) already on the device, or None
    # to build them from the lists above (kernels/paged_attention.py batch_tensors, split_rows). A graphed
    # decode step (runtime/engine/cuda_graphs.py) passes its static buffers: a replay sees no list, so
    # context_lens and block_tables are then empty and query_lens (all 1) is fixed per graph
    kernel_tensors: tuple | None = None
    # per sequence: its slot in the recurrent-state pool (hybrid models' DeltaNet layers: models/deltanet.py,
    # runtime/engine/state_cache.py); None for a model without recurrent layers
    state_slots: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def _groups(pages: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive sequences (start, end) whose pages add up to at most `budget` (a sequence with more
    pages than that forms a group alone)."""
    groups, start, total = [], 0, 0
    for i, p in enumerate(pages):
        if i > start and total + p > budget:
            groups.append((start, i))
            start, total = i, 0
        total += p
    if pages:
        groups.append((start, len(pages)))
    return groups


class PagedAttention:
    """fused=False: the plain-torch path (CPU): the pool quantizes on write, then the sequences'
    pages are gathered and dequantized (several sequences per read) and each sequence is attended
    with SDPA. fused=True (CUDA): the Triton
    kernels kernels/kv_write.py and kernels/paged_attention.py quantize in-kernel and read the
    quantized pages directly, working in the rotated space (q rotated, output rotated back)."""

    def __init__(self, pool, batch: PagedBatch, windows: list[int | None] | int | None, backend,
                 sinks: list[torch.Tensor | None] | None = None):
        """windows: each layer's sliding window (None: the layer sees every earlier key), or one for
        all. backend: the model's (models/backend.py): its Triton kernels when `fused_paged_attention`,
        else its C kernels (`native`) where it has them. sinks: each layer's attention sinks (gpt-oss: a
        learned logit per query head that joins every row's softmax and carries no value), contiguous fp32
        [H] on the model's device, or None for a layer without them; None: no layer has them (the
        attention of every path is then exactly what it is without this argument)."""
        self.pool, self.batch = pool, batch
        self.windows = windows if isinstance(windows, list) else [windows] * pool.n_layers
        self.sinks = [None] * pool.n_layers if sinks is None else list(sinks)
        if len(self.sinks) != pool.n_layers:
            raise ValueError(f"PagedAttention: {len(self.sinks)} layers of sinks for a pool of {pool.n_layers}")
        self.fused, self.kernels = backend.fused_paged_attention, backend.native
        # both sides rotated (k8v4, k4v4): attend in the rotated space, as the CUDA kernels do —
        # q·k and p·v are unchanged by an orthonormal rotation, and rotating q and the output costs
        # a sequence's new rows where un-rotating its gathered cache cost 2 x context rows per layer
        # (in every layer: a pool of per-layer formats with a float side anywhere attends un-rotated on the
        # SDPA path; the C and Triton kernels take each layer's sides as they are stored — q rotated where
        # the keys are quantized, the output rotated back where the values are — so they take every pool)
        both = all(f.k_bits < 16 and f.v_bits < 16 for f in pool.formats)
        self.rot = pool.rot if pool.rot is not None and both else None
        # sequences whose pages are read and dequantized together (one set of index and dequantize
        # ops per layer instead of ~20 per sequence); dequantizing is elementwise, so a sequence's
        # values do not depend on its company — but un-rotating one side is a matmul: one each then
        if self.fused:
            dev = batch.positions.device
            self.tensors = batch.kernel_tensors if batch.kernel_tensors is not None else (  # once per step
                *batch_tensors(batch.query_lens, batch.context_lens, batch.block_tables, dev),
                *split_rows(batch.query_lens, batch.one_by_one, dev))
        else:
            self._plan(batch, pool)

    def _plan(self, batch: PagedBatch, pool) -> None:
        """CPU: which query rows lowbit's C kernel attends straight from the quantized pages
        (kernels/cpu_attention.c: every row of a sequence bringing at most C_ROWS_MAX tokens — a decode
        step, a short prompt, speculative rows attended one by one — when the C kernels are built), and
        the groups of the other sequences, whose pages are read and dequantized together for SDPA, once
        per step."""
        one_by_one = batch.one_by_one or [False] * len(batch.query_lens)
        starts = [0]
        for n in batch.query_lens:
            starts.append(starts[-1] + n)
        by_c = [self.kernels is not None and (n <= C_ROWS_MAX or one) for n, one in zip(batch.query_lens, one_by_one)]
        self.rows = [(i, starts[i]) for i in range(len(by_c)) if not by_c[i]]  # (sequence, first row), SDPA
        budget = 1 if pool.rot is not None and self.rot is None else GATHER_PAGES
        self.groups = _groups([len(batch.block_tables[i]) for i, _ in self.rows], budget)
        self.c_rows = None
        if any(by_c):
            rows, ctx, toff, tables, off = [], [], [], [], 0
            for i, c in enumerate(by_c):
                if not c:
                    continue
                n, length = batch.query_lens[i], batch.context_lens[i]
                rows += range(starts[i], starts[i] + n)
                ctx += [length - n + j + 1 for j in range(n)]  # keys up to and including the row's token
                toff += [off] * n
                tables.append(batch.block_tables[i])
                off += len(batch.block_tables[i])
            # every row of the step (a pure decode step): q is passed and the output taken whole
            self.c_rows = slice(None) if rows == list(range(starts[-1])) else torch.tensor(rows)
            self.c_args = (torch.tensor(ctx), torch.cat(tables).to(torch.int64).cpu(), torch.tensor(toff))

    def all_rows_in_c(self, M: int) -> bool:
        """Whether every row of the step (M = all of the batch's) is one token's query that the C kernel
        attends (a decode step on CPU with the C kernels): the model may then run the whole step in
        one C call (`run_layers`)."""
        return not self.fused and isinstance(self.c_rows, slice)

    def run_layers(self, layers, delta: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Every block of the step in one C call over the pool (kernels/cpu_block.py FusedLayers):
        quantize-on-write and paged attention per layer, as `__call__` does them. The blocks' descriptors
        carry their sinks (kernels/cpu_block.py fused_block): they must be the tensors this step was given."""
        if any(a is not b for a, b in zip(layers.sinks, self.sinks)):
            raise ValueError("PagedAttention.run_layers: the fused blocks' sinks are not this step's (pass the "
                             "same tensor per layer to fused_block and PagedAttention)")
        pool = self.pool
        k_sides = [pool.side(layer, "k") for layer in range(pool.n_layers)]
        v_sides = [pool.side(layer, "v") for layer in range(pool.n_layers)]
        return layers.decode_paged(delta, cos, sin, self.batch.slots.to(torch.int64).contiguous(), pool.page_size,
                                   k_sides, v_sides, pool.rot, pool.rot, self.c_args)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [M, H, D], k/v [M, Hkv, D] → fp32 [M, H*D]."""
        if self.fused:
            return self._fused(layer, q, k, v)
        b, pool, window, sinks = self.batch, self.pool, self.windows[layer], self.sinks[layer]
        pool.write(layer, k, v, b.slots, self.kernels)
        M, H, D = q.shape
        out = torch.empty(M, H, D, dtype=torch.float32, device=q.device)
        if self.c_rows is not None:
            attended = self.kernels.paged_decode_attention(
                q[self.c_rows].float(), *self.c_args, pool.page_size, pool.side(layer, "k"), pool.side(layer, "v"),
                pool.rot, window, sinks)
            if isinstance(self.c_rows, slice):
                return attended.view(M, H * D)
            out[self.c_rows] = attended
        one_by_one = b.one_by_one or [False] * len(b.query_lens)
        for start, end in self.groups:
            for (i, row), (keys, values) in zip(self.rows[start:end], self._read(layer, start, end)):  # [Hkv, ctx, D]
                n, ctx = b.query_lens[i], b.context_lens[i]
                if one_by_one[i]:
                    # SDPA's CPU kernels (and the GEMMs of the rotation) differ in the last bits between
                    # 1 and n queries, and the rounding of the decode kernels downstream can turn that into
                    # another greedy token (measured on the default model): so each query sees exactly a
                    # decode step's inputs
                    for j in range(n):
                        c = ctx - n + j + 1  # keys up to and including this token
                        out[row + j] = self._attend(q[row + j:row + j + 1], keys[:, :c], values[:, :c],
                                                    b.positions[row + j:row + j + 1], window, sinks)[0]
                else:
                    out[row:row + n] = self._attend(q[row:row + n], keys, values, b.positions[row:row + n], window,
                                                    sinks)
        return out.reshape(M, H * D)

    def _read(self, layer: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values [Hkv, ctx, D] of the SDPA sequences self.rows[start:end], from one read of
        their pages."""
        b, pool = self.batch, self.pool
        seqs = [i for i, _ in self.rows[start:end]]
        tables = [b.block_tables[i] for i in seqs]
        k, v = pool.gather_pages(layer, torch.cat(tables), rotated=self.rot is not None)  # [pages, Hkv, page, D]
        sizes = [len(t) for t in tables]
        return [(pool.tokens(ks, b.context_lens[i]), pool.tokens(vs, b.context_lens[i]))
                for ks, vs, i in zip(k.split(sizes), v.split(sizes), seqs)]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's queries q [n, H, D] over its (rotated, if self.rot) keys/values → [n, H, D].
        The rotation is per sequence, so a row never depends on what else is in the batch. A sink scales
        each (row, head) output by a scalar, which the rotation back leaves as it is."""
        rot = self.rot
        sdpa = self._sdpa if sinks is None else partial(_sdpa_with_sinks, sinks=sinks)
        if rot is None:
            return sdpa(q, keys, values, pos, window)
        n, H, D = q.shape
        o = sdpa((q.float().reshape(n * H, D) @ rot).view(n, H, D), keys, values, pos, window)
        return (o.reshape(n * H, D) @ rot.T).view(n, H, D)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
              window: int | None) -> torch.Tensor:
        """q [n, H, D] at positions pos [n]; keys/values [Hkv, ctx, D] → [n, H, D] (causal, window)."""
        gqa = q.shape[1] != keys.shape[0]
        if q.shape[0] == 1 and (window is None or keys.shape[1] <= window):
            # one query seeing every key: no mask, and the 4-D call takes SDPA's flash kernel
            # (ctx 200, 9/3 heads: 60 us against 223 us for the masked 3-D call, which takes the math path)
            qs = q.float().transpose(0, 1)[None]  # [1, H, 1, D]
            return F.scaled_dot_product_attention(qs, keys[None], values[None], enable_gqa=gqa)[0].transpose(0, 1)
        k_pos = torch.arange(keys.shape[1], device=q.device)
        mask = k_pos[None, :] <= pos[:, None]  # [n, ctx]
        if window is not None:
            mask &= k_pos[None, :] > pos[:, None] - window
        # 4-D, as above: with a mask too, SDPA then takes its flash kernel, where the 3-D call takes the
        # math path (512 queries over 512 keys, 9/3 heads: 5.5 ms against 18 ms)
        qs = q.float().transpose(0, 1)[None]  # [1, H, n, D]
        o = F.scaled_dot_product_attention(qs, keys[None], values[None], attn_mask=mask, enable_gqa=gqa)
        return o[0].transpose(0, 1)  # [n, H, D]

    def _fused(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool, b = self.pool, self.batch
        rot = pool.rot  # [D, D] or None; applied to the quantized sides only (f16 is never rotated)
        k_side, v_side = pool.side(layer, "k"), pool.side(layer, "v")
        for x, side in ((k, k_side), (v, v_side)):
            x = x.float() @ rot if rot is not None and side.bits < 16 else x
            kv_write(x, b.slots, side, pool.page_size)
        # each side as stored: q rotated where the keys are, the output rotated back where the values are (a
        # pool of per-layer formats may hold f16 keys and int4 values in one layer)
        q_rot, out_rot = (rot is not None and side.bits < 16 for side in (k_side, v_side))
        cu, ctx, tables, by_row, alone = self.tensors
        out = paged_attention(q.float() @ rot if q_rot else q, k_side, v_side, cu, ctx, b.positions, tables,
                              pool.page_size, sliding_window=self.windows[layer], max_query_len=max(b.query_lens),
                              split_rows=by_row, alone=alone, sinks=self.sinks[layer])  # fp32 [M, H, D]
        if out_rot:
            out = out @ rot.T
        return out.reshape(q.shape[0], -1)


def _sdpa_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """PagedAttention._sdpa with attention sinks fp32 [H]: q [n, H, D] at positions pos [n]; keys/values
    [Hkv, ctx, D] → [n, H, D], each row out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j)).

    SDPA takes no sink, but its CPU flash kernel (the one the 4-D calls of `_sdpa` take) also returns
    each row's L = logsumexp_j s_j, which the public call drops; with it the sink's share is exact:
    out = o * e^L / (e^sink + e^L) = o * sigmoid(L - sink), o the output without the sink — and o is
    SDPA's own, bit for bit, so a sink of -inf gives `_sdpa`'s rows. No [H, n, ctx] score matrix is
    formed (a 2048-token chunk at 64 heads would be 1 GB of fp32). The same mask rule as `_sdpa`, as an
    additive fp32 mask (the op takes no bool one)."""
    n, ctx = q.shape[0], keys.shape[1]
    mask = None
    if n > 1 or (window is not None and ctx > window):
        k_pos = torch.arange(ctx, device=q.device)
        see = k_pos[None, :] <= pos[:, None]  # [n, ctx]
        if window is not None:
            see &= k_pos[None, :] > pos[:, None] - window
        mask = torch.zeros(n, ctx, device=q.device).masked_fill_(~see, float("-inf"))
    qs = q.float().transpose(0, 1)[None]  # [1, H, n, D]
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, keys[None], values[None],
                                                                         attn_mask=mask)  # [1, H, n, D], [1, H, n]
    o = o * torch.sigmoid(lse - sinks.float()[None, :, None])[..., None]
    return o[0].transpose(0, 1)  # [n, H, D]
