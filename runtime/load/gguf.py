"""GGUF file → (config, lowbit weights, metadata), memory-mapped (runtime/load/gguf_file.py).

Every tensor is checked before anything is converted (type supported, bytes inside the file), so a
bad file fails in a second with one line naming file, tensor and type rather than half-way through.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from lowbit.models.config import LlamaConfig
from lowbit.models.rope import head_rows, rotary_row_order
from lowbit.quant import WeightSpec
from lowbit.quant.ggml import LOSSLESS, REQUANTIZED, SUPPORTED, from_file_lazily, load_matrix, to_float_tensor
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.expert_tiles import ExpertPacks, ExpertRows
from lowbit.runtime.load.gguf_file import GGUFFile, TensorInfo


def _check_tensors(f: GGUFFile) -> None:
    """Types first: the container parser already checked that every tensor lies inside the file."""
    for t in f.tensors:
        if t.tensor_type not in SUPPORTED:
            raise LowbitError(f"{f.path}: tensor {t.name} has type {t.tensor_type.name}, which lowbit does not support "
                              f"(supported: {', '.join(q.name for q in SUPPORTED)})")


def _gguf_to_hf_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation.

    llama.cpp's converter stores each head's rows as [head, half_dim, 2] so rotary pairs (2i, 2i+1)
    are adjacent; HF keeps [head, 2, half_dim] (rotate-half). One rotary convention in the model
    means un-permuting rows here — a lossless reorder, scales travel with their rows.
    """
    hd = n_rows // n_head
    return torch.arange(n_rows).view(n_head, hd // 2, 2).transpose(1, 2).reshape(-1)  # [h, 2, hd/2] order


@dataclass(frozen=True)
class TensorRows:
    """Where a GGML-block matrix's rows lie in its GGUF file (quant/ggml_block.py FileBlocks' source):
    the CPU's C repack reads them from there; `read()` brings them into memory for anything else."""

    file: GGUFFile
    tensor: TensorInfo
    N: int
    perm: torch.Tensor | None = None  # int64 [N]: output row n is the file's row perm[n]

    @property
    def path(self) -> str:
        return str(self.file.path)

    @property
    def offset(self) -> int:
        return self.tensor.data_offset

    def read(self) -> torch.Tensor:
        b = torch.from_numpy(self.file.read(self.tensor)).view(self.N, -1)  # uint8 [N, row bytes]
        return b if self.perm is None else b[self.perm].contiguous()

    def with_rows(self, index: torch.Tensor) -> "TensorRows":
        """The rows `index` (int64) of these, in that order."""
        index = index.to(torch.int64)
        return replace(self, perm=(index if self.perm is None else self.perm[index]).contiguous(), N=int(index.numel()))


class LazyWeights(Mapping):
    """The model's weights by name (load_gguf's), each read from the file and converted only when asked
    for and not kept: the model's constructor takes one layer's at a time, packs them and drops what it
    read, so a load holds the model plus one layer in transit, not the file and the model together.
    Asking twice reads twice. `progress(i + 1)` is told when layer i's last tensor is read."""

    def __init__(self, make: dict[str, Callable[[], Any]], progress: Callable[[int], None] | None):
        self._make, self._progress = make, progress

    def __getitem__(self, name: str):
        value = self._make[name]()
        if self._progress is not None and name.startswith("layers.") and name.endswith(".w_down"):
            self._progress(int(name.split(".")[1]) + 1)
        return value

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor (the model asks `"output" in w`)
        return name in self._make

    def tensor_name(self, name: str) -> str | None:
        """The GGUF tensor weight `name` is read from (None for one made otherwise): `lowbit quantize --recipe`
        writes each file tensor in the layout the recipe gives its weights."""
        return getattr(self._make[name], "tensor", None)

    def __iter__(self):
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


def load_gguf(source: Path | GGUFFile, target: WeightSpec | None, progress: Callable[[int], None] | None = None,
              note: Callable[[str], None] | None = None):
    """→ (LlamaConfig, weights, metadata). target None = `auto` (lossless where possible); `note`
    is told, in one line per type, of tensors `auto` cannot hold losslessly. weights: a LazyWeights
    (each value read when asked for); every tensor's name, type and shape are checked here first.

    Names: embed, output (absent when tied), norm, rope_freqs (llama3 files; LongRoPE's short
    factors), and per layer `layers.{i}.{attn_norm,ffn_norm,wq,wk,wv,wo,w_gate,w_up,w_down,bq,bk,bv}`,
    plus the family's `q_norm, k_norm` and `attn_post_norm, ffn_post_norm` (models/families.py).
    """
    f = source if isinstance(source, GGUFFile) else GGUFFile(Path(source))
    path, meta = f.path, f.metadata
    _check_tensors(f)
    tensors = {t.name: t for t in f.tensors}
    if target is None and note is not None:
        for qtype, count in sorted(Counter(t.tensor_type for t in f.tensors if t.tensor_type in REQUANTIZED).items()):
            one = count == 1
            note(f"{count} tensor{'' if one else 's'} of type {qtype.name} {'has' if one else 'have'} no lossless "
                 f"lowbit layout: requantized to {REQUANTIZED[qtype].name}")
    family = f"{meta.get('general.architecture')} model"
    if "token_embd.weight" not in tensors:
        raise LowbitError(f"{path}: missing tensor token_embd.weight ({family})")
    embd = tensors["token_embd.weight"]
    try:
        config = LlamaConfig.from_gguf(meta, vocab_size=int(embd.shape[1]), tie_embeddings="output.weight" not in tensors)
    except ValueError as e:
        raise LowbitError(f"{path}: {e}") from None

    def tensor(name: str):
        if name not in tensors:
            raise LowbitError(f"{path}: missing tensor {name} ({family})")
        return tensors[name]

    packs: dict[str, ExpertPacks] = {}  # a 3-D expert tensor's experts, packed a chunk per C call (expert_tiles.py)

    def vector(name: str, size: int | None = None, rows: torch.Tensor | None = None):
        t = tensor(name)
        if size is not None and int(t.n_elements) != size:
            raise LowbitError(f"{path}: tensor {name} has {t.n_elements} elements, but the metadata implies {size}")
        return lambda: (lambda v: v if rows is None else v[rows])(
            to_float_tensor(f.read(t), t.tensor_type, (int(t.n_elements),)))

    def matrix(name: str, spec: WeightSpec | None, rows: torch.Tensor | None = None, shape: tuple[int, int] | None = None,
               expert: int | None = None):
        """shape: the (N, K) the config implies; a file that disagrees fails here, not mid-load. expert: the
        matrix is expert `expert` of a 3-D tensor [E, N, K] (ggml order (K, N, E)), whose bytes are E
        matrices one after another: that one is read, and packed, as a matrix of its own."""
        t = tensor(name)
        if len(t.shape) != (2 if expert is None else 3):
            raise LowbitError(f"{path}: tensor {name} has shape {list(t.shape)}, expected "
                              f"{'a matrix' if expert is None else 'one matrix per expert'}")
        K, N = int(t.shape[0]), int(t.shape[1])
        if shape is not None and (N, K) != shape:
            raise LowbitError(f"{path}: tensor {name} is {N}x{K} (rows x cols), but the metadata implies "
                              f"{shape[0]}x{shape[1]}")
        if expert is not None:
            E = int(t.shape[2])
            if expert >= E:
                raise LowbitError(f"{path}: tensor {name} holds {E} experts, but the metadata implies more")
            nb = t.n_bytes // E
            if name not in packs:
                packs[name] = ExpertPacks(str(f.path), t.data_offset, E, N, nb // N)
            t = replace(t, shape=(K, N), n_elements=K * N, n_bytes=nb, data_offset=t.data_offset + expert * nb,
                        data=t.data[expert * nb:(expert + 1) * nb])

        def make():
            if spec is None and t.tensor_type in LOSSLESS and K % 32 == 0:  # left in the file until packed
                src = TensorRows(f, t, N)
                w = from_file_lazily(t.tensor_type, N, K, src if expert is None else ExpertRows(src, packs[name], expert))
            else:
                w = load_matrix(f.read(t), t.tensor_type, N, K, spec)
            return w if rows is None else w.rows(rows)
        make.tensor = name
        return make

    c = config
    fam = c.family
    # Embedding and LM head keep their file precision unless a float layout was asked for: they are
    # ~20% of a small model's bytes but set the quality of every logit.
    head_spec = target if target is not None and not target.quantized else None
    make: dict[str, Callable[[], Any]] = {"embed": matrix("token_embd.weight", head_spec, None, (c.vocab_size, c.dim)),
                                          "norm": vector("output_norm.weight", c.dim)}
    if not c.tie_embeddings:
        make["output"] = matrix("output.weight", head_spec, None, (c.vocab_size, c.dim))
    if "rope_freqs.weight" in tensors:
        make["rope_freqs"] = vector("rope_freqs.weight")
    elif "rope_factors_short.weight" in tensors:  # LongRoPE (Phi): the factors within the original context
        make["rope_freqs"] = vector("rope_factors_short.weight")
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    q_rows, k_rows = _qk_rows(c)
    head_order = rotary_row_order(c.head_dim, c.rotary_dim)
    if fam.gated_attention:  # rows of attn_q [H * 2D, dim]: each head's query (in rotary order), then its gate
        D, base = c.head_dim, 2 * c.head_dim * torch.arange(c.n_heads)[:, None]  # [H, 1]
        gated_rows = ((base + (torch.arange(D) if head_order is None else head_order)).reshape(-1),
                      (base + D + torch.arange(D)).reshape(-1))
    for i in range(c.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        make[p + "attn_norm"] = vector(b + "attn_norm.weight", c.dim)
        # llama.cpp names the MLP's norm of its hybrid families (qwen35, qwen35moe) post_attention_norm
        norm = "post_attention_norm" if fam.recurrent else fam.gguf_ffn_norm
        make[p + "ffn_norm"] = vector(b + norm + ".weight", c.dim)
        if fam.qk_norm and not c.is_recurrent(i):  # in the q/k rows' order (partial rotary reorders them)
            make[p + "q_norm"] = vector(b + "attn_q_norm.weight", c.head_dim, head_order)
            make[p + "k_norm"] = vector(b + "attn_k_norm.weight", c.head_dim, head_order)
        if fam.sandwich_norms:
            make[p + "attn_post_norm"] = vector(b + "post_attention_norm.weight", c.dim)
            make[p + "ffn_post_norm"] = vector(b + "post_ffw_norm.weight", c.dim)
        if c.is_recurrent(i):  # Gated DeltaNet in place of attention (models/deltanet.py)
            make |= _deltanet_tensors(c, p, b, matrix, vector, target)
        elif b + "attn_qkv.weight" in tensors:  # fused (Phi-3): whole rows of one tensor, split losslessly
            whole = (q_dim + 2 * kv_dim, c.dim)
            make[p + "wq"] = matrix(b + "attn_qkv.weight", target, _within(q_rows, 0, q_dim), whole)
            make[p + "wk"] = matrix(b + "attn_qkv.weight", target, _within(k_rows, q_dim, kv_dim), whole)
            make[p + "wv"] = matrix(b + "attn_qkv.weight", target, _within(None, q_dim + kv_dim, kv_dim), whole)
        elif fam.gated_attention:  # attn_q: per head its query's rows, then its gate's (HF's q_proj as is)
            make[p + "wq"] = matrix(b + "attn_q.weight", target, gated_rows[0], (2 * q_dim, c.dim))
            make[p + "wq_gate"] = matrix(b + "attn_q.weight", target, gated_rows[1], (2 * q_dim, c.dim))
        else:
            make[p + "wq"] = matrix(b + "attn_q.weight", target, q_rows, (q_dim, c.dim))
        if not c.is_recurrent(i):
            if b + "attn_qkv.weight" not in tensors:  # Phi-3's came from the fused tensor above
                make[p + "wk"] = matrix(b + "attn_k.weight", target, k_rows, (kv_dim, c.dim))
                make[p + "wv"] = matrix(b + "attn_v.weight", target, None, (kv_dim, c.dim))
            make[p + "wo"] = matrix(b + "attn_output.weight", target, None, (c.dim, q_dim))
            if fam.o_bias:  # gpt-oss
                make[p + "bo"] = vector(b + "attn_output.bias", c.dim)
            if fam.sinks:
                make[p + "sinks"] = vector(b + "attn_sinks.weight", c.n_heads)
        if c.n_experts:  # the router [E, dim] and E experts, each a slice of ffn_{gate,up,down}_exps
            make[p + "router"] = matrix(b + "ffn_gate_inp.weight", None, None, (c.n_experts, c.dim))
            if b + "ffn_gate_inp.bias" in tensors:  # gpt-oss
                make[p + "router_bias"] = vector(b + "ffn_gate_inp.bias", c.n_experts)
            I = c.expert_hidden_dim
            for e in range(c.n_experts):
                pe = f"{p}experts.{e}."
                make[pe + "w_gate"] = matrix(b + "ffn_gate_exps.weight", target, None, (I, c.dim), e)
                make[pe + "w_up"] = matrix(b + "ffn_up_exps.weight", target, None, (I, c.dim), e)
                make[pe + "w_down"] = matrix(b + "ffn_down_exps.weight", target, None, (c.dim, I), e)
                for n, size in (("gate", I), ("up", I), ("down", c.dim)):  # gpt-oss: [E, size] each
                    if f"{b}ffn_{n}_exps.bias" in tensors:
                        make[f"{pe}b_{n}"] = vector(f"{b}ffn_{n}_exps.bias", c.n_experts * size,
                                                    e * size + torch.arange(size))
            if c.shared_expert_hidden_dim:  # Qwen3.5-MoE: the shared expert and its gate [dim] (ffn_gate_inp_shexp)
                Is, ps = c.shared_expert_hidden_dim, p + "shared."
                make[ps + "w_gate"] = matrix(b + "ffn_gate_shexp.weight", target, None, (Is, c.dim))
                make[ps + "w_up"] = matrix(b + "ffn_up_shexp.weight", target, None, (Is, c.dim))
                make[ps + "w_down"] = matrix(b + "ffn_down_shexp.weight", target, None, (c.dim, Is))
                make[p + "shared_gate"] = vector(b + "ffn_gate_inp_shexp.weight", c.dim)
        elif b + "ffn_gate.weight" not in tensors and fam.fused_tensors:  # ffn_up holds [gate; up] (Phi-3)
            whole = (2 * c.hidden_dim, c.dim)
            make[p + "w_gate"] = matrix(b + "ffn_up.weight", target, _within(None, 0, c.hidden_dim), whole)
            make[p + "w_up"] = matrix(b + "ffn_up.weight", target, _within(None, c.hidden_dim, c.hidden_dim), whole)
        else:
            make[p + "w_gate"] = matrix(b + "ffn_gate.weight", target, None, (c.hidden_dim, c.dim))
            make[p + "w_up"] = matrix(b + "ffn_up.weight", target, None, (c.hidden_dim, c.dim))
        if not c.n_experts:
            make[p + "w_down"] = matrix(b + "ffn_down.weight", target, None, (c.dim, c.hidden_dim))
        for n, rows in (("q", q_rows), ("k", k_rows), ("v", None)):
            if f"{b}attn_{n}.bias" in tensors:
                make[p + "b" + n] = vector(f"{b}attn_{n}.bias", q_dim if n == "q" else kv_dim, rows)
    return config, LazyWeights(make, progress), meta


def _deltanet_tensors(c: LlamaConfig, p: str, b: str, matrix, vector, target) -> dict[str, Callable[[], Any]]:
    """A Gated DeltaNet layer's tensors as llama.cpp's converter writes them (conversion/qwen.py): in_proj_qkv
    as attn_qkv, in_proj_z as attn_gate, the conv [C, K] squeezed, A already -exp(A_log) (ssm_a), dt_bias as
    ssm_dt.bias, and the value heads tiled (config.deltanet.v_tiled: the layer maps heads, nothing is moved)."""
    d = c.deltanet
    v_dim = d.v_heads * d.v_dim
    return {p + "ssm_qkv": matrix(b + "attn_qkv.weight", target, None, (d.conv_dim, c.dim)),
            p + "ssm_z": matrix(b + "attn_gate.weight", target, None, (v_dim, c.dim)),
            p + "ssm_beta": matrix(b + "ssm_beta.weight", target, None, (d.v_heads, c.dim)),
            p + "ssm_alpha": matrix(b + "ssm_alpha.weight", target, None, (d.v_heads, c.dim)),
            p + "ssm_out": matrix(b + "ssm_out.weight", target, None, (c.dim, v_dim)),
            p + "ssm_conv": vector(b + "ssm_conv1d.weight", d.conv_dim * d.conv_taps),
            p + "ssm_dt": vector(b + "ssm_dt.bias", d.v_heads), p + "ssm_a": vector(b + "ssm_a", d.v_heads),
            p + "ssm_norm": vector(b + "ssm_norm.weight", d.v_dim)}


def _qk_rows(c: LlamaConfig) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rows of the file's Q and K matrices in the model's order: llama.cpp's pair permutation undone
    (families converted with it), then partial rotary's reorder (models/rope.py), or None for as stored."""
    q = k = None
    if c.family.gguf_permuted:
        q = _gguf_to_hf_rows(c.n_heads * c.head_dim, c.n_heads)
        k = _gguf_to_hf_rows(c.n_kv_heads * c.head_dim, c.n_kv_heads)
    order = rotary_row_order(c.head_dim, c.rotary_dim)
    if order is not None:
        qo, ko = head_rows(order, c.n_heads), head_rows(order, c.n_kv_heads)
        q, k = (qo if q is None else q[qo]), (ko if k is None else k[ko])
    return q, k


def _within(rows: torch.Tensor | None, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of a fused tensor, in the order `rows` gives within that part."""
    return start + (torch.arange(n) if rows is None else rows)


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in the file (what the memory acceptance compares against)."""
    return sum(t.n_bytes for t in GGUFFile(path).tensors)


def gguf_tensor_types(path: Path) -> dict[str, tuple[int, int]]:
    """Each GGUF tensor type in the file → (tensor count, bytes of tensor data), largest first."""
    out: dict[str, list[int]] = {}
    for t in GGUFFile(path).tensors:
        entry = out.setdefault(t.tensor_type.name, [0, 0])
        entry[0] += 1
        entry[1] += int(t.n_bytes)
    return {k: (n, b) for k, (n, b) in sorted(out.items(), key=lambda kv: -kv[1][1])}
