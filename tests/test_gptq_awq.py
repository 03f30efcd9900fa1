"""Pre-quantized 4-bit GPTQ and AWQ checkpoints (quant/gptq.py, runtime/load/safetensors.py).

The checkpoints are built here from the formats' published packing rules — AutoGPTQ's pack loop
(`qweight[k // 8] |= q[k] << 4 (k % 8)`, zeros along N, v1 storing z - 1) and AutoAWQ's GEMM pack
(`qweight[:, c] |= q[:, 8c + order[i]] << 4i`, order [0, 2, 4, 6, 1, 3, 5, 7]) — by this file's own
numpy packer, not by the loader's unpacker, from a tiny random model: 2 layers, dim 128, 4 heads / 2 KV
heads (head_dim 32), hidden 256, vocab 300 (every K a multiple of 128, so g128 has whole groups), its
float tensors rounded to fp16 as real checkpoints store them. The codes come from round-to-nearest with
a scale and zero per group; a few zeros are then forced to the ends of their range (0 and 15; 1 and 15
for v1, which cannot store 0) so that every nibble value is exercised.

(a) every loaded matrix dequantizes to s * (q - z), bit for bit, for GPTQ sym / asym (v1 and v2) /
    act-order (shuffled g_idx, sym and asym) and AWQ, at groups 32, 64, 128 (and -1 for GPTQ sym);
(b) greedy replies (3 prompts x 16 tokens, prompts exact and decode on the fast kernels, as the engine
    runs them) equal those of the same dequantized weights loaded as an fp32 model and those of
    transformers on them, and the exact path's logits match transformers' to fp32 rounding;
(d) the symmetric GPTQ case is held at no more than the file's quantized bytes;
(e) one-line errors for what cannot be read exactly.

(c), a reference reader from PyPI, is not a test here: none installs on CPU beside this torch.
auto-gptq 0.7.1 is a CUDA wheel pinned to old torch/transformers, autoawq 0.2.9 needs its CUDA kernels
package, gptqmodel 7.7.0 is an sdist that compiles its kernels at install, and transformers' own
GPTQ/AWQ loading needs optimum + gptqmodel. Checked once by hand instead (pip download --no-deps, the
pure-torch files loaded by path): AutoGPTQ 0.7.1's own QuantLinear.pack (qlinear_cuda.py) gives the
same qweight/qzeros words as this file's packer, and its torch dequantizing forward — and AutoAWQ
0.2.9's dequantize_gemm for the AWQ files — equal lowbit's dequantized weights rounded to fp16 (they
compute in fp16), for 182 of 182 matrices (sym, asym, act-order, AWQ; g32/64/128, -1). Here, the
known-answer words of test_known_words are worked out by hand from the same rules.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.kernels.cpu_block import _linear
from lowbit.models.backend import torch_backend
from lowbit.models.llama import Llama
from lowbit.quant import Int4Weight, Int8Weight, parse_weights, quantize_weight
from lowbit.quant.gptq import AWQSpec, GPTQSpec, PermutedWeight, dequantize, to_lowbit
from lowbit.quant.linear import QuantLinear, cpu_kernels, fuse_rows
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.safetensors import load_hf_dir
from tests.helpers import Sequences, forward
from tests.test_safetensors_models import copy_checkpoint, randomize

transformers = importlib.import_module("transformers")

SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the input each projection reads: act-order sorts columns by the Hessian of that input, so projections
# reading the same input (q/k/v, gate/up) share one g_idx
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
            "up_proj": "mlp", "down_proj": "down"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# name: (method, sym, act-order, v1 zeros)
FORMATS = {
    "gptq-sym": ("gptq", True, False, True),
    "gptq-asym": ("gptq", False, False, True),
    "gptq-v2-asym": ("gptq", False, False, False),
    "gptq-desc-sym": ("gptq", True, True, True),
    "gptq-desc-asym": ("gptq", False, True, False),
    "awq": ("awq", False, False, False),
}
GROUPS = (32, 64, 128)
F32_RTOL = 1e-4  # as tests/test_safetensors_models.py: fp32 summation order only (measured ~1e-6 here)
PROMPTS = ([5, 17, 42, 99, 3], [250, 1, 1, 7, 64, 128, 200], [33])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: a second intra-op thread buys nothing (see tests/test_safetensors_models.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the formats, from their published rules --------------------------------------------------------

def _rtn(w: np.ndarray, g_idx: np.ndarray, sym: bool, v1: bool, rng) -> tuple:
    """w fp32 [N, K], g_idx [K] → (codes uint8 [N, K], zeros int [N, G], scales fp16 [N, G]): round to
    nearest per group (GPTQ's quantizer grid: sym z = 8, asym z = round(-min / s)), then ~6% of the
    zeros forced to the ends of what the format stores and the codes recomputed for them."""
    N, K = w.shape
    G = int(g_idx.max()) + 1
    q, z, s = np.empty((N, K), np.uint8), np.empty((N, G), np.int64), np.empty((N, G), np.float16)
    zlo = 1 if v1 else 0
    for g in range(G):
        cols = np.flatnonzero(g_idx == g)
        wg = w[:, cols]
        if sym:
            sc = np.maximum(2 * np.abs(wg).max(1) / 15, 1e-4).astype(np.float16)
            zz = np.full(N, 8)
        else:
            lo, hi = np.minimum(wg.min(1), 0), np.maximum(wg.max(1), 0)
            sc = np.maximum((hi - lo) / 15, 1e-4).astype(np.float16)
            zz = np.clip(np.round(-lo / sc.astype(np.float32)), zlo, 15).astype(np.int64)
            ends = rng.random(N) < 0.06
            zz[ends] = rng.choice([zlo, 15], size=int(ends.sum()))
        q[:, cols] = np.clip(np.round(wg / sc.astype(np.float32)[:, None]) + zz[:, None], 0, 15)
        z[:, g], s[:, g] = zz, sc
    return q, z, s


def _pack_gptq(q: np.ndarray, z: np.ndarray, v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """codes [N, K], zeros [N, G] → (qweight int32 [K/8, N], qzeros int32 [G, N/8]), AutoGPTQ's rule."""
    qk, zg = q.T.astype(np.uint32), (z.T - (1 if v1 else 0)).astype(np.uint32)  # [K, N], [G, N]
    qweight = np.zeros((qk.shape[0] // 8, qk.shape[1]), np.uint32)
    for i in range(8):
        qweight |= qk[i::8] << (4 * i)  # k = 8 row + i at bits 4i
    qzeros = np.zeros((zg.shape[0], zg.shape[1] // 8), np.uint32)
    for i in range(8):
        qzeros |= zg[:, i::8] << (4 * i)  # n = 8 col + i at bits 4i
    return qweight.view(np.int32), qzeros.view(np.int32)


def _pack_awq(q: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """codes [N, K], zeros [N, G] → (qweight int32 [K, N/8], qzeros int32 [G, N/8]), AutoAWQ's GEMM rule."""
    def pack(a):  # [R, N] → [R, N/8]: nibble i of word c holds column 8c + AWQ_ORDER[i]
        out = np.zeros((a.shape[0], a.shape[1] // 8), np.uint32)
        for i in range(8):
            out |= a[:, AWQ_ORDER[i]::8].astype(np.uint32) << (4 * i)
        return out.view(np.int32)
    return pack(q.T), pack(z.T)


def _hf_model(family: str = "llama", seed: int = 0):
    """A tiny random HF model with real-valued parameters (norms 1 ± 0.2, biases ~0.5, unit-gain
    projections, logits std ≈ 3), every float rounded to fp16 so the file's fp16 tensors are exact."""
    cls, extra = {"llama": ("Llama", dict(tie_word_embeddings=False)),
                  "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True))}[family]
    config = getattr(transformers, f"{cls}Config")(**SMALL, **extra)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).float().eval()
    randomize(model, seed)  # tests/test_safetensors_models.py's values
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def _quant_config(fmt: str, group: int) -> dict:
    method, sym, desc, v1 = FORMATS[fmt]
    if method == "awq":
        return dict(quant_method="awq", bits=4, group_size=group, version="gemm", zero_point=True,
                    modules_to_not_convert=None)
    return dict(quant_method="gptq", bits=4, group_size=group, desc_act=desc, sym=sym,
                checkpoint_format="gptq" if v1 else "gptq_v2")


def write_checkpoint(model, path: Path, fmt: str, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The HF model as a `fmt` checkpoint in `path` → the reference weights s * (q - z), fp32 [N, K], by
    HF parameter name (computed here, from the codes before packing)."""
    method, sym, desc, v1 = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    tensors, ref, g_idx_of = {}, {}, {}
    for name, t in model.state_dict().items():
        module = name.removesuffix(".weight")
        proj = module.rsplit(".", 1)[-1]
        if not (name.endswith(".weight") and proj in PROJ):
            tensors[name] = t.half().contiguous()  # embeddings, norms, LM head, biases: fp16 as stored
            continue
        w = t.float().numpy()
        N, K = w.shape
        g = K if group == -1 else group
        key = (module.rsplit(".", 2)[0], INPUT_OF[proj])  # one act-order per layer input
        if key not in g_idx_of:
            g_idx = np.arange(K) // g
            if desc:
                g_idx = np.empty(K, np.int64)
                g_idx[rng.permutation(K)] = np.arange(K) // g  # group i // g to the i-th column in act order
            g_idx_of[key] = g_idx
        g_idx = g_idx_of[key]
        q, z, s = _rtn(w, g_idx, sym, v1, rng)
        qweight, qzeros = _pack_gptq(q, z, v1) if method == "gptq" else _pack_awq(q, z)
        tensors[module + ".qweight"] = torch.from_numpy(qweight)
        tensors[module + ".qzeros"] = torch.from_numpy(qzeros)
        tensors[module + ".scales"] = torch.from_numpy(np.ascontiguousarray(s.T))  # fp16 [G, N]
        if method == "gptq":
            tensors[module + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        ref[name] = torch.from_numpy(s.astype(np.float32)[:, g_idx] * (q.astype(np.float32) - z[:, g_idx]))
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    cfg = model.config.to_dict()
    cfg["quantization_config"] = _quant_config(fmt, group)
    (path / "config.json").write_text(json.dumps(cfg))
    return ref


def _dequantized_model(model, ref: dict[str, torch.Tensor]):
    """The HF model with its projections replaced by the reference dequantized weights, and its
    embedding / LM head by their int8-g32 dequantization: the loader's policy for those (unquantized in
    the file) under a quantized target, as for any checkpoint (runtime/load/safetensors.py)."""
    out = copy.deepcopy(model)
    head = parse_weights("int8-g32")
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name in ref:
                p.copy_(ref[name])
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(quantize_weight(p.detach(), head).dequantize())
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(fmt, group, family) → (checkpoint dir, HF model, reference weights), built once each."""
    cache = {}

    def get(fmt: str, group: int, family: str = "llama"):
        if (fmt, group, family) not in cache:
            model = _hf_model(family, seed=len(cache))
            path = tmp_path_factory.mktemp(f"{fmt}-g{group}-{family}")
            cache[fmt, group, family] = path, model, write_checkpoint(model, path, fmt, group, seed=len(cache))
        return cache[fmt, group, family]
    return get


def _lowbit_name(hf_name: str) -> str:
    """model.layers.1.self_attn.q_proj.weight → layers.1.wq."""
    parts = hf_name.split(".")
    short = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
             "up_proj": "w_up", "down_proj": "w_down"}[parts[-2]]
    return f"layers.{parts[2]}.{short}"


# ---- (a) exact dequantization ------------------------------------------------------------------------

def test_known_words():
    """Hand-worked words. GPTQ qweight 0x76543210 in column n: codes k = 0..7 are 0, 1, .., 7 (code k
    at bits 4k); v1 qzeros 0x77777777: zero 8 for all 8 columns (stored z - 1). AWQ 0x76543210:
    nibble i holds column AWQ_ORDER[i], so columns 0..7 read 0, 4, 1, 5, 2, 6, 3, 7 (AWQ_REVERSE_ORDER)."""
    word, ones = torch.tensor([[0x76543210]], dtype=torch.int32), torch.ones(1, 8, dtype=torch.float16)
    v1, v2 = GPTQSpec(-1, False, True, True), GPTQSpec(-1, False, False, False)
    u = v1.unpack(word.repeat(1, 8), torch.tensor([[0x77777777]], dtype=torch.int32), ones)
    assert u.codes.tolist() == [list(range(8))] * 8 and u.zeros.flatten().tolist() == [8] * 8
    assert v2.unpack(word.repeat(1, 8), word, ones).zeros.flatten().tolist() == list(range(8))
    # the top nibble of a word with its sign bit set: 0xF0000000 is -268435456 as int32
    top = v2.unpack(torch.full((1, 8), -0x10000000, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), ones)
    assert top.codes[:, 7].tolist() == [15] * 8 and top.codes[:, :7].sum() == 0
    awq = AWQSpec(-1).unpack(torch.full((8, 1), 0x76543210, dtype=torch.int32), word, ones)
    assert awq.codes[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7] == awq.zeros[:, 0].tolist()


CASES = [(f, g) for f in FORMATS for g in GROUPS] + [("gptq-sym", -1), ("gptq-desc-asym", -1)]


@pytest.mark.parametrize("fmt, group", CASES)
def test_dequantized_weights_are_exact(built, fmt, group):
    path, _, ref = built(fmt, group)
    method, sym, desc, _ = FORMATS[fmt]
    _, weights, _ = load_hf_dir(path, parse_weights("int4-g32"))
    lg = 128 if group == -1 else group  # one group a row: held in groups of 128 with the row's scale
    for name, want in ref.items():
        w = weights[_lowbit_name(name)]
        if desc and 0 < group < want.shape[1]:  # act-order over 2+ groups: columns held in group order,
            # the input permuted (one group: any order is that group, nothing to permute)
            assert isinstance(w, PermutedWeight) and not torch.equal(w.in_perm, torch.arange(want.shape[1]))
            inner = w.weight
        else:
            inner = w
        assert isinstance(inner, Int4Weight if sym else Int8Weight), (name, type(inner))
        assert inner.spec.name == (f"int4-sym-g{lg}" if sym else f"int8-g{lg}")
        assert torch.equal(w.dequantize(), want), name
    # the format's own reference function, on one matrix
    spec = GPTQSpec(group, desc, sym, FORMATS[fmt][3]) if method == "gptq" else AWQSpec(group)
    t = load_file(path / "model.safetensors")
    mod = "model.layers.1.mlp.down_proj"
    u = spec.unpack(*[t[f"{mod}.{s}"] for s in spec.tensors(128, 256)])
    assert torch.equal(dequantize(u), ref[mod + ".weight"])
    assert torch.equal(to_lowbit(u).dequantize(), ref[mod + ".weight"])
    # unquantized tensors load as from any checkpoint
    assert torch.equal(weights["layers.0.attn_norm"], t["model.layers.0.input_layernorm.weight"].float())
    assert weights["embed"].spec.name == "int8-g32"


def test_f32_target_dequantizes_exactly(built):
    path, _, ref = built("gptq-desc-asym", 32)
    _, weights, _ = load_hf_dir(path, parse_weights("f32"))
    for name, want in ref.items():
        assert torch.equal(weights[_lowbit_name(name)].weight, want)


# ---- (b) greedy replies and logits -----------------------------------------------------------------

def _greedy(model, prompt: list[int], n: int = 16) -> list[int]:
    """Greedy tokens as the engine computes them: the prompt exactly, each generated token on the
    backend's fast path (CPU: the C kernels' 16-bit activation codes)."""
    seqs = Sequences(model, 1, len(prompt) + n)
    logits, out = seqs.step(torch.tensor([prompt]), exact=True), []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = seqs.step(torch.tensor([[out[-1]]]))
    return out


def _hf_greedy(model, prompt: list[int], n: int = 16) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("fmt, group, family", [
    ("gptq-sym", 128, "llama"), ("gptq-asym", 32, "llama"), ("gptq-desc-sym", 64, "llama"),
    ("gptq-desc-asym", 32, "qwen2-tied"), ("awq", 64, "llama"), ("awq", 128, "qwen2-tied")])
def test_greedy_replies_match_the_fp32_model(built, tmp_path, fmt, group, family):
    path, hf, ref = built(fmt, group, family)
    deq = _dequantized_model(hf, ref)
    deq.save_pretrained(tmp_path, safe_serialization=True)
    config, weights, _ = load_hf_dir(path, parse_weights("int4-g32"))
    model = Llama(config, weights)
    f32 = Llama(*load_hf_dir(tmp_path, parse_weights("f32"))[:2])
    if FORMATS[fmt][2] and torch_backend().native is not None:  # act-order: never the fused C block
        assert model.fused_layers is None and all(layer.fused is None for layer in model.layers)
        assert all(layer.qkv.parts[0].in_perm is not None for layer in model.layers)  # q/k/v fused, one perm
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = deq(ids).logits.float()
    got = forward(model, ids, exact=True)
    err = (got - want).abs().max().item()
    assert err <= F32_RTOL * want.abs().max().item(), f"max |Δlogit| {err:.3g} of {want.abs().max().item():.3g}"
    for prompt in PROMPTS:
        reply = _greedy(model, prompt)
        assert reply == _greedy(f32, prompt) == _hf_greedy(deq, prompt), prompt


# ---- (d) bytes held ---------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [-1, 32, 128])
def test_symmetric_gptq_is_held_at_the_files_size(built, group):
    """int4-sym with the file's scales: 0.5 B a weight + 2 B a group, no zeros and no g_idx, against the
    file's qweight + qzeros + scales + g_idx; the CPU kernels' tile layout adds 32 B per 16 rows where a
    row has an odd number of groups (kernels/int4_mm.py). Measured at g32 / g128 / -1: 0.928 / 0.942 /
    0.946 (held) and 0.928 / 0.964 / 0.968 (tiles) of the file's bytes. (Asymmetric GPTQ and AWQ, held
    in int8: 1.75-1.96x; act-order adds its int64 [K] permutation, 8 B an input column.)"""
    path, _, ref = built("gptq-sym", group)
    t = load_file(path / "model.safetensors")
    packed = ("qweight", "qzeros", "scales", "g_idx")
    file_bytes = sum(v.numel() * v.element_size() for k, v in t.items() if k.endswith(packed))
    config, weights, _ = load_hf_dir(path, parse_weights("int4-g32"))
    held = sum(weights[_lowbit_name(n)].nbytes for n in ref)
    model = Llama(config, weights)
    linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, QuantLinear)]
    tiles = sum(b.numel() * b.element_size() for m in linears for b in m.buffers())
    assert held <= 1.05 * file_bytes and tiles <= 1.05 * file_bytes, (held / file_bytes, tiles / file_bytes)


def test_info_counts_the_checkpoints_dtypes(built):
    """What `lowbit info` lists for a safetensors checkpoint (runtime/cli/models.py prints it as it does a
    GGUF's types): each dtype's tensors and bytes, as safetensors' own loader counts them."""
    from lowbit.runtime.load.safetensors import safetensors_tensor_types

    path, _, _ = built("gptq-sym", 32)
    counts: dict[str, tuple[int, int]] = {}
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32"}
    for v in load_file(path / "model.safetensors").values():
        n, b = counts.get(names[v.dtype], (0, 0))
        counts[names[v.dtype]] = (n + 1, b + v.numel() * v.element_size())
    got = safetensors_tensor_types(path)
    assert got == counts and list(got.values()) == sorted(got.values(), key=lambda nb: -nb[1])


# ---- act-order at run time ----------------------------------------------------------------------------

def _permuted(seed: int, int8: bool) -> tuple[PermutedWeight, torch.Tensor]:
    """A random act-order weight [48, 64] in groups of 32 → (it, its dequantized fp32 [48, 64])."""
    g = torch.Generator().manual_seed(seed)
    K, N = 64, 48
    g_idx = torch.empty(K, dtype=torch.long)
    g_idx[torch.randperm(K, generator=g)] = torch.arange(K) // 32
    from lowbit.quant.gptq import Unpacked
    zeros = torch.randint(0, 16, (N, 2), generator=g, dtype=torch.uint8) if int8 else \
        torch.full((N, 2), 8, dtype=torch.uint8)
    u = Unpacked(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8), zeros,
                 (torch.rand(N, 2, generator=g) * 0.1 + 0.01).half(), g_idx, 32)
    w = to_lowbit(u)
    assert isinstance(w, PermutedWeight)
    return w, dequantize(u)


@pytest.mark.parametrize("int8", [False, True])
def test_permuted_linear_and_fusion(int8):
    (a, wa), (b, _) = _permuted(0, int8), _permuted(1, int8)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    for native in (torch_backend().native, None):  # the C kernels and the plain-torch path
        lin = QuantLinear(a, cpu_kernels(native))
        assert lin.in_perm is not None and _linear(lin.w, None, native) is None  # the C block refuses it
        torch.testing.assert_close(lin(x, exact=True), x @ wa.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(x[:1]), x[:1] @ wa.T, rtol=2e-3, atol=2e-3)  # fast kernel, one row
    same = PermutedWeight(b.weight, a.in_perm)  # another matrix reading the same input order
    fused = fuse_rows([a, same])
    assert isinstance(fused, PermutedWeight) and torch.equal(fused.in_perm, a.in_perm)
    want = torch.cat([x @ wa.T, x[:, a.in_perm] @ b.weight.dequantize().T], 1)
    torch.testing.assert_close(QuantLinear(fused, cpu_kernels(None))(x, exact=True), want, rtol=1e-5, atol=1e-5)
    assert fuse_rows([a, b]) is None  # different input orders: kept apart
    assert fuse_rows([a, a.weight]) is None  # permuted beside plain


@pytest.mark.parametrize("int8", [False, True])
def test_permuted_linear_on_triton(int8):
    from lowbit.kernels.triton_import import HAVE_TRITON, interpreting
    from lowbit.quant.linear import triton_kernels
    if not (HAVE_TRITON and (torch.cuda.is_available() or interpreting())):
        pytest.skip("needs CUDA or Triton's interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w, ref = _permuted(3, int8)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    lin = QuantLinear(w, triton_kernels(torch.device(device)))
    torch.testing.assert_close(lin(x.to(device), exact=True).cpu(), x @ ref.T, rtol=1e-4, atol=1e-4)


# ---- (e) one-line errors ------------------------------------------------------------------------------

def _variant(src: Path, dst: Path, qc_edit=None, edit=None) -> Path:
    """A copy of the checkpoint with its quantization_config and/or tensors edited."""
    return copy_checkpoint(src, dst, edit, None if qc_edit is None else lambda cfg: qc_edit(cfg["quantization_config"]))


def _fails(path: Path, pattern: str, weights: str = "int4-g32") -> None:
    with pytest.raises(LowbitError, match=pattern) as e:
        load_hf_dir(path, parse_weights(weights))
    assert "\n" not in str(e.value)


def test_errors_name_the_problem(built, tmp_path):
    path, _, _ = built("gptq-sym", 64)
    q0 = "model.layers.0.self_attn.q_proj"
    for bits in (8, 3):
        _fails(_variant(path, tmp_path / f"b{bits}", lambda qc, b=bits: qc.update(bits=b)),
               rf"gptq checkpoint with bits={bits}")
    _fails(_variant(path, tmp_path / "g16", lambda qc: qc.update(group_size=16)), r"gptq group_size 16")
    _fails(_variant(path, tmp_path / "g100", lambda qc: qc.update(group_size=100)), r"gptq group_size 100")
    _fails(_variant(path, tmp_path / "g32", lambda qc: qc.update(group_size=32)),
           rf"tensor {q0}\.qzeros has shape \[2, 16\], config\.json implies \[4, 16\]")
    _fails(_variant(path, tmp_path / "noz", edit=lambda t: t.pop(f"{q0}.qzeros")), rf"missing tensor {q0}\.qzeros")
    _fails(_variant(path, tmp_path / "marlin", lambda qc: qc.update(checkpoint_format="marlin")),
           r"checkpoint_format 'marlin'")
    _fails(_variant(path, tmp_path / "bnb", lambda qc: qc.update(quant_method="bitsandbytes")),
           r"pre-quantized checkpoint \(bitsandbytes\) is not supported")
    _fails(path, r"--weights bf16 would round this gptq checkpoint", weights="bf16")

    def float_scales(t):
        t[f"{q0}.scales"] = t[f"{q0}.scales"].float() * (1 + 2**-14)  # not fp16 values any more
    _fails(_variant(path, tmp_path / "f32s", edit=float_scales),
           rf"{q0}: torch\.float32 scales that fp16 does not hold")

    def int64_qweight(t):
        t[f"{q0}.qweight"] = t[f"{q0}.qweight"].long()
    _fails(_variant(path, tmp_path / "i64", edit=int64_qweight), rf"{q0}\.qweight has dtype I64, expected one of I32")

    # GPTQ-for-LLaMa's all-zero biases are accepted (adding 0); a real one on o_proj is not part of Llama
    def bias(value: float):
        return lambda t: t.update({f"{q0}.bias": torch.full((128,), value, dtype=torch.float16)})
    load_hf_dir(_variant(path, tmp_path / "zb", edit=bias(0.0)), parse_weights("int4-g32"))
    _fails(_variant(path, tmp_path / "nzb", edit=bias(1.0)),
           rf"tensor {q0}\.bias is not part of a lowbit llama-family model")

    def zero_point_zero(t):  # a v1 word holding z - 1 = -1 for column 0
        t[f"{q0}.qzeros"][0, 0] = t[f"{q0}.qzeros"][0, 0] | 0xF
    _fails(_variant(path, tmp_path / "v1z0", edit=zero_point_zero), r"qzeros holds a 15 in the v1 'gptq' format")

    desc, _, _ = built("gptq-desc-sym", 64)

    def uneven(t):  # one column moved to another group: 63 and 65 columns
        t[f"{q0}.g_idx"][int((t[f"{q0}.g_idx"] == 0).nonzero()[0])] = 1
    _fails(_variant(desc, tmp_path / "uneven", edit=uneven),
           rf"{q0}: g_idx puts 63\.\.65 input columns in a group, not 64")

    awq, _, _ = built("awq", 64)
    _fails(_variant(awq, tmp_path / "gemv", lambda qc: qc.update(version="gemv")), r"awq version 'gemv'")
    _fails(_variant(awq, tmp_path / "nozp", lambda qc: qc.update(zero_point=False)), r"awq with zero_point false")


def test_modules_not_converted_load_as_float(built, tmp_path):
    """AWQ's modules_to_not_convert: those linears are plain `.weight` tensors, quantized by lowbit as in a
    full-precision checkpoint."""
    path, hf, _ = built("awq", 64)
    down = "model.layers.1.mlp.down_proj"

    def keep(t):
        for s in ("qweight", "qzeros", "scales"):
            t.pop(f"{down}.{s}")
        t[f"{down}.weight"] = hf.state_dict()[f"{down}.weight"].half()
    kept = _variant(path, tmp_path / "keep", lambda qc: qc.update(modules_to_not_convert=["layers.1.mlp.down_proj"]),
                    keep)
    _, weights, _ = load_hf_dir(kept, parse_weights("int4-g32"))
    assert weights["layers.1.w_down"].spec.name == "int4-g32" and weights["layers.0.w_down"].spec.name == "int8-g64"
