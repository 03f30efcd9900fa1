"""Tiny random HF checkpoints (Llama, Llama 3 rope scaling, Mistral sliding window, Qwen2 biases)
loaded by runtime/load/safetensors.py and run by models/llama.py, against `transformers` in fp32.

Every model: 2 layers, dim 96, 4 heads / 2 KV heads (head_dim 24), hidden 256, vocab 300; saved in
fp32 with save_pretrained(safe_serialization=True). dim 96 is not a multiple of 64 or 128, so g128
layouts run with a partial last group. HF's init (std 0.02, unit norms, zero biases) gives
near-uniform logits and zero biases, against which no loader bug shows; `randomize` gives every
parameter a real value instead (norms 1 ± 0.2, biases ~0.5, unit-gain projections, logits with
std ≈ 3, mean next-token entropy 2.0-2.6 nats of a possible 5.7).

Each run covers the whole 2 x 40 batch in one pass, and prefill 20 → chunk of 8 → 12 single-token
decode steps through the KV cache. Metrics: KL(transformers ‖ lowbit) of the next-token
distribution at each of the 80 positions (nats): mean, max; and top-1 agreement. Two references:

  quality  transformers on the original fp32 weights: what the format costs on this model.
  impl     transformers on the same weights quantized→dequantized by lowbit.quant, mapped by HF
           parameter name (not through the loader): what is left is the runtime's own arithmetic,
           bf16 activations into the CPU int4/int8/bf16 matmuls (u = 2^-8) and bf16 int4 scales.

Bounds, and the worst value measured over the four models, full and incremental runs
(transformers 5.24, torch 2.13 CPU):

  format     quality: mean KL / max KL / top-1        impl: mean KL / max KL / top-1
             bound                measured            bound (all formats)  measured
  f32        max |Δlogit| ≤ 1e-4 · max |logit|; measured 8.0e-7 (fp32 summation order only)
  bf16       1.5e-3 / 1e-2 / 0.90  5.0e-4/3.5e-3/0.975  2e-3 / 2e-2 / 0.90    3.1e-4/1.2e-3/0.988
  int8       6e-3 / 4e-2 / 0.85    2.6e-3/1.6e-2/0.925  "                     4.2e-4/1.7e-3/0.963
  int8-g32   6e-3 / 4e-2 / 0.85    2.3e-3/7.4e-3/0.912  "                     3.9e-4/1.9e-3/0.963
  int4-g32   0.35 / 2.0 / 0.50     0.22 / 0.98 / 0.637  "                     4.6e-4/4.5e-3/0.988
  int4-g128  0.5 / 3.5 / 0.50      0.33 / 2.27 / 0.625  "                     4.1e-4/1.6e-3/0.963

Why these numbers. impl: bf16 activation rounding is the floor; it is the same ~3e-4 for every
format (the bf16 run shows it alone), so one bound serves all: ~4x the worst mean and max. quality:
bf16/int8 ~2.5x the worst, for kernel and BLAS variation. int4: every weight value comes from this
file's generator and quantization is deterministic, so only the impl-level noise (~5e-4) moves these;
1.5x covers it. The int4 KLs are large because this random, outlier-free 2-layer model amplifies
weight noise (~8% per matmul for Gaussian weights at 4 bits) — they describe this model, not real
checkpoints. Top-1 bounds are loose: near-ties in a random model flip (each flip is 1/80).

Checked by breaking the loader on purpose (mean KL of int4-g128 impl / quality where it applies):
dropping Q/K/V biases (qwen2: 4.6 / 4.7), swapping gate/up (1.1-2.4), swapping the two norms
(0.8-1.8), swapping K/V (5-6), ignoring llama3 rope scaling (0.77 / 0.91), ignoring the sliding
window (mistral: 1.4 / 1.6), applying the GGUF Q/K row permutation (0.84-2.1), int4 embedding
(0.11-0.18 impl; quality alone misses it), bf16-rounding fp32 sources before quantizing (0.022-0.034
impl). Each failed the test of every model and format it changes: the f32 test and every quantized
format for the structural breaks; the int4 formats for the int4 embedding; f32 and int4 for the
bf16 rounding (int8 and bf16 are themselves within bf16 of it).
"""

from __future__ import annotations

import copy
import importlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.models.llama import Llama
from lowbit.quant import parse_weights, quantize_weight
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.safetensors import load_hf_dir
from tests.helpers import Sequences, forward

transformers = importlib.import_module("transformers")

B, T = 2, 40  # batch of 2 random sequences of 40 tokens
SMALL = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)
MODELS = {
    # name: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    # original_max_position_embeddings 32 (not 8192) so that over 40 tokens the scaled (wavelength
    # > 32) and blended (8..32) frequencies do real work: ignoring the scaling changes the logits.
    "llama3-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32))),
    # window 16 < 40 tokens: the mask path (prefill and decode past the window) is exercised.
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=16)),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}

# Quality, against the fp32 model: format → (mean KL ≤, max KL ≤, top-1 ≥). See the table above.
QUALITY_BOUNDS = {
    "bf16": (1.5e-3, 1e-2, 0.90),
    "int8": (6e-3, 4e-2, 0.85),
    "int8-g32": (6e-3, 4e-2, 0.85),
    "int4-g32": (0.35, 2.0, 0.50),
    "int4-g128": (0.5, 3.5, 0.50),
}
# Implementation, against transformers running the same dequantized weights in fp32 (every format):
# what is left is bf16 rounding of the matmul activations (and of int4 scales in the CPU kernel).
IMPL_BOUNDS = (2e-3, 2e-2, 0.90)
# fp32 against fp32: the only differences are summation order (sdpa vs our attention, fused QKV) and
# HF computing rotary angles in fp32 where we use fp64 (position·inv_freq: 40 · 2^-24 relative).
# Measured ≤ 7.3e-7 of the largest logit; 1e-4 leaves >100x for other BLAS builds and is still far
# below any real bug (a missing bias or swapped projection moves logits by O(1)).
F32_RTOL = 1e-4
LOGIT_STD = 3.0  # logits of a real small LM have std ≈ 2-4 and entropy ≈ 2-3 nats


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Real-valued everything (see the module docstring); tied tables are one parameter, set once.
    Every value comes from this generator, so the test does not depend on transformers' init."""
    g = torch.Generator().manual_seed(seed)
    dim = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(LOGIT_STD / math.sqrt(dim) * torch.randn(p.shape, generator=g))
            else:  # [N, K] projections: unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def _build(name: str, seed: int = 0):
    cfg_cls, model_cls, extra = MODELS[name]
    config = getattr(transformers, cfg_cls)(**SMALL, **extra)
    model = getattr(transformers, model_cls)(config).float().eval()
    randomize(model, seed)
    return model


def _fake_quant(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """A copy of the HF model whose matrices hold quantize→dequantize of themselves, mapped by HF
    parameter name (not through the loader, so a loader mix-up is not copied into the reference);
    embedding/LM head int8-g32 for quantized formats, as the loader's policy says."""
    spec = parse_weights(fmt)
    head = parse_weights("int8-g32") if spec.quantized else spec
    fq = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in fq.named_parameters():
            if p.dim() == 2:
                s = head if ("embed_tokens" in name or "lm_head" in name) else spec
                p.copy_(quantize_weight(p.detach(), s).dequantize())
    return fq


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These matrices are tiny (≤ 300 x 256): a second intra-op thread buys nothing, and on a shared
    2-core machine every parallel region can wait a whole scheduler slice for a descheduled thread
    (measured: 8 ms per torch._weight_int8pack_mm call with 2 threads under load, 5 µs with 1 —
    this file went from 45-75 s to a few seconds)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    """(name, directory, HF model, token ids [B, T], HF logits [B, T, V] fp32) for one tiny model."""
    name = request.param
    model = _build(name, seed=list(MODELS).index(name))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.float()
    return name, path, model, ids, ref


def _run(path: Path, fmt: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, T, V] two ways: the whole sequence in one pass; and prefill of 20 tokens, one chunk
    of 8 at start 20, then 12 single-token decode steps through the KV cache, concatenated."""
    config, weights, _ = load_hf_dir(path, parse_weights(fmt))
    model = Llama(config, weights)
    with torch.no_grad():
        full = forward(model, ids)
        seqs = Sequences(model, ids.shape[0], T)
        steps = [seqs.step(ids[:, :20]), seqs.step(ids[:, 20:28])]
        steps += [seqs.step(ids[:, t:t + 1]) for t in range(28, T)]
    return full, torch.cat(steps, dim=1)


def kl_stats(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, float]:
    """(mean KL, max KL, top-1 agreement) of softmax(got) against softmax(ref), over all positions."""
    lp_ref = torch.log_softmax(ref.double(), dim=-1)
    lp = torch.log_softmax(got.double(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).flatten()
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean()
    return kl.mean().item(), kl.max().item(), top1.item()


def _check(stats: tuple[float, float, float], bounds: tuple[float, float, float], what: str) -> None:
    (mean_kl, max_kl, top1), (mean_b, max_b, top1_b) = stats, bounds
    assert mean_kl <= mean_b and max_kl <= max_b and top1 >= top1_b, (
        f"{what}: mean KL {mean_kl:.3g} (≤ {mean_b}), max KL {max_kl:.3g} (≤ {max_b}), top-1 {top1:.3f} (≥ {top1_b})")


# ---- logits against transformers ---------------------------------------------------------------

def test_f32_matches_transformers(checkpoint):
    name, path, _, ids, ref = checkpoint
    for how, got in zip(("full", "prefill+decode"), _run(path, "f32", ids)):
        assert got.shape == ref.shape and got.dtype == torch.float32
        err = (got - ref).abs().max().item()
        assert err <= F32_RTOL * ref.abs().max().item(), f"{name} {how}: max |Δlogit| {err:.3g}"


@pytest.mark.parametrize("fmt", list(QUALITY_BOUNDS))
def test_quantized_within_bounds(checkpoint, fmt):
    name, path, model, ids, ref = checkpoint
    with torch.no_grad():
        fq_ref = _fake_quant(model, fmt)(ids).logits.float()
    for how, got in zip(("full", "prefill+decode"), _run(path, fmt, ids)):
        _check(kl_stats(fq_ref, got), IMPL_BOUNDS, f"{name} {fmt} {how} vs transformers on the same dequantized weights")
        _check(kl_stats(ref, got), QUALITY_BOUNDS[fmt], f"{name} {fmt} {how} vs transformers fp32")


def test_reference_is_not_uniform(checkpoint):
    """The bounds only mean something if the reference distribution is peaked: a model with
    near-uniform logits would pass any KL bound whatever the loader did."""
    _, _, _, _, ref = checkpoint
    lp = torch.log_softmax(ref.double(), -1)
    entropy = -(lp.exp() * lp).sum(-1).mean().item()
    assert entropy < 0.6 * math.log(SMALL["vocab_size"]), entropy


# ---- loader behaviour --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    model = _build("qwen2-tied", seed=7)
    path = tmp_path_factory.mktemp("qwen_small")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_layout_and_progress(qwen_dir):
    path, model = qwen_dir
    calls = []
    config, weights, cfg = load_hf_dir(path, parse_weights("int4-g32"), progress=calls.append)
    assert calls == [1, 2]  # once per layer, 1-based like the GGUF loader
    assert cfg["model_type"] == "qwen2" and config.qkv_bias and config.tie_embeddings
    assert "output" not in weights  # tied: the model reads the embedding table
    assert weights["embed"].spec.name == "int8-g32"  # quantized target → int8-g32 embedding/head
    assert weights["layers.0.wq"].spec.name == "int4-g32"
    for n in ("bq", "bk", "bv", "attn_norm", "ffn_norm"):
        assert weights[f"layers.1.{n}"].dtype == torch.float32
    hf = dict(model.named_parameters())
    assert torch.equal(weights["layers.1.bk"], hf["model.layers.1.self_attn.k_proj.bias"])
    # float target: every matrix in that dtype, embedding included
    _, w16, _ = load_hf_dir(path, parse_weights("bf16"))
    assert w16["embed"].weight.dtype == torch.bfloat16 and w16["layers.0.w_up"].weight.dtype == torch.bfloat16
    assert torch.equal(w16["layers.0.w_up"].weight, hf["model.layers.0.mlp.up_proj.weight"].bfloat16())


def test_sharded_and_bf16_checkpoint(tmp_path):
    """A sharded checkpoint (index.json) saved in bf16 loads the same tensors as the model holds,
    and its bf16 tensors reach the quantizer without an fp32 detour changing anything."""
    model = _build("llama", seed=3).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    config, weights, _ = load_hf_dir(tmp_path, parse_weights("f32"))
    hf = dict(model.named_parameters())
    assert torch.equal(weights["output"].weight, hf["lm_head.weight"].float())
    assert torch.equal(weights["layers.1.w_down"].weight, hf["model.layers.1.mlp.down_proj.weight"].float())
    assert torch.equal(weights["norm"], hf["model.norm.weight"].float())
    _, w4, _ = load_hf_dir(tmp_path, parse_weights("int4-g64"))
    expect = quantize_weight(hf["model.layers.0.self_attn.q_proj.weight"].detach(), parse_weights("int4-g64"))
    assert torch.equal(w4["layers.0.wq"].qweight, expect.qweight) and torch.equal(w4["layers.0.wq"].scales, expect.scales)


def copy_checkpoint(src: Path, dst: Path, edit=None, cfg_edit=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_errors_name_the_problem(qwen_dir, tmp_path):
    path, _ = qwen_dir
    spec = parse_weights("int4-g32")

    bad = copy_checkpoint(path, tmp_path / "missing", edit=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LowbitError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_dir(bad, spec)

    bad = copy_checkpoint(path, tmp_path / "nobias", edit=lambda t: t.pop("model.layers.0.self_attn.v_proj.bias"))
    with pytest.raises(LowbitError, match=r"v_proj\.bias"):
        load_hf_dir(bad, spec)

    def reshape(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:24].clone()
    bad = copy_checkpoint(path, tmp_path / "shape", edit=reshape)
    with pytest.raises(LowbitError, match=r"k_proj\.weight has shape \[24, 96\].*\[48, 96\]"):
        load_hf_dir(bad, spec)

    def extra(t):
        t["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(96)
    bad = copy_checkpoint(path, tmp_path / "extra", edit=extra)
    with pytest.raises(LowbitError, match=r"o_proj\.bias"):
        load_hf_dir(bad, spec)

    bad = copy_checkpoint(path, tmp_path / "arch", cfg_edit=lambda c: c.update(model_type="gpt2"))
    with pytest.raises(LowbitError, match=r"unknown model_type .gpt2. in config\.json"):
        load_hf_dir(bad, spec)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(LowbitError, match=r"no \*\.safetensors files"):
        load_hf_dir(empty, spec)
    with pytest.raises(LowbitError, match=r"no config\.json"):
        load_hf_dir(tmp_path, spec)  # a directory, but not a checkpoint


if __name__ == "__main__":  # print the measured values (python tests/test_safetensors_models.py)
    import tempfile
    torch.set_num_threads(1)
    ids = torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1))
    for name in MODELS:
        model = _build(name, seed=list(MODELS).index(name))
        with tempfile.TemporaryDirectory() as d, torch.no_grad():
            model.save_pretrained(d, safe_serialization=True)
            ref = model(ids).logits.float()
            lp = torch.log_softmax(ref.double(), -1)
            full, inc = _run(Path(d), "f32", ids)
            rel = max((x - ref).abs().max().item() for x in (full, inc)) / ref.abs().max().item()
            print(f"{name}: entropy {-(lp.exp() * lp).sum(-1).mean().item():.2f} nats, "
                  f"logit std {ref.std().item():.2f}, f32 max |Δ|/max|logit| {rel:.2e}")
            for fmt in QUALITY_BOUNDS:
                fq_ref = _fake_quant(model, fmt)(ids).logits.float()
                for how, got in zip(("full", "incr"), _run(Path(d), fmt, ids)):
                    q, i = kl_stats(ref, got), kl_stats(fq_ref, got)
                    print(f"  {fmt:10s} {how:5s} vs fp32 {q[0]:.2e} / {q[1]:.2e} / {q[2]:.3f}"
                          f"   vs dequantized {i[0]:.2e} / {i[1]:.2e} / {i[2]:.3f}")
