"""A GGUF file → a GGUF file in one of lowbit's layouts that GGUF has a block type for (`lowbit quantize`).

    auto                  every tensor's bytes as stored (a lossless copy)
    int4-sym-g32  q4_0    Q4_0: w = d * (u - 8), fp16 d per 32        lowbit's quantizer, its codes and scales
    int4-g32      q4_1    Q4_1: w = d * u + m, fp16 d and m per 32    (quant/int4.py, quant/int8.py keep fp16
    int8-g32      q8_0    Q8_0: w = d * q, fp16 d per 32               scales, so the blocks hold them exactly)
    f16, bf16, f32        F16 / BF16 / F32

The other layouts (int4-g64/g128, int8 per channel, int8-g64/g128, bnb-*) have no GGUF type.

Which tensors change follows llama.cpp's llama_model_quantize for the ftype (src/llama-quant.cpp), so that the
file is the one users expect: 1-D tensors, norms, MoE routers and conv kernels stay as stored; a tensor whose rows
are not whole blocks of 32 stays as stored (llama.cpp falls back to F16 there; GGUF cannot hold lowbit's padded
groups); a tensor already in the target type is copied as stored (what lowbit's loader holds for it: the relayout
is exact). The embedding and the output head under a quantized layout: already quantized in the file, they are
copied (lowbit's loader keeps them at the file's precision under any quantized layout); a float output head
(output.weight, or token_embd.weight when tied) becomes Q8_0 — llama.cpp gives it Q6_K where rows are whole
256-blocks, else Q8_0, and lowbit has no Q6_K quantizer; a float untied token_embd gets the target, as in
llama.cpp. Everything else is dequantized to fp32 (gguf.quants.dequantize) and quantized by lowbit's own
quantizer, so `lowbit run OUT` holds what `lowbit run MODEL --weights LAYOUT` holds for those matrices.

Metadata is copied key by key with its value types, tokenizer included, but for the keys about the file itself
(alignment: the writer's 32; split.*: one file) and, unless auto, the file type and quantization version, which are
written anew. The file is written one tensor at a time (gguf's GGUFWriter: infos first, then each tensor's bytes),
into a `.part` file beside the output that is renamed into place only when whole: the default model copied with auto
is the same file, byte for byte.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from gguf import GGML_QUANT_VERSION, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from lowbit.quant import WeightSpec, parse_weights, quantize_weight
from lowbit.quant.ggml import FLOATS, RELAYOUT, SUPPORTED, WRITES, to_blocks, to_float_tensor
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.gguf_file import GGUFFile, TensorInfo

# layout name → the GGUF type that holds it exactly
LAYOUTS = MappingProxyType({**{s.name: q for s, q in WRITES.items()}, "f16": T.F16, "bf16": T.BF16, "f32": T.F32})
LLAMA_CPP_NAMES = MappingProxyType({q.name.lower(): name for name, q in LAYOUTS.items()})  # q4_0 → int4-sym-g32
FILE_TYPES = MappingProxyType({T.Q4_0: LlamaFileType.MOSTLY_Q4_0, T.Q4_1: LlamaFileType.MOSTLY_Q4_1,
                               T.Q8_0: LlamaFileType.MOSTLY_Q8_0, T.F16: LlamaFileType.MOSTLY_F16,
                               T.BF16: LlamaFileType.MOSTLY_BF16, T.F32: LlamaFileType.ALL_F32})
# llama.cpp's tensor_allows_quantization: names it never quantizes, whatever the ftype (the ones lowbit's
# families and their neighbours have; 1-D tensors are kept anyway)
NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "pos_embd", "token_types", "altup", "laurel",
                   "per_layer_model_proj")
# keys about the file, not the model: the writer's own (architecture, its default alignment of 32) or a split's
FILE_KEYS = frozenset({"general.architecture", "general.alignment", "split.no", "split.count", "split.tensors.count"})
# keys about the tensors' types: a copy (auto) keeps the source's, a layout writes its own
TYPE_KEYS = frozenset({"general.file_type", "general.quantization_version"})
EMBED, HEAD = "token_embd.weight", "output.weight"
# weights dequantized to fp32 at a time: an 8B model's 525M-weight embedding would take 2.1 GB at once
CHUNK_WEIGHTS = 1 << 24


def writable_names() -> str:
    return ", ".join(["auto", *(n if n == q.name.lower() else f"{n} or {q.name.lower()}" for n, q in LAYOUTS.items())])


def parse_layout(name: str) -> WeightSpec | None:
    """`int4-g32` or llama.cpp's `q4_1` → the spec (None for `auto`); one line naming what can be written else."""
    s = name.strip().lower()
    if s == "auto":
        return None
    try:
        spec = parse_weights(LLAMA_CPP_NAMES.get(s, s))
    except ValueError:
        raise LowbitError(f"unknown layout {name!r}; lowbit quantize writes: {writable_names()}") from None
    if spec.name not in LAYOUTS:
        raise LowbitError(f"layout {spec.name} has no GGUF type; lowbit quantize writes: {writable_names()}")
    return spec


@dataclass(frozen=True)
class Written:
    path: Path
    types: dict[str, int]  # GGUF type name → tensors of it, most first
    tensor_bytes: int
    weights: int  # elements of every tensor
    file_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.tensor_bytes / max(self.weights, 1)


def target_type(t: TensorInfo, spec: WeightSpec | None, tied: bool) -> T:
    """The type tensor `t` is written in (the rules in the module docstring)."""
    if spec is None or len(t.shape) < 2 or not t.name.endswith("weight") or any(n in t.name for n in NEVER_QUANTIZED):
        return t.tensor_type
    want = LAYOUTS[spec.name]
    if not spec.quantized:
        return want
    if t.shape[0] % 32:
        return t.tensor_type
    if t.name in (EMBED, HEAD) and t.tensor_type not in FLOATS:
        return t.tensor_type
    if t.name == HEAD or (t.name == EMBED and tied):
        return T.Q8_0
    return want


def _converted(f: GGUFFile, t: TensorInfo, qtype: T) -> np.ndarray:
    """Tensor `t` in type `qtype` → its bytes (uint8), through fp32 a chunk of rows at a time."""
    raw = f.read(t)
    if qtype == t.tensor_type:
        return raw
    K = int(t.shape[0])
    N = t.n_elements // K  # rows: a 3-D expert tensor's are every expert's, one after another
    rows = raw.reshape(N, -1)  # [N, row bytes]
    spec = RELAYOUT.get(qtype)
    out = []
    for start in range(0, N, max(1, CHUNK_WEIGHTS // K)):
        chunk = rows[start:start + max(1, CHUNK_WEIGHTS // K)]
        w = to_float_tensor(chunk, t.tensor_type, (chunk.shape[0], K))  # fp32 [n, K]
        if spec is not None:
            out.append(to_blocks(quantize_weight(w, spec)))
        else:  # numpy has no bf16: the bytes through torch
            out.append(w.to(FLOATS[qtype]).view(torch.uint8).numpy())
    return np.concatenate(out, axis=0).reshape(-1)


def recipe_specs(source: GGUFFile, recipe) -> dict[str, WeightSpec | None]:
    """The spec each file tensor is written in under a `lowbit fit` recipe (runtime/load/recipe.py): its weights'
    layout (a fused tensor whose weights the recipe splits takes the one of most bytes: the most faithful).
    One line when a layout has no GGUF type."""
    from lowbit.runtime.load.fits import spec_bytes
    from lowbit.runtime.load.gguf import load_gguf
    from lowbit.runtime.load.recipe import check

    config, w, _ = load_gguf(source, None)
    check(recipe, w, config.n_kv_layers, source.path.name)
    by_tensor: dict[str, set[str]] = {}
    for key in w:
        name = w.tensor_name(key)
        if name is not None:
            by_tensor.setdefault(name, set()).add(recipe.layout_of(key))
    out = {}
    for name, layouts in by_tensor.items():
        specs = []
        for layout in layouts:
            try:
                specs.append(parse_layout(layout))
            except LowbitError:
                raise LowbitError(f"the recipe's layout {layout} has no GGUF type; lowbit quantize writes "
                                  f"{writable_names()} (fit with those --layouts to write its recipe)") from None
        out[name] = None if None in specs else max(specs, key=lambda s: spec_bytes(1 << 20, s))
    return out


def _nbytes(t: TensorInfo, qtype: T) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return t.n_elements // block * size


def write_gguf(source: GGUFFile, out: Path, spec: WeightSpec | None,
               progress: Callable[[int], None] | None = None,
               per_tensor: dict[str, WeightSpec | None] | None = None) -> Written:
    """`source` with its tensors in `spec`'s GGUF type (None: as stored) → `out`. progress(i) after tensor i.
    per_tensor: a spec for each named file tensor in place of `spec` (a recipe's: `recipe_specs`); the file type
    written is then the one most of its quantized tensors take."""
    out = Path(out)
    if not out.parent.is_dir():
        raise LowbitError(f"cannot write {out}: directory {out.parent} does not exist")
    if out.exists() and (out.is_dir() or out.samefile(source.path)):
        raise LowbitError(f"cannot write {out}: it is {'a directory' if out.is_dir() else 'the model being read'}")
    tied = not any(t.name == HEAD for t in source.tensors)
    specs = {t.name: (per_tensor or {}).get(t.name, spec) for t in source.tensors}
    plan = [(t, target_type(t, specs[t.name], tied)) for t in source.tensors]
    if per_tensor is not None:  # the file type of most of what was asked for (llama.cpp's ftype names one)
        asked = Counter(s.name for s in specs.values() if s is not None)
        spec = parse_weights(asked.most_common(1)[0][0]) if asked else None
    for t, qtype in plan:  # every type checked before a byte is written
        if qtype != t.tensor_type and t.tensor_type not in SUPPORTED:
            raise LowbitError(f"{source.path}: tensor {t.name} has type {t.tensor_type.name}, which lowbit cannot "
                              f"dequantize (supported: {', '.join(q.name for q in SUPPORTED)})")
    part = out.with_name(f".{out.name}.{os.getpid()}.part")  # the writer creates it as any file (umask's mode)
    try:
        _write(source, Path(part), spec, plan, progress)
        os.replace(part, out)
    except OSError as e:
        raise LowbitError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        if os.path.exists(part):
            os.unlink(part)
    types: dict[str, int] = {}
    for _, qtype in plan:
        types[qtype.name] = types.get(qtype.name, 0) + 1
    return Written(out, dict(sorted(types.items(), key=lambda kv: -kv[1])), sum(_nbytes(t, q) for t, q in plan),
                   sum(t.n_elements for t in source.tensors), out.stat().st_size)


def _write(source: GGUFFile, path: Path, spec: WeightSpec | None, plan: list[tuple[TensorInfo, T]],
           progress: Callable[[int], None] | None) -> None:
    meta = source.metadata
    w = GGUFWriter(path, str(meta.get("general.architecture", "llama")))  # it writes general.architecture itself
    # TYPE_KEYS in the source's place where it has them, else last
    fresh = {} if spec is None else {
        "general.file_type": (int(FILE_TYPES[LAYOUTS[spec.name]]), GGUFValueType.UINT32),
        "general.quantization_version": (GGML_QUANT_VERSION, GGUFValueType.UINT32)}
    for key, value in meta.items():
        vtype, item = source.value_types[key]
        if key in fresh:
            w.add_key_value(key, *fresh.pop(key))
        # GGUFWriter refuses empty arrays; gguf-py's converters never write one (add_array skips them)
        elif key not in FILE_KEYS and not (isinstance(value, list) and not value):
            w.add_key_value(key, value, vtype, sub_type=item)
    for key, (value, vtype) in fresh.items():
        w.add_key_value(key, value, vtype)
    for t, qtype in plan:  # numpy order (outermost first), as GGUFWriter takes shapes
        w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), _nbytes(t, qtype), raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (t, qtype) in enumerate(plan):
            data = _converted(source, t, qtype)
            assert data.nbytes == _nbytes(t, qtype), (t.name, qtype.name)
            w.write_tensor_data(data)
            if progress is not None:
                progress(i + 1)
    finally:
        w.close()
