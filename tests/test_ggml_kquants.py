"""GGUF K-quants, 5-bit types and i-quants held as the file stores them (quant/ggml_block.py) and
multiplied by kernels that read those blocks (kernels/ggml_mm.py, cpu_ggml.c).

The files are made as users get them: the default model written to an F32 GGUF with gguf's writer,
then quantized by llama.cpp's own quantizer (llama_cpp.llama_model_quantize) into its usual mixes.
SmolLM2-135M's 576-wide matrices are not whole 256-value super-blocks, so llama.cpp gives those
Q5_0/Q5_1/Q4_0/IQ4_NL and the 1536-wide ffn_down the K-quant; between them the five files hold
every type this issue covers. The oracle is gguf.quants.dequantize: equal bit for bit.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from lowbit.kernels.ggml_blocks import BLOCKS, ggml_dequant_ref
from lowbit.kernels.ggml_mm import ggml_mm, ggml_pack
from lowbit.quant.ggml import load_matrix
from lowbit.quant.ggml_block import GgmlWeight, as_blocks, concat_rows
from lowbit.quant import parse_weights, quantize_weight

llama_cpp = pytest.importorskip("llama_cpp")

# file → (llama.cpp ftype, pure): together they hold Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS
MIXES = {"Q4_K_M": ("Q4_K_M", False), "Q5_K_M": ("Q5_K_M", False), "Q3_K_S": ("Q3_K_S", False),
         "Q2_K": ("Q2_K", True), "IQ4_XS": ("IQ4_XS", False)}
TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS]


def write_f32_gguf(src, dst) -> None:
    """Every tensor of src dequantized to F32, every metadata key copied: what convert_hf_to_gguf.py
    --outtype f32 would give for this model."""
    r = GGUFReader(src)
    w = GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), kind, sub_type=sub)
    for t in r.tensors:
        values = quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(f32, dst, ftype: str, pure: bool) -> None:
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = 2
    p.pure = pure  # Q2_K's own mix gives ffn_down Q3_K; pure keeps every quantizable tensor Q2_K
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(dst).encode(), ctypes.byref(p)) == 0


@pytest.fixture(scope="module")
def files(default_gguf, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("kquants")
    f32 = d / "f32.gguf"
    write_f32_gguf(default_gguf, f32)
    out = {"F32": f32}
    for name, (ftype, pure) in MIXES.items():
        out[name] = d / f"{name}.gguf"
        quantize(f32, out[name], ftype, pure)
    return out


@pytest.fixture(scope="module")
def readers(files) -> dict:
    """Each file parsed once (gguf's reader spends seconds on the 49,152-token vocabulary)."""
    return {name: GGUFReader(files[name]) for name in MIXES}


def matrices(readers, qtype: T):
    """(file, tensor) for every matrix of this type in the files."""
    for name, r in readers.items():
        for t in r.tensors:
            if t.tensor_type == qtype and len(t.shape) == 2:
                yield name, t


def reference(t) -> torch.Tensor:
    K, N = (int(d) for d in t.shape)
    return torch.from_numpy(quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)).reshape(N, K)


def test_the_files_hold_every_type(readers):
    held = {t.tensor_type for r in readers.values() for t in r.tensors}
    assert set(TYPES) <= held, f"missing: {[q.name for q in set(TYPES) - held]}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_tensor_dequantizes_bit_exactly_like_gguf(readers, qtype, c_kernels):
    native = c_kernels.native()
    count = 0
    for name, t in matrices(readers, qtype):
        K, N = (int(d) for d in t.shape)
        w = load_matrix(t.data, t.tensor_type, N, K, None)
        assert isinstance(w, GgmlWeight) and w.spec.name == qtype.name
        assert w.nbytes == t.n_bytes, f"{name} {t.name}: {w.nbytes} bytes held for {t.n_bytes} in the file"
        ref = reference(t)
        got = w.dequantize()
        assert got.dtype == torch.float32 and torch.equal(got, ref), f"{name} {t.name}: torch spec differs"
        p = ggml_pack(w.data, w.qtype, K, native=native)
        assert torch.equal(p.dequantize_rows(0, N), ref), f"{name} {t.name}: C dequantization differs"
        assert torch.equal(p.dequantize_rows(5, 17), ref[5:17])
        count += 1
    assert count > 0


def _one(readers, qtype: T):
    return next(t for _, t in matrices(readers, qtype))


@pytest.fixture(scope="module")
def avx2_only(tmp_path_factory):
    """The library an AVX2-only CPU builds (no AVX-512, no VNNI), compiled here from the same sources
    into a cache of its own."""
    import os

    from lowbit.kernels import cpu_native

    if cpu_native.native() is None:
        pytest.skip("the C kernels do not build here (tests/test_cpu_native.py says whether they must)")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("avx2-build"))
    try:
        k = cpu_native.load(cpu_native._build({"avx2", "fma", "f16c", "bmi2"}))
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old
    assert k.isas == ["avx2"]
    return k


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_fast_kernel_is_close_batch_invariant_and_one_isa(readers, qtype, c_kernels, avx2_only):
    """The C fast path: within the 16-bit activation rounding of the exact product, each row the same
    bits whatever else shares the call, and the same on every instruction set the library has and on
    the library an AVX2-only machine builds."""
    native = c_kernels.native()
    t = _one(readers, qtype)
    K, N = (int(d) for d in t.shape)
    w = load_matrix(t.data, t.tensor_type, N, K, None)
    p = ggml_pack(w.data, w.qtype, K, native=native)
    torch.manual_seed(int(qtype))
    x = torch.randn(16, K)
    exact = x.double() @ reference(t).double().t()
    y = ggml_mm(x, p, exact=False)
    err = (y.double() - exact).norm() / exact.norm()
    assert err < 1e-4, f"{qtype.name}: relative error {err:.2e}"
    assert not torch.equal(y, ggml_mm(x, p, exact=True))  # the fast path is not the exact one
    for M in (1, 2, 3, 5, 8, 15):
        assert torch.equal(ggml_mm(x[:M], p, exact=False), y[:M]), f"M={M}"
    assert torch.equal(ggml_mm(x[7:8], p, exact=False), y[7:8])
    for kernels in [native.with_isa(isa) for isa in native.isas] + [avx2_only]:
        q = ggml_pack(w.data, w.qtype, K, native=kernels)
        assert torch.equal(ggml_mm(x, q, exact=False), y), kernels.isa


KQ_TILED = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1]


@pytest.mark.parametrize("qtype", KQ_TILED, ids=lambda q: q.name)
def test_tiles_of_llama_cpp_tensors_are_the_file_and_the_integer_spec(readers, qtype, c_kernels, avx2_only):
    """What a CPU load does with these types (kernels/kq_mm.py): the file's blocks repacked into 16-row
    tiles, whose rows give back gguf's weights bit for bit, and whose fast path gives kq_mm_fast_ref's
    bits on every instruction set the library has and on an AVX2-only build, at every M."""
    from lowbit.kernels.kq_mm import kq_mm, kq_mm_fast_ref, kq_pack, kq_pack_ref

    native = c_kernels.native()
    t = _one(readers, qtype)
    K, N = (int(d) for d in t.shape)
    blocks = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(N, -1).copy())
    p = kq_pack(blocks, int(qtype), K, native=native)
    assert torch.equal(p.data, kq_pack_ref(blocks, int(qtype), K))
    assert torch.equal(p.dequantize_rows(0, N), reference(t))
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(int(qtype)))
    want = kq_mm_fast_ref(x, blocks, int(qtype))
    exact = x.double() @ reference(t).double().t()
    assert (want.double() - exact).norm() / exact.norm() < 1e-4
    for kernels in [native.with_isa(isa) for isa in native.isas] + [avx2_only]:
        q = kq_pack(blocks, int(qtype), K, native=kernels)
        for M in (1, 2, 3, 5, 16):
            assert torch.equal(kq_mm(x[:M], q, False), want[:M]), (kernels.isa, M)


def test_a_q4_k_m_prompt_on_the_integer_kernels_is_within_1e6_kl(files, c_kernels):
    """A 512-token prompt of the Q4_K_M file, every matmul on the tiles' integer kernels, against the
    exact fp32 pass over the same file: mean KL within 1e-6, top-1 the same."""
    import torch.nn.functional as F

    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.loader import load
    from tests.helpers import forward

    lm = load(str(files["Q4_K_M"]), "auto", progress=False, backend=torch_backend(c_kernels.native()))
    ids = list(torch.randint(100, 40000, (512,), generator=torch.Generator().manual_seed(0)).tolist())
    with torch.inference_mode():
        ref = forward(lm.model, torch.tensor([ids]), exact=True)[0]
        fast = forward(lm.model, torch.tensor([ids]))[0]
    kl = F.kl_div(F.log_softmax(fast.double(), -1), F.log_softmax(ref.double(), -1), log_target=True,
                  reduction="none").sum(-1)
    assert kl.mean() <= 1e-6 and (fast.argmax(-1) == ref.argmax(-1)).double().mean() >= 0.99, float(kl.mean())


def test_exact_path_without_c_kernels_is_the_spec(readers):
    t = _one(readers, T.Q4_K)
    K, N = (int(d) for d in t.shape)
    w = load_matrix(t.data, t.tensor_type, N, K, None)
    p = ggml_pack(w.data, w.qtype, K, native=None)
    x = torch.randn(3, K)
    assert torch.equal(ggml_mm(x, p), torch.nn.functional.linear(torch.nn.functional.pad(x, (0, 0, 0, 13)),
                                                                reference(t))[:3])


def test_fused_rows_of_two_types_equal_each_alone(readers, c_kernels):
    """A QKV with Q5_0 Q/K rows and Q8_0 V rows (Q4_K_M's first layers) is one call, two segments."""
    native = c_kernels.native()
    tensors = {t.name: t for t in readers["Q4_K_M"].tensors}
    parts = []
    for n in ("attn_q", "attn_k", "attn_v"):
        t = tensors[f"blk.0.{n}.weight"]
        K, N = (int(d) for d in t.shape)
        parts.append((t, load_matrix(t.data, t.tensor_type, N, K, None)))
    assert [t.tensor_type for t, _ in parts] == [T.Q5_0, T.Q5_0, T.Q8_0]
    fused = concat_rows([w for _, w in parts])
    assert fused is not None and fused.spec.name == "Q5_0" and fused.spec2.name == "Q8_0"
    assert torch.equal(fused.dequantize(), torch.cat([reference(t) for t, _ in parts]))
    p = ggml_pack(fused.data, fused.qtype, fused.in_features, fused.data2, fused.qtype2, native=native)
    x = torch.randn(4, fused.in_features)
    alone = [ggml_mm(x, ggml_pack(b.data, b.qtype, b.in_features, native=native), exact=False)
             for b in (as_blocks(w) for _, w in parts)]
    assert torch.equal(ggml_mm(x, p, exact=False), torch.cat(alone, dim=1))
    assert torch.equal(p.dequantize_rows(0, p.out_features), fused.dequantize())


@pytest.mark.parametrize("layout", ["int4-g32", "int4-sym-g32", "int8-g32"])
def test_lowbit_layouts_become_the_same_values_as_blocks(layout):
    w = quantize_weight(torch.randn(40, 96), parse_weights(layout))
    b = as_blocks(w)
    assert b.spec.name == {"int4-g32": "Q4_1", "int4-sym-g32": "Q4_0", "int8-g32": "Q8_0"}[layout]
    assert torch.equal(b.dequantize(), w.dequantize()) and b.nbytes == w.nbytes


def test_block_spec_matches_gguf_on_random_blocks():
    """Every byte pattern, not only what a quantizer writes: random blocks (fp16 scales made finite)."""
    rng = np.random.default_rng(0)
    for qtype, (name, qk, nb) in BLOCKS.items():
        raw = rng.integers(0, 256, size=(64, nb), dtype=np.uint8)
        scale_at = {"Q2_K": [80, 82], "Q3_K": [108], "Q6_K": [208]}.get(name, [0] + ([2] if name in (
            "Q4_1", "Q5_1", "Q4_K", "Q5_K") else []))
        for o in scale_at:  # scales in [2^-10, 2) with either sign: no inf/nan in the products
            raw[:, o:o + 2] = (rng.uniform(-2, 2, 64).astype(np.float16)).view(np.uint8).reshape(64, 2)
        ref = quants.dequantize(raw.reshape(-1), T(qtype)).astype(np.float32).reshape(4, -1)
        got = ggml_dequant_ref(torch.from_numpy(raw.reshape(4, -1)), qtype, 16 * qk)
        assert torch.equal(got, torch.from_numpy(ref)), name


@pytest.mark.parametrize("mix", list(MIXES))
def test_whole_file_held_at_its_size_every_block_fused(files, mix, c_kernels):
    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.gguf import gguf_tensor_bytes
    from lowbit.runtime.load.loader import load

    lm = load(str(files[mix]), "auto", progress=False, backend=torch_backend(c_kernels.native()))
    ratio = lm.weight_bytes / gguf_tensor_bytes(files[mix])
    assert ratio <= 1.05, f"{mix}: {ratio:.3f}x the file's tensor bytes"
    # one C call per decode step needs every block fused, mixed-type QKV included
    assert lm.model.fused_layers is not None, [len(layer.qkv.parts) for layer in lm.model.layers]


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_a_load_packs_the_files_blocks_straight_from_the_file(files, mix, c_kernels, monkeypatch):
    """A CPU load repacks every matrix of these types from the file itself (C reads the rows: the
    loader's Python reads only the norms), a layer at a time, into tiles of the file's size: what keeps
    an 8B Q4_K_M's peak memory at its tiles (4.8 GB for 4.46 GB of tensors) instead of file + copies."""
    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.gguf import gguf_tensor_bytes
    from lowbit.runtime.load.gguf_file import GGUFFile
    from lowbit.runtime.load.loader import load

    read, orig = [], GGUFFile.read
    monkeypatch.setattr(GGUFFile, "read", lambda self, t: read.append((t.name, t.n_bytes)) or orig(self, t))
    lm = load(str(files[mix]), "auto", progress=False, backend=torch_backend(c_kernels.native()))
    total = gguf_tensor_bytes(files[mix])
    assert sum(n for _, n in read) < 0.01 * total, sorted(read, key=lambda r: -r[1])[:3]
    assert all(name.endswith("norm.weight") for name, _ in read), [n for n, _ in read if "norm" not in n]
    assert lm.weight_bytes <= 1.02 * total and lm.model.fused_layers is not None


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q4_K_M", "IQ4_XS"])
def test_eval_auto_equals_the_fp32_dequantized_file(files, mix, tmp_path):
    """`lowbit eval --weights auto --kv f16` as users run it: KL 0 against the fp32 reference (the same
    file dequantized), where requantizing gave mean KL 8e-4 on Q4_K_M."""
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "lowbit.runtime.cli", "eval", "--model", str(files[mix]),
                        "--weights", "auto", "--kv", "f16", "--ctx", "512", "--chunks", "1", "--no-speed",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = {(row["weights"], row["kv"]): row for row in json.loads(out.read_text())["rows"]}
    auto = rows[("auto", "f16")]
    assert auto["kl_mean"] <= 1e-6 and auto["top1_pct"] == 100, auto


def test_greedy_decode_on_the_fast_kernels_follows_the_exact_model(files, c_kernels):
    """Decoding a Q4_K_M file on the fused C path (every matmul on the GGML-block kernels) gives the
    exact model's greedy tokens for a short reply."""
    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.loader import load
    from tests.helpers import forward

    lm = load(str(files["Q4_K_M"]), "auto", progress=False, backend=torch_backend(c_kernels.native()))
    ids = lm.tokenizer.encode("The capital of France is")
    exact, fast = list(ids), list(ids)
    for _ in range(8):
        exact.append(int(forward(lm.model, torch.tensor([exact]), exact=True)[0, -1].argmax()))
    for _ in range(8):
        fast.append(int(forward(lm.model, torch.tensor([fast]), exact=False)[0, -1].argmax()))
    assert fast == exact
