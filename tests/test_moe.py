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


@pytest.fixture(scope="module")
def moe_gguf(default_gguf, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("moe-gguf")
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(d / "tok")
    model = build("qwen3moe", len(tok), seed=12)
    hf = save(model, d / "tok", d / "hf", "qwen3moe")
    tree = llama_cpp_source.converter_dir()
    f32 = llama_cpp_source.convert(tree, hf, d / "F32.gguf")
    return llama_cpp_source.quantize(f32, d / "Q4_K_M.gguf", "Q4_K_M")


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
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"parameters: {total:,} total, {active:,} active per token ({K} of {E} experts)" in r.stdout
    assert f"weight bytes read per token: {lm.model.bytes_per_token():,}" in r.stdout
    assert "8 experts of 256 columns, 2 per token" in r.stdout


def test_tensor_parallel_refuses_experts_in_one_line(moe_files):
    from lowbit.models.sharding import check_split

    model, d = moe_files
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
                       capture_output=True, text=True, timeout=120)
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
