"""GGML block formats into lowbit layouts (quant/ggml.py), against `gguf.quants.dequantize`.

Lossless: Q4_0 / Q4_1 / Q8_0 move in code for code and scale for scale, so lowbit's reference
dequantization must equal gguf's EXACTLY (torch.equal on fp32) — on every matrix of the default
model, on tiny files written here (odd shapes, zeros, constants, huge/tiny/negative-only values),
and through the whole GGUF loader, whose Q/K rows are un-permuted from llama.cpp's rotary order.
F16/BF16/F32 stay float under `auto`, also exactly. Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 are kept as blocks
under `auto` (tests/test_ggml_kquants.py); asked for a lowbit layout (`--weights int4-g32`), they are
requantized into it within the rounding bound of that layout.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

from lowbit.quant import FloatWeight, Int4Weight, Int8Weight, parse_weights, quantize_weight
from lowbit.quant.ggml import load_matrix
from lowbit.runtime.load.gguf_file import GGUFFile
from lowbit.runtime.load.gguf import load_gguf

LOSSLESS = {T.Q4_0: "int4-sym-g32", T.Q4_1: "int4-g32", T.Q8_0: "int8-g32"}
# the layout each is asked to move into (`--weights`), a requantization
REQUANTIZED = {T.Q4_K: "int4-g32", T.Q5_K: "int8-g32", T.Q6_K: "int8-g32", T.Q5_0: "int8-g32", T.Q5_1: "int8-g32"}


def reference(data: np.ndarray, qtype: T, N: int, K: int) -> torch.Tensor:
    """gguf's own dequantization, fp32 [N, K]."""
    return torch.from_numpy(np.array(quants.dequantize(np.asarray(data), qtype), dtype=np.float32)).reshape(N, K)


def matrix_of(t) -> tuple[int, int]:
    """(N, K) of a GGUF matrix: ggml stores the row length first."""
    K, N = (int(d) for d in t.shape)
    return N, K


def assert_lossless(t, w) -> None:
    N, K = matrix_of(t)
    spec = parse_weights(LOSSLESS[t.tensor_type])
    assert w.spec == spec, f"{t.name}: {t.tensor_type.name} got layout {w.spec.name}, expected {spec.name}"
    assert isinstance(w, Int8Weight if spec.bits == 8 else Int4Weight)
    assert w.shape == (N, K)
    assert w.nbytes == t.n_bytes, f"{t.name}: {w.nbytes} bytes held for {t.n_bytes} in the file"
    ref = reference(t.data, t.tensor_type, N, K)
    got = w.dequantize()
    assert got.dtype == torch.float32 and got.shape == (N, K)
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()[:5].tolist()
        raise AssertionError(f"{t.name} ({t.tensor_type.name}, {N}x{K}): not bit-exact, first differences at {bad}")


# ---- the default model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_file(default_gguf) -> GGUFFile:
    return GGUFFile(default_gguf)


def test_default_model_every_matrix_is_lossless(default_file):
    mats = [t for t in default_file.tensors if len(t.shape) == 2]
    assert len(mats) == 1 + 30 * 7  # token_embd (tied: no output.weight) + 7 projections per layer
    types = {t.name: t.tensor_type for t in mats}
    assert types.pop("token_embd.weight") == T.Q8_0
    assert set(types.values()) == {T.Q4_1}
    for t in mats:
        N, K = matrix_of(t)
        assert_lossless(t, load_matrix(t.data, t.tensor_type, N, K, None))


# ---- the default model through the whole loader (Q/K un-permuted) ------------------------------

def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotate-half rows → llama.cpp's adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def loaded(default_gguf):
    return load_gguf(default_gguf, None)


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_loader_unpermutes_q_and_k_losslessly(loaded, default_file, layer):
    config, weights, _ = loaded
    tensors = {t.name: t for t in default_file.tensors}
    for ours, theirs, heads in (("wq", "attn_q", config.n_heads), ("wk", "attn_k", config.n_kv_heads)):
        t = tensors[f"blk.{layer}.{theirs}.weight"]
        w = weights[f"layers.{layer}.{ours}"]
        assert w.spec == parse_weights("int4-g32") and w.nbytes == t.n_bytes
        ref = reference(t.data, t.tensor_type, *matrix_of(t))
        got = w.dequantize()
        assert torch.equal(llama_cpp_permute(got, heads), ref), f"layer {layer} {ours}"
        assert not torch.equal(got, ref)  # the reorder is real: lowbit holds HF's rotate-half order
    for ours, theirs in (("wv", "attn_v"), ("wo", "attn_output"), ("w_gate", "ffn_gate"), ("w_up", "ffn_up"),
                         ("w_down", "ffn_down")):
        t = tensors[f"blk.{layer}.{theirs}.weight"]
        assert_lossless(t, weights[f"layers.{layer}.{ours}"])
    for ours, theirs in (("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm")):
        t = tensors[f"blk.{layer}.{theirs}.weight"]
        assert torch.equal(weights[f"layers.{layer}.{ours}"], torch.from_numpy(np.array(t.data).view(np.float32)))


def test_loader_embedding_and_config(loaded, default_file):
    config, weights, meta = loaded
    assert (config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.head_dim) == (30, 576, 9, 3, 64)
    assert config.tie_embeddings and "output" not in weights
    t = next(t for t in default_file.tensors if t.name == "token_embd.weight")
    assert_lossless(t, weights["embed"])
    assert meta["general.architecture"] == "llama"


# ---- tiny files written here -------------------------------------------------------------------

SHAPES = list(itertools.product((1, 3, 64), (32, 96, 256)))  # (N, K)
HUGE = {T.Q8_0: 1e6, T.Q4_0: 4e5, T.Q4_1: 6e4}  # largest magnitudes whose fp16 scales (and Q4_1 mins) stay finite


def extremes(qt: T, rng: np.random.Generator) -> dict[str, np.ndarray]:
    N, K = 4, 96
    mixed = rng.standard_normal((N, K)) * np.logspace(-4, 4, K)  # magnitudes vary along each row
    outlier = rng.standard_normal((N, K)) * 0.01
    outlier[:, 5] = 50.0
    out = {
        "zeros": np.zeros((N, K)),
        "constant": np.full((N, K), 0.7),
        "constant-negative": np.full((N, K), -3.25),
        "huge": rng.uniform(-HUGE[qt], HUGE[qt], (N, K)),
        "small": rng.standard_normal((N, K)) * 1e-3,
        "subnormal-scales": rng.standard_normal((N, K)) * 1e-4,  # steps ~1e-6..4e-5: fp16 subnormals
        "underflow": rng.standard_normal((N, K)) * 1e-7,  # steps below fp16's smallest subnormal
        "negative-only": -np.abs(rng.standard_normal((N, K))) - 0.5,
        "positive-only": np.abs(rng.standard_normal((N, K))) + 2.0,
        "mixed-magnitudes": mixed,
        "one-outlier": outlier,
        "zeros-and-one": np.eye(N, K),
    }
    return {k: v.astype(np.float32) for k, v in out.items()}


@pytest.fixture(scope="module")
def tiny_lossless(tmp_path_factory) -> tuple[GGUFFile, dict[str, np.ndarray]]:
    """One file holding every case; returns it read back, and name → the quantized bytes written."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("relayout") / "lossless.gguf"
    w = GGUFWriter(path, "llama")
    written = {}
    for qt in LOSSLESS:
        cases = {f"random-{N}x{K}": (rng.standard_normal((N, K)) * rng.uniform(0.01, 10)).astype(np.float32)
                 for N, K in SHAPES}
        cases |= extremes(qt, rng)
        for case, x in cases.items():
            name = f"{qt.name}.{case}"
            q = quants.quantize(x, qt)
            w.add_tensor(name, q, raw_dtype=qt)
            written[name] = q
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path), written


def test_tiny_file_covers_every_case(tiny_lossless):
    f, written = tiny_lossless
    assert [t.name for t in f.tensors] == list(written)
    assert {t.tensor_type for t in f.tensors} == set(LOSSLESS)


@pytest.mark.parametrize("qt", list(LOSSLESS), ids=lambda q: q.name)
def test_tiny_lossless(tiny_lossless, qt):
    f, written = tiny_lossless
    tensors = [t for t in f.tensors if t.tensor_type == qt]
    assert len(tensors) == len(SHAPES) + 12
    for t in tensors:
        assert np.array_equal(t.data, written[t.name].reshape(-1)), t.name  # the file holds what was written
        N, K = matrix_of(t)
        assert_lossless(t, load_matrix(t.data, qt, N, K, None))
        # An explicit target equal to the lossless layout takes the same path.
        again = load_matrix(t.data, qt, N, K, parse_weights(LOSSLESS[qt]))
        assert torch.equal(again.dequantize(), reference(t.data, qt, N, K)), t.name


@pytest.mark.parametrize("qt", list(LOSSLESS), ids=lambda q: q.name)
def test_extremes_are_what_they_should_be(tiny_lossless, qt):
    """Sanity of the oracle on the edge cases (not only 'lowbit equals gguf')."""
    f, _ = tiny_lossless
    by_name = {t.name: t for t in f.tensors}

    def deq(case):
        t = by_name[f"{qt.name}.{case}"]
        return load_matrix(t.data, qt, *matrix_of(t), None).dequantize()

    assert torch.equal(deq("zeros"), torch.zeros(4, 96))
    assert torch.isfinite(deq("huge")).all() and deq("huge").abs().max() > HUGE[qt] / 2
    assert (deq("negative-only") <= 0).all()
    assert torch.allclose(deq("constant-negative"), torch.full((4, 96), -3.25), rtol=1e-3)


@pytest.mark.parametrize("qt", list(LOSSLESS), ids=lambda q: q.name)
def test_relayout_copies_out_of_the_file_map(tiny_lossless, qt):
    """A layout must own its bytes: the file is mapped read-only (torch warns, and a write would crash)."""
    f, _ = tiny_lossless
    for t in (t for t in f.tensors if t.tensor_type == qt):
        w = load_matrix(t.data, qt, *matrix_of(t), None)
        lo = t.data.ctypes.data
        for name, v in vars(w).items():
            if isinstance(v, torch.Tensor):
                assert not lo <= v.data_ptr() < lo + t.n_bytes, f"{t.name}: {name} aliases the file map"


# ---- floats stay floats ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_floats(tmp_path_factory) -> GGUFFile:
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("floats") / "floats.gguf"
    w = GGUFWriter(path, "llama")
    x = (rng.standard_normal((5, 96)) * 3).astype(np.float32)
    x[0, :4] = [1e-30, -65504.0, 3e38, 0.0]  # subnormal in f16/bf16, f16 max, beyond f16 (inf), zero
    w.add_tensor("f32", x)
    with np.errstate(over="ignore"):  # 3e38 → inf on purpose
        w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("bf16", quants.quantize(x, T.BF16), raw_dtype=T.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


@pytest.mark.parametrize("name, qt, dtype", [("f32", T.F32, torch.float32), ("f16", T.F16, torch.float16),
                                             ("bf16", T.BF16, torch.bfloat16)])
def test_floats_stay_float_and_exact(tiny_floats, name, qt, dtype):
    t = next(t for t in tiny_floats.tensors if t.name == name)
    assert t.tensor_type == qt
    N, K = matrix_of(t)
    w = load_matrix(t.data, qt, N, K, None)
    assert isinstance(w, FloatWeight) and w.weight.dtype == dtype and w.spec.name == name
    assert w.nbytes == t.n_bytes
    ref = reference(t.data, qt, N, K)
    got = w.dequantize()
    assert got.dtype == torch.float32
    assert torch.equal(got, ref), f"{name}: float weights changed on load"


# ---- requantized types -------------------------------------------------------------------------

def _f16_bytes(v: float, n: int) -> np.ndarray:
    return np.full((n, 1), v, np.float16).view(np.uint8).reshape(n, 2)


def kquant_bytes(qt: T, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random, valid super-blocks (gguf.quants cannot quantize K-quants: NotImplementedError), with
    finite fp16 super-scales set here; every other byte is random."""
    block, size = GGML_QUANT_SIZES[qt]
    n = N * K // block
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if qt in (T.Q4_K, T.Q5_K):  # d, dmin, scales[12], (qh[32]), qs[128]
        b[:, 0:2] = _f16_bytes(0.01, n)
        b[:, 2:4] = _f16_bytes(0.004, n)
    elif qt == T.Q6_K:  # ql[128], qh[64], scales[16] int8, d
        b[:, 208:210] = _f16_bytes(0.002, n)
    return b.reshape(N, K // block * size)


@pytest.fixture(scope="module")
def tiny_requantized(tmp_path_factory) -> GGUFFile:
    rng = np.random.default_rng(2)
    path = tmp_path_factory.mktemp("requant") / "requant.gguf"
    w = GGUFWriter(path, "llama")
    for qt in REQUANTIZED:
        for N, K in ((1, 256), (5, 512)):
            if qt in (T.Q5_0, T.Q5_1):
                raw = quants.quantize((rng.standard_normal((N, K)) * 0.5).astype(np.float32), qt)
            else:
                raw = kquant_bytes(qt, N, K, rng)
            w.add_tensor(f"{qt.name}.{N}x{K}", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


@pytest.mark.parametrize("qt", list(REQUANTIZED), ids=lambda q: q.name)
def test_requantized_within_bound(tiny_requantized, qt):
    tensors = [t for t in tiny_requantized.tensors if t.tensor_type == qt]
    assert len(tensors) == 2
    spec = parse_weights(REQUANTIZED[qt])
    for t in tensors:
        N, K = matrix_of(t)
        ref = reference(t.data, qt, N, K)
        assert torch.isfinite(ref).all() and ref.abs().max() > 0
        w = load_matrix(t.data, qt, N, K, spec)
        assert w.spec == spec, f"{t.name}: layout {w.spec.name}, expected {spec.name}"
        got = w.dequantize()
        # Deterministic: exactly lowbit's own quantization of gguf's dequantized values.
        assert torch.equal(got, quantize_weight(ref, spec).dequantize()), t.name
        err = (got - ref).abs().view(N, K // 32, 32)  # [N, G, 32]
        r = ref.view(N, K // 32, 32)
        scale = w.scales.float()
        if spec.bits == 8:
            # round to nearest: half a step, plus the clamp at ±127 when the fp16 scale rounded down
            bound = 0.5 * scale + 2**-10 * r.abs().amax(-1)
        else:
            # half a step, plus the fp16 rounding of the min and of the step (15 steps)
            bound = 0.5 * scale + 2**-10 * (r.abs().amax(-1) + (r.amax(-1) - r.amin(-1)))
        worst = (err.amax(-1) - bound).max()
        assert worst <= 1e-7, f"{t.name}: a group's error exceeds its bound by {worst}"
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < (0.01 if spec.bits == 8 else 0.12), f"{t.name}: relative error {rel:.4f}"


def test_requantize_error_is_real(tiny_requantized):
    """The bound test would pass vacuously if nothing were rounded; int4 of 6-bit data must lose something."""
    t = next(t for t in tiny_requantized.tensors if t.tensor_type == T.Q4_K and t.shape[1] == 5)
    N, K = matrix_of(t)
    ref = reference(t.data, t.tensor_type, N, K)
    assert not torch.equal(load_matrix(t.data, t.tensor_type, N, K, parse_weights("int4-g32")).dequantize(), ref)
