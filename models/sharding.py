"""Tensor parallelism, the model's side: which slice of every weight a rank holds, and the
collectives the forward pass calls (models/llama.py). Starting the ranks, sending them each step
and noticing a dead one is runtime/engine/tp.py's job.

N ranks, rank r. With H query heads, Hkv KV heads, head size D, MLP width F and vocabulary V:

    wq, bq           rows   heads r*H/N ..      column-parallel: each rank its own heads
    wk, wv, bk, bv   rows   KV heads r*Hkv/N .. (GQA: rank r's query heads read only these)
    wo               columns r*(H/N)*D ..       row-parallel: partial sums, all-reduce after
    w_gate, w_up     rows   r*F/N ..            column-parallel
    w_down           columns r*F/N ..           row-parallel: all-reduce after
    embed, output    rows   r*ceil(V/N) ..      vocabulary-parallel: lookups all-reduced (one rank
                                                holds each id, the others add zeros), logits gathered
    norms, rope      whole, on every rank

Slices are copied out of the loaded layouts (the whole model is loaded, then dropped): rows are
whole output features, and columns are cut only at whole quantization groups, so every rank holds
the same int4/int8 codes and scales a single process would. The KV cache follows the KV heads: each rank's pool holds only its Hkv/N heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowbit.models.config import LlamaConfig
from lowbit.kernels.ggml_blocks import BLOCKS
from lowbit.quant import BnbWeight, FloatWeight, Int4Weight, Int8Weight
from lowbit.quant.ggml_block import GgmlWeight
from lowbit.quant.gptq import PermutedWeight


@dataclass(frozen=True)
class Shard:
    """This process's place in the tensor-parallel group."""

    rank: int
    world: int

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """The token ids [v0, v1) whose embedding rows and logits this rank holds (the last rank may
        hold fewer: ceil(V / N) each)."""
        per = -(-vocab_size // self.world)
        return min(vocab_size, self.rank * per), min(vocab_size, (self.rank + 1) * per)

    def local_config(self, c: LlamaConfig) -> LlamaConfig:
        """The shapes one rank's blocks compute with: its heads and its part of the MLP."""
        return dataclasses.replace(c, n_heads=c.n_heads // self.world, n_kv_heads=c.n_kv_heads // self.world,
                                   hidden_dim=c.hidden_dim // self.world)


class TPGroup:
    """The collectives of one forward pass, over torch.distributed's default group (gloo on CPU)."""

    def __init__(self, shard: Shard):
        self.shard = shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x (row-parallel partial products, embedding rows), in place."""
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's logits [R, ceil(V/N)] (zero-padded) → rank 0: [R, V] in vocabulary order;
        other ranks get their own slice back (nothing samples there)."""
        per = -(-vocab_size // self.shard.world)
        if logits.shape[-1] < per:
            logits = torch.nn.functional.pad(logits, (0, per - logits.shape[-1]))
        logits = logits.contiguous()
        if self.shard.rank != 0:
            dist.gather(logits, None, dst=0)
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.shard.world)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def check_split(c: LlamaConfig, world: int, group_of) -> None:
    """A clear ValueError when N ranks cannot each hold a whole slice. group_of(name) → the
    quantization group size along a row-parallel weight's columns (0: none)."""
    if world < 1:
        raise ValueError(f"--tp must be >= 1, got {world}")
    if c.n_experts and world > 1:  # each rank would need its share of every expert: not built yet
        raise ValueError(f"--tp {world}: mixture-of-experts models ({c.arch}) run in one process; leave --tp out")
    if c.recurrent_layers is not None and world > 1:  # each rank's share of the DeltaNet heads and state: not built
        raise ValueError(f"--tp {world}: hybrid models with recurrent layers ({c.arch}) run in one process; "
                         "leave --tp out")
    problems = []
    for what, n in (("attention heads", c.n_heads), ("KV heads", c.n_kv_heads), ("MLP columns", c.hidden_dim)):
        if n % world:
            problems.append(f"{n} {what}")
    if problems:
        listed = problems[0] if len(problems) == 1 else f"{', '.join(problems[:-1])} and {problems[-1]}"
        raise ValueError(f"--tp {world}: the model's {listed} do not split into {world} equal parts; use a --tp "
                         f"that divides them")
    for name, cols in (("wo", c.n_heads // world * c.head_dim), ("w_down", c.hidden_dim // world)):
        g = group_of(name)
        if g and cols % g:
            raise ValueError(f"--tp {world}: each rank's {cols} input columns of {name} are not a whole number of "
                             f"its {g}-wide quantization groups; use another --tp or --weights")


def shard_weights(c: LlamaConfig, weights: dict, shard: Shard) -> dict:
    """The loaded weight dict (runtime/load/gguf.py's names) → this rank's slices (contiguous copies)."""
    r, N = shard.rank, shard.world
    check_split(c, N, lambda name: _group(weights[f"layers.0.{name}"]))
    out = {}
    D = c.head_dim
    q_rows = slice(r * c.n_heads // N * D, (r + 1) * c.n_heads // N * D)
    kv_rows = slice(r * c.n_kv_heads // N * D, (r + 1) * c.n_kv_heads // N * D)
    mlp = slice(r * c.hidden_dim // N, (r + 1) * c.hidden_dim // N)
    v0, v1 = shard.vocab_range(c.vocab_size)
    for name, w in weights.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("wq", "bq"):
            out[name] = _rows(w, q_rows)
        elif leaf in ("wk", "wv", "bk", "bv"):
            out[name] = _rows(w, kv_rows)
        elif leaf == "wo":
            out[name] = _cols(w, q_rows)
        elif leaf in ("w_gate", "w_up"):
            out[name] = _rows(w, mlp)
        elif leaf == "w_down":
            out[name] = _cols(w, mlp)
        elif name in ("embed", "output"):
            out[name] = _rows(w, slice(v0, v1))
        else:  # norms, rope frequencies
            out[name] = w
    return out


def _group(w) -> int:
    if isinstance(w, BnbWeight):
        raise ValueError("--tp does not take bitsandbytes layouts (bnb-nf4, bnb-int8): they cannot be sliced "
                         "along their groups; use --weights auto, int4-* or int8-*")
    if isinstance(w, PermutedWeight):
        raise ValueError("--tp does not take act-order (desc_act) GPTQ weights: their groups are spread over "
                         "the input columns and cannot be split by rank; run without --tp")
    if isinstance(w, FloatWeight):
        return 0
    return w.spec.group_size or 0  # int8 per channel: one scale per row, any column slice keeps it


def _rows(w, rows: slice):
    if isinstance(w, torch.Tensor):  # a bias
        return w[rows].contiguous()
    _group(w)  # refuses bitsandbytes
    return w.rows(torch.arange(rows.start, rows.stop))


def _cols(w, cols: slice):
    """Columns k0..k1 of a weight; k0 and k1 are whole groups (check_split)."""
    k0, k1 = cols.start, cols.stop
    if isinstance(w, FloatWeight):
        return dataclasses.replace(w, weight=w.weight[:, k0:k1].contiguous())
    if isinstance(w, Int4Weight):
        g = w.spec.group_size
        return Int4Weight(w.spec, k1 - k0, w.qweight[:, k0 // 2:k1 // 2].contiguous(),
                          w.scales[:, k0 // g:k1 // g].contiguous(),
                          None if w.mins is None else w.mins[:, k0 // g:k1 // g].contiguous())
    if isinstance(w, Int8Weight):
        g = w.spec.group_size
        scales = w.scales if not g else w.scales[:, k0 // g:k1 // g]
        return Int8Weight(w.spec, k1 - k0, w.qweight[:, k0:k1].contiguous(), scales.contiguous())
    if isinstance(w, GgmlWeight):  # whole blocks of the file's bytes (check_split: k0, k1 on block edges)
        qk, nb = w.spec.group_size, BLOCKS[w.qtype][2]
        return GgmlWeight(w.spec, k1 - k0, w.data[:, k0 // qk * nb:k1 // qk * nb].contiguous())
    _group(w)
    raise ValueError(f"--tp cannot split the input columns of a {type(w).__name__} weight")
