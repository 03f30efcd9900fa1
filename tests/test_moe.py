"""Mixture of experts (models/moe.py) beyond what tests/test_families.py checks for every family (the tiny
Qwen3-MoE against transformers at f32, its Q8_0 / Q4_K_M files from llama.cpp's converter and quantizer
against the files dequantized and against llama.cpp):

  - only the chosen experts are read: a decode token calls its k experts and no others, a prompt step
    calls each used expert once, with every token that chose it;
  - a token's row is bit-identical alone, in a prompt, and in any grouping of the step's tokens;
  - transformers 5's stacked expert tensors load as the hub's one-module-per-expert checkpoints do;
  - `lowbit info` and /api/show report total and active parameters and the bytes a token reads;
  - --tp refuses in one line.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowbit.models.llama import Llama
from lowbit.quant import parse_weights
from lowbit.runtime.load.safetensors import load_hf_dir
from tests import llama_cpp_source
from tests.family_models import build, save
from tests.helpers import forward

transformers = importlib.import_module("transformers")

E, K = 8, 2  # tests/family_models.py's tiny Qwen3-MoE: 8 experts, 2 per token


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """The tiny Qwen3-MoE (vocab 320: no tokenizer needed for the safetensors side), its checkpoint, and a
    Q4_K_M GGUF made by llama.cpp's converter and quantizer (the converter wants a real tokenizer: the
    default model's, as tests/test_families.py uses)."""
    d = tmp_path_factory.mktemp("moe")
    model = build("qwen3moe", 320, seed=11)
    model.save_pretrained(d / "hf", safe_serialization=True)
    return model, d


def _calls(lm: Llama) -> tuple[list, list]:
    """Hooks recording, per call of an expert's down projection, (layer, expert, rows)."""
    log, handles = [], []
    for i, layer in enumerate(lm.layers):
        for e, expert in enumerate(layer.moe.experts):
            handles.append(expert.w_down.register_forward_hook(
                lambda m, args, out, i=i, e=e: log.append((i, e, args[0].shape[0]))))
    return log, handles


def test_a_token_reads_only_its_experts_and_a_prompt_each_used_expert_once(moe_gguf):
    from lowbit.runtime.load.loader import load

    lm = load(str(moe_gguf), "auto", progress=False).model
    lm.fused_layers = None  # the per-expert loop, whose calls the hooks see (the C experts, alone or in the fused
    for layer in lm.layers:  # block, read the experts the router names and no others: kernels/cpu_moe.c)
        layer.fused = layer.moe.fused = None
    log, handles = _calls(lm)
    ids = torch.randint(3, lm.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            forward(lm, ids)  # one step of 256 tokens
            prompt = list(log)
            log.clear()
            forward(lm, ids[:, :1])  # one token
            single = list(log)
    finally:
        for h in handles:
            h.remove()
    for i in range(lm.config.n_layers):
        calls = [(e, n) for layer, e, n in prompt if layer == i]
        experts = [e for e, _ in calls]
        assert experts == sorted(set(experts)), f"layer {i}: an expert was read twice in one step: {experts}"
        assert sum(n for _, n in calls) == 256 * K, f"layer {i}: {calls} rows for 256 tokens x {K} experts"
        # random weights: a layer's router may never pick one expert for these tokens (layer 3 here)
        assert len(experts) >= E - 1, f"layer {i}: the prompt used experts {experts} of {E}: the test checks less"
        one = [(e, n) for layer, e, n in single if layer == i]
        assert len(one) == K and all(n == 1 for _, n in one), f"layer {i}: a decode token called {one}"


def test_a_tokens_row_is_the_same_alone_in_a_prompt_and_in_any_grouping(moe_gguf):
    """The MoE layer on its own (the fast C kernels on Q4_K / Q6_K experts): rows of one call of 48 tokens,
    of each token alone, and of the tokens shuffled, bit for bit."""
    from lowbit.runtime.load.loader import load

    lm = load(str(moe_gguf), "auto", progress=False).model
    moe = lm.layers[1].moe
    h = torch.randn(48, lm.config.dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = moe(h, None, torch.float32)
        alone = torch.cat([moe(h[i:i + 1], None, torch.float32) for i in range(48)])
        perm = torch.randperm(48, generator=torch.Generator().manual_seed(7))
        shuffled = torch.empty_like(whole)
        shuffled[perm] = moe(h[perm], None, torch.float32)
        ids, _ = moe.route(h)
    assert ids.unique().numel() == E, "the tokens did not use every expert: the grouping is not exercised"
    assert torch.equal(whole, alone) and torch.equal(whole, shuffled)


def test_stacked_expert_tensors_load_as_per_expert_modules(moe_files, tmp_path):
    """transformers 5 holds a layer's experts as gate_up_proj [E, 2I, D] and down_proj [E, D, I]; the hub's
    Qwen3-MoE checkpoints have one module per expert (what save_pretrained writes back). The same weights in
    the two layouts give the same logits, equal to transformers'."""
    model, d = moe_files
    src = load_file(str(d / "hf" / "model.safetensors"))
    stacked = {k: v for k, v in src.items() if ".mlp.experts." not in k}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        stacked[p + "gate_up_proj"] = torch.stack([torch.cat([src[f"{p}{e}.gate_proj.weight"],
                                                              src[f"{p}{e}.up_proj.weight"]]) for e in range(E)])
        stacked[p + "down_proj"] = torch.stack([src[f"{p}{e}.down_proj.weight"] for e in range(E)])
    (tmp_path / "config.json").write_text((d / "hf" / "config.json").read_text())
    save_file(stacked, str(tmp_path / "model.safetensors"))
    (c1, hub, _), (c2, mine, _) = (load_hf_dir(where, parse_weights("f32")) for where in (d / "hf", tmp_path))
    assert c1 == c2 and hub.keys() == mine.keys()
    for name in hub:
        a, b = (getattr(x[name], "weight", x[name]) for x in (hub, mine))  # FloatWeight or a norm vector
        assert torch.equal(a, b), name
    ids = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got, ref = forward(Llama(c2, mine).eval(), ids), model(ids).logits.float()
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_info_reports_total_and_active_parameters_and_bytes_read(moe_gguf):
    """Hand-computed from the tiny model's shapes: dim 256, 4 layers, 4/2 heads of 64, q/k norms, 8 experts of
    256 columns (2 per token), untied 49,152-token table."""
    import subprocess
    import sys

    from lowbit.runtime.load.loader import load

    dim, layers, V, I = 256, 4, 49152, 256
    attn = dim * (256 + 2 * 128) + 256 * dim + 2 * dim + 2 * 64
    total = 2 * V * dim + layers * (attn + E * (3 * dim * I + dim)) + dim
    active = V * dim + dim + layers * (attn + K * 3 * dim * I + E * dim) + dim
    lm = load(str(moe_gguf), "auto", progress=False)
    assert lm.config.parameters() == (total, active)
    experts = sum(b.numel() * b.element_size() for layer in lm.model.layers for b in layer.moe.experts.buffers())
    table = sum(b.numel() * b.element_size() for b in lm.model.embed.buffers())
    assert lm.model.bytes_per_token() == lm.weight_bytes - experts + experts * K // E - table + table // V
    r = subprocess.run([sys.executable, "-P", "-m", "lowbit.runtime.cli", "info", str(moe_gguf)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert f"parameters: {total:,} total, {active:,} active per token ({K} of {E} experts)" in r.stdout
    assert f"weight bytes read per token: {lm.model.bytes_per_token():,}" in r.stdout
    assert "8 experts of 256 columns, 2 per token" in r.stdout


def test_tensor_parallel_refuses_experts_in_one_line(moe_files):
    from lowbit.models.sharding import check_split

    _, d = moe_files
    config, _, _ = load_hf_dir(d / "hf", parse_weights("f32"))
    with pytest.raises(ValueError, match=r"--tp 2: mixture-of-experts models \(qwen3moe\) run in one process"):
        check_split(config, 2, lambda name: 0)


def test_a_model_larger_than_memory_fails_in_one_line_before_loading(moe_gguf, tmp_path):
    """A GGUF whose tensors outweigh the machine (a sparse file: its header names 64 GiB of weights, the disk
    holds none) fails at once with the bytes needed and available, and a non-zero exit."""
    import subprocess
    import sys
    import time

    import gguf
    import numpy as np

    big = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(big), "llama")
    for key, f in gguf.GGUFReader(moe_gguf).fields.items():  # the tokenizer keys, so only the size is wrong
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.add_block_count(1)
    n = 16 << 30  # 16 Gi f32 elements = 64 GiB
    w.add_tensor_info("token_embd.weight", (1 << 20, n >> 20), np.dtype(np.float32), 4 * n, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(big, "r+b") as f:  # the data region, as holes
        f.truncate(f.seek(0, 2) + 4 * n + 64)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-P", "-m", "lowbit.runtime.cli", "info", str(big)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and time.monotonic() - t0 < 60
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "big.gguf: the weights need 64.0 GiB but this machine has" in err[0], r.stderr


def test_mxfp4_safetensors_are_refused_in_one_line(moe_files, tmp_path):
    """gpt-oss as OpenAI publishes it (quantization_config quant_method mxfp4): one line pointing to the GGUF."""
    import json

    from lowbit.runtime.errors import LowbitError
    from tests.helpers import one_line

    _, d = moe_files
    cfg = json.loads((d / "hf" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    (tmp_path / "model.safetensors").write_bytes((d / "hf" / "model.safetensors").read_bytes())
    with pytest.raises(LowbitError) as e:
        load_hf_dir(tmp_path, parse_weights("int4-g32"))
    one_line(e, "MXFP4 safetensors", "use its GGUF")


@pytest.fixture(scope="module")
def oss_mxfp4(default_gguf, tmp_path_factory):
    """The tiny gpt-oss (tests/family_models.py) as users get it: llama.cpp's converter, then its quantizer's
    MXFP4_MOE (experts MXFP4, the rest Q8_0)."""
    d = tmp_path_factory.mktemp("oss")
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(d / "tok")
    model = build("gpt-oss", len(tok), seed=13)
    hf = save(model, d / "tok", d / "hf", "gpt-oss")
    f32 = llama_cpp_source.convert(llama_cpp_source.converter_dir(), hf, d / "F32.gguf")
    return model, llama_cpp_source.quantize(f32, d / "MXFP4_MOE.gguf", "MXFP4_MOE")


def test_gpt_oss_mxfp4_experts_are_held_as_the_file_holds_them(oss_mxfp4):
    """MXFP4 experts kept losslessly (quant/ggml.py; no requantization note), at the file's size, and the model
    is the file's exact model: mean KL ≤ 1e-6 against transformers on the file dequantized by gguf.quants;
    llama.cpp agrees within its own error (both truncating YaRN: tests/test_families.py says why)."""
    import gguf

    from lowbit.runtime.load.gguf import gguf_tensor_bytes, load_gguf
    from lowbit.runtime.load.loader import load
    from tests.helpers import kl, llama_cpp_logits
    from tests.test_families import _truncated_yarn, dequantized_model, prompt

    model, path = oss_mxfp4
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    notes: list[str] = []
    load_gguf(path, None, note=notes.append)
    assert notes == []
    lm = load(str(path), "auto", progress=False)
    assert lm.weight_bytes <= 1.02 * gguf_tensor_bytes(path)
    ids = prompt(256, lm.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = dequantized_model(model, path, "gpt-oss")(ids).logits.float()[0]
        got = forward(lm.model, ids)[0]
    assert kl(ref, got).mean().item() <= 1e-6
    theirs = llama_cpp_logits(path, ids[0].tolist())
    ref_t, got_t = _truncated_yarn(model, path, ids)
    their_err, apart = kl(ref_t, theirs).mean().item(), kl(theirs, got_t).mean().item()
    print(f"gpt-oss MXFP4_MOE: lowbit {kl(ref, got).mean().item():.3g}; llama.cpp {their_err:.3g}, apart {apart:.3g}")
    assert their_err <= 0.15 and apart <= 0.15  # measured 0.053, 0.053 (AMD Zen 4)


# ---- the experts in one C call (kernels/cpu_moe.py) against the per-expert loop, bit for bit ----

def _c_kernels():
    from lowbit.kernels.cpu_native import native

    k = native()
    if k is None:
        pytest.skip("the C kernels do not build here")
    return k


def _c_call_equals_the_loop(path: Path, isa: str) -> None:
    """Every layer's experts on `isa`: the one C call against the per-expert loop on the same routing, for a
    48-row step, each row alone (the loop's M = 1 form), and the rows shuffled, bit for bit."""
    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.loader import load

    lm = load(str(path), "auto", progress=False, backend=torch_backend(_c_kernels().with_isa(isa))).model
    g = torch.Generator().manual_seed(21)
    for i, layer in enumerate(lm.layers):
        moe = layer.moe
        assert moe.fused is not None, f"layer {i}: the experts were not given to the C call"
        h = torch.randn(48, lm.config.dim, generator=g)
        with torch.no_grad():
            ids, w = moe.route(h)
            loop = moe._per_expert(h, ids, w, None)
            one = moe.fused(h, ids, w)
            alone = torch.cat([moe.fused(h[t:t + 1], ids[t:t + 1], w[t:t + 1]) for t in range(48)])
            alone_loop = torch.cat([moe._per_expert(h[t:t + 1], ids[t:t + 1], w[t:t + 1], None) for t in range(48)])
            perm = torch.randperm(48, generator=g)
            shuffled = torch.empty_like(one)
            shuffled[perm] = moe.fused(h[perm], ids[perm], w[perm])
            through = moe(h, None, torch.float32)  # forward takes the C call for a fast step
        assert ids.unique().numel() >= E - 1, f"layer {i}: the grouping is not exercised"
        for name, got in (("one call", one), ("alone", alone), ("alone, loop", alone_loop), ("shuffled", shuffled),
                          ("forward", through)):
            assert torch.equal(got, loop), f"{path.name} {isa} layer {i}: {name} differs from the per-expert loop"


@pytest.mark.parametrize("isa", ["avx2", "vnni256", "avx512"])
def test_one_c_call_for_the_experts_equals_the_per_expert_loop_qwen3moe_q4_k_m(moe_gguf, isa):
    if isa not in _c_kernels().isas:
        pytest.skip(f"{isa}: not on this CPU")
    _c_call_equals_the_loop(moe_gguf, isa)


@pytest.mark.parametrize("isa", ["avx2", "vnni256", "avx512"])
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M", "MXFP4_MOE"])
def test_one_c_call_for_the_experts_equals_the_per_expert_loop_gpt_oss(oss_quants, ftype, isa):
    """gpt-oss's shape: biases on gate, up and down, the clamped SwiGLU (the C loop both paths run)."""
    if isa not in _c_kernels().isas:
        pytest.skip(f"{isa}: not on this CPU")
    _c_call_equals_the_loop(oss_quants[ftype], isa)


def test_clamped_swiglu_c_loop_is_the_spec_within_rounding():
    """kernels/swiglu_clamped.py: the C loop (odd widths: the 8-lane tail) against the torch spec, clamps and
    NaN included."""
    from lowbit.kernels.swiglu_clamped import swiglu_clamped_cpu, swiglu_clamped_ref

    k = _c_kernels()
    g = torch.Generator().manual_seed(22)
    gate, up = 6 * torch.randn(7, 203, generator=g), 6 * torch.randn(7, 203, generator=g)
    gate[0, :3] = torch.tensor([100.0, -100.0, float("nan")])
    got = swiglu_clamped_cpu(gate, up, 1.702, 7.0, native=k)
    ref = swiglu_clamped_ref(gate, up, 1.702, 7.0)
    assert torch.isnan(got[0, 2]) and torch.isnan(ref[0, 2])
    ok = ~torch.isnan(ref)
    assert torch.allclose(got[ok], ref[ok], rtol=1e-6, atol=1e-6)


def _decode_three_ways(path: Path, isa: str) -> None:
    """A 6-token prompt (exact rows, op by op), then 3 decode steps of 3 sequences: in one C call for every
    layer (kernels/cpu_block.c lowbit_decode_paged_layers with the MoE inside each block), block by block
    through the fused halves, and op by op (the C router and the C experts as separate calls) — the same
    logits bit for bit."""
    from lowbit.models.backend import torch_backend
    from lowbit.runtime.load.loader import load
    from tests.helpers import Sequences

    model = load(str(path), "auto", progress=False, backend=torch_backend(_c_kernels().with_isa(isa))).model
    assert model.fused_layers is not None and all(b.fused is not None for b in model.layers)
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(23))
    saved, saved_layers = [b.fused for b in model.layers], model.fused_layers

    def steps(how: str) -> torch.Tensor:
        model.fused_layers = saved_layers if how == "one call" else None
        for b, f in zip(model.layers, saved):
            b.fused = None if how == "op by op" else f
        try:
            with torch.inference_mode():
                seqs = Sequences(model, 3, 12)
                seqs.step(ids[:, :6], exact=True)
                return torch.cat([seqs.step(ids[:, t:t + 1], exact=False) for t in range(6, 9)], 1)
        finally:
            model.fused_layers = saved_layers
            for b, f in zip(model.layers, saved):
                b.fused = f

    one, blocks, ops = steps("one call"), steps("blocks"), steps("op by op")
    assert torch.isfinite(one).all() and one.abs().max() > 0
    assert torch.equal(one, blocks), f"{path.name} {isa}: the one-call step differs from the fused blocks"
    assert torch.equal(one, ops), f"{path.name} {isa}: the fused step differs from the op-by-op step"


@pytest.mark.parametrize("isa", ["avx2", "vnni256", "avx512"])
def test_fused_decode_with_experts_equals_op_by_op_qwen3moe(moe_gguf, isa):
    if isa not in _c_kernels().isas:
        pytest.skip(f"{isa}: not on this CPU")
    _decode_three_ways(moe_gguf, isa)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M", "MXFP4_MOE"])
def test_fused_decode_with_experts_equals_op_by_op_gpt_oss(oss_quants, ftype, isa):
    """gpt-oss in the fused step: attention sinks, q/k/v and o biases, alternating windows, expert biases and
    the clamped SwiGLU, the router's softmax over its top k."""
    if isa not in _c_kernels().isas:
        pytest.skip(f"{isa}: not on this CPU")
    _decode_three_ways(oss_quants[ftype], isa)


def test_the_c_router_picks_as_torch_does_and_breaks_ties_to_the_lower_id(moe_gguf):
    """cpu_router.c against torch's softmax / top-k / renormalisation on the same logits: the same experts
    (random rows: no near ties), weights within fp32 rounding; on exact ties the lower id first."""
    from lowbit.runtime.load.loader import load

    lm = load(str(moe_gguf), "auto", progress=False).model
    moe = lm.layers[0].moe
    h = torch.randn(64, lm.config.dim, generator=torch.Generator().manual_seed(24))
    with torch.no_grad():
        ids, w = moe.route(h)
        logits = moe.router(h, True, torch.float32)
    probs = torch.softmax(logits, -1)
    top, ref = torch.topk(probs, K, -1)
    assert torch.equal(ids, ref)
    assert torch.allclose(w, top / top.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)
    tie = torch.zeros(1, lm.config.dim)  # all logits equal the bias (none here): every expert ties
    tids, tw = moe.route(tie)
    assert tids.tolist() == [[0, 1]] and torch.allclose(tw, torch.full((1, 2), 0.5))


def test_parameter_counts_equal_transformers(moe_files, oss_mxfp4):
    """`lowbit info`'s total equals transformers' own count of the same model (gpt-oss: biases on O, router and
    experts, and sinks, counted too), and the active count is the total less the experts a token skips."""
    from lowbit.runtime.load.gguf import load_gguf

    for model, config in ((moe_files[0], load_hf_dir(moe_files[1] / "hf", parse_weights("f32"))[0]),
                          (oss_mxfp4[0], load_gguf(oss_mxfp4[1], None)[0])):
        total, active = config.parameters()
        assert total == sum(p.numel() for p in model.parameters()), config.arch
        per_expert = 3 * config.dim * config.expert_hidden_dim + (2 * config.expert_hidden_dim + config.dim
                                                                   if config.arch == "gpt-oss" else 0)
        assert total - active == config.n_layers * (E - K) * per_expert + config.vocab_size * config.dim - config.dim
