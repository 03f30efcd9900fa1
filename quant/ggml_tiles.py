"""GGML weights into the CPU's tiles: a GGUF file's Q4_0 / Q4_1 / Q8_0 rows into lowbit's int4 / int8
tiles (kernels/int4_mm.py, int8_mm.py), its K-quant, 5-bit and MXFP4 rows into tiles of their own
(kernels/kq_mm.py), a fused QKV or gate+up whose rows come in runs of several types as one chain
(kernels/segments.py) — each run packed by the C repack straight from its bytes, or from the file where
nothing has read them yet (quant/ggml_block.py FileBlocks, quant/ggml.py FileRelaid), so a load holds
no stacked or unpacked copy of what it reads.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from lowbit.kernels.int4_mm import Int4Packed, int4_mm
from lowbit.kernels.int8_mm import Int8Packed, int8_mm
from lowbit.kernels.kq_mm import KQ_TYPES, kq_mm, kq_pack, tiles_pack_rows
from lowbit.kernels.segments import Segments
from lowbit.kernels.tile_layout import TILE, tile_bytes
from lowbit.quant.ggml import RELAID, FileRelaid
from lowbit.quant.ggml_block import FileBlocks, GgmlWeight, as_blocks
from lowbit.quant.int4 import Int4Weight
from lowbit.quant.int8 import Int8Weight


def _rows_of(w) -> list[tuple[int, object]] | None:
    """A weight's runs of GGML rows as (type, rows): rows still in the file (their `source`) where nothing
    has read them, else uint8 [n, row bytes] in memory; None for a layout that is not GGML blocks."""
    if isinstance(w, (FileBlocks, FileRelaid)) and w.unread:
        return [(w.qtype, w.source)]
    if isinstance(w, (Int4Weight, Int8Weight)):
        w = as_blocks(w)  # Q4_0 / Q4_1 / Q8_0 values as their blocks again (None for other layouts)
    if not isinstance(w, GgmlWeight):
        return None
    return [(w.qtype, w.data)] + ([(w.qtype2, w.data2)] if w.data2 is not None else [])


def cpu_pack_rows(weights: list, native):
    """Weights that read one input (QKV, gate+up; or one weight alone) of GGML types → their rows stacked
    in tiles (kernels/kq_mm.py, int4_mm.py, int8_mm.py), each run packed straight from its own bytes by
    C — from the file where nothing has read them — with no stacked copy first; several types: Segments
    (kernels/segments.py). None where the C kernels are not there, a layout is not GGML blocks, a type
    has no tiles (Q2_K, Q3_K, IQ4_*) or K is not whole groups of its tiles (kq_mm.py KQ_TYPES: MXFP4's are
    64 values) — those stay in the file's blocks (kernels/ggml_mm.py) — or a run before the last is not whole
    16-row tiles."""
    if native is None or any(w.in_features != weights[0].in_features for w in weights):
        return None
    items = [_rows_of(w) for w in weights]
    if any(i is None for i in items):
        return None
    K, runs = weights[0].in_features, []  # [(type, [rows, ...])], consecutive rows of one type together
    for qtype, rows in (x for item in items for x in item):
        if runs and runs[-1][0] == qtype:
            runs[-1][1].append(rows)
        else:
            runs.append((qtype, [rows]))
    parts, matmuls = [], []
    for i, (qtype, rows) in enumerate(runs):
        sizes = [r.shape[0] if isinstance(r, torch.Tensor) else r.N for r in rows]
        if (i < len(runs) - 1 and sum(sizes) % TILE) or any(n % TILE for n in sizes[:-1]) or len(runs) > 4:
            return None
        if qtype in KQ_TYPES and K % KQ_TYPES[qtype][0] == 0:
            parts.append(kq_pack(rows, qtype, K, native=native))
            matmuls.append(kq_mm)
        elif qtype in RELAID and K % 32 == 0:
            parts.append(relaid_tiles(rows, qtype, K, native))
            matmuls.append(int8_mm if qtype == T.Q8_0 else int4_mm)
        else:
            return None
    return parts[0] if len(parts) == 1 else Segments(parts, matmuls, native)


def relaid_tiles(rows: list, qtype: int, K: int, native):
    """Q4_0 / Q4_1 / Q8_0 rows → the int4 / int8 tiles their Int4Weight / Int8Weight would pack into
    (kernels/int4_mm.py int4_pack, int8_mm.py int8_pack), byte for byte, by the C repack."""
    G = K // 32
    if qtype == T.Q8_0:
        out, N = tiles_pack_rows(rows, qtype, K, tile_bytes(G, 32, 512), native)
        return Int8Packed(out, 32, 2, N, K, K, native)
    symmetric = qtype == T.Q4_0
    out, N = tiles_pack_rows(rows, qtype, K, tile_bytes(G, 32 if symmetric else 64, 256), native)
    return Int4Packed(out, 32, symmetric, N, K, K, native)
