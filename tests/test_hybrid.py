"""Qwen3.5 and Qwen3.5-MoE (hybrid: Gated DeltaNet linear attention beside gated full attention) against
transformers and llama.cpp, on tiny random models (tests/hybrid_models.py) with the family's quirks switched
on: 8 layers, 6 of them DeltaNet (full_attention_interval 4), 2 key heads serving 4 value heads (grouped in
HF's order, tiled in llama.cpp's GGUF), the attention output gated by sigmoid(gate) from q_proj's interleaved
rows, q/k norms stored as w - 1, partial rotary (16 of 64 dims), and in the checkpoint a multi-token-prediction
block that the converter appends as a 9th GGUF layer and the loaders must skip. The MoE: every MLP 8 experts
of 128 columns, 2 a token (the prompts use all 8 in every layer), plus a shared expert of 192 columns scaled
by sigmoid(its gate . x).

Oracles and bounds (2 threads, the C kernels of the machine):
  safetensors f32 and GGUF F32 (llama.cpp's converter): transformers' logits, max |Δ| ≤ 1e-4 x max |logit|
      over 64 tokens (measured ≤ 6e-6), whole prompt, through the cache (prefill 20, a chunk of 8, decodes),
      and two sequences of different lengths in one step; 32 greedy tokens identical, through the engine's
      paged path with a 40-token prompt prefilled in 24-token chunks, three requests at once.
  GGUF Q8_0 / Q4_K_M (llama.cpp's quantizer): the file dequantized by gguf.quants and run by transformers
      (mapped back by this file's own table): lowbit within mean KL 1e-6 over 256 tokens; llama.cpp on
      the same file against that reference, and lowbit against llama.cpp, within LLAMA_CPP_KL (~3x what
      was measured).
  The recurrence: kernels/gated_delta.py's token loop and chunked form against transformers' own torch
      functions, and the state carried across chunks against one pass.
  Speculation: n-gram drafts with rejections leave the same greedy reply as plain decoding (the rejected
      drafts are taken back out of the recurrent state), and so does verified greedy.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from lowbit.kernels.gated_delta import causal_conv_ref, delta_rule_chunked, delta_rule_ref, prepare_qk
from lowbit.models.llama import Llama
from lowbit.quant import parse_weights
from lowbit.runtime.load.gguf import gguf_tensor_bytes, load_gguf
from lowbit.runtime.load.safetensors import load_hf_dir
from tests import llama_cpp_source
from tests.helpers import ByteTokenizer, Sequences, forward, kl, llama_cpp_logits, one_line
from tests.hybrid_models import build, save

transformers = importlib.import_module("transformers")
gguf = importlib.import_module("gguf")
hf_qwen35 = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")

F32_RTOL = 1e-4
QUANT_KL = 1e-6
# KL(transformers on the dequantized file ‖ llama.cpp), ~3x the measured value (AMD EPYC, llama-cpp-python 0.3.36:
# Q8_0 2.8e-2, Q4_K_M 8.0e-2), which also bounds KL(lowbit ‖ llama.cpp). Ten times the dense families' (2e-3 to
# 8e-3): llama.cpp's 8-bit activations feed the recurrence, whose state carries each token's error on; its F32
# run of the same model is 1.3e-6 from transformers, so its DeltaNet itself is right
# The MoE (Qwen3.5-MoE) measured 0.40 and 0.67 (F32: median 8e-7, so its DeltaNet and experts are right): 15x the
# dense model's, and all of it llama.cpp's 8-bit activations — rounding each matmul's input to q8_0 blocks in
# torch alone moves transformers' own logits by mean KL 0.43 (dense: 0.027), the same per-position pattern: a
# changed expert choice is a different MLP, whose effect the recurrent state then carries on
LLAMA_CPP_KL = {("qwen35", "Q8_0"): 8e-2, ("qwen35", "Q4_K_M"): 0.25,
                ("qwen35moe", "Q8_0"): 1.2, ("qwen35moe", "Q4_K_M"): 2.0}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def assert_close(got, ref, what):
    err = rel_err(got, ref)
    assert err <= F32_RTOL, f"{what}: max |Δ| {err:.3g} of the largest logit (≤ {F32_RTOL})"


def prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None,
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


# ---- the recurrence ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tiled", [False, True])
def test_gated_delta_rule_and_conv_equal_transformers(tiled):
    """Both forms of the delta rule against transformers' torch recurrence (over 150 tokens from a nonzero
    state, 2 key heads for 4 value heads), split across a chunk boundary too; the conv against its conv1d."""
    g0 = torch.Generator().manual_seed(0)
    T, Hk, Hv, Dk, Dv = 150, 2, 4, 32, 48
    q, k = torch.randn(T, Hk, Dk, generator=g0), torch.randn(T, Hk, Dk, generator=g0)
    v = torch.randn(T, Hv, Dv, generator=g0)
    g, beta = -0.3 * torch.rand(T, Hv, generator=g0), torch.rand(T, Hv, generator=g0)
    s0 = 0.1 * torch.randn(Hv, Dk, Dv, generator=g0)
    # transformers maps value heads to key heads grouped; the tiled order is the same heads, permuted
    perm = torch.arange(Hv).view(Hk, Hv // Hk).t().reshape(-1) if tiled else torch.arange(Hv)  # tiled j → HF head
    ref, s_ref = hf_qwen35.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None, :, perm], g[None, :, perm], beta[None, :, perm], initial_state=s0[None, perm].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    qq, kk = prepare_qk(q, k, Hv, tiled)
    for rule in (delta_rule_ref, delta_rule_chunked):
        s = s0.clone()
        out = torch.cat([rule(qq[:70], kk[:70], v[:70], g[:70], beta[:70], s),  # the state carried across
                         rule(qq[70:], kk[70:], v[70:], g[70:], beta[70:], s)])
        assert rel_err(out, ref[0, :, perm]) < 2e-6 and rel_err(s, s_ref[0, perm]) < 2e-6, rule.__name__
    C, K = 24, 4
    x, w = torch.randn(T, C, generator=g0), torch.randn(C, K, generator=g0)
    conv_ref = hf_qwen35.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()  # [T, C]
    state = torch.zeros(C, K - 1)
    got = torch.cat([causal_conv_ref(x[:5], state, w), causal_conv_ref(x[5:6], state, w), causal_conv_ref(x[6:], state, w)])
    assert rel_err(got, conv_ref) < 1e-6


# ---- f32: transformers' logits and greedy tokens --------------------------------------------------

def check_f32(lm: Llama, model, what: str) -> None:
    ids = prompt(64, lm.config.vocab_size)
    with torch.no_grad():
        ref = model(ids).logits.float()
        assert_close(forward(lm, ids), ref, f"{what}, whole prompt")
        seqs = Sequences(lm, 2, 64)  # two sequences, one step: each its own state slot
        other = prompt(64, lm.config.vocab_size, seed=9)
        ref_other = model(other).logits.float()
        logits = seqs.step([ids[0, :20].tolist(), other[0, :33].tolist()])
        got, got_other = [logits[:20]], [logits[20:]]
        logits = seqs.step([ids[0, 20:28].tolist(), other[0, 33:34].tolist()])
        got.append(logits[:8])
        got_other.append(logits[8:])
        for t in range(28, 64):  # decode steps of both while the other has tokens left (it is 6 ahead)
            rows = [[int(ids[0, t])]] + ([[int(other[0, t + 6])]] if t + 6 < 64 else [])
            logits = seqs.step(rows)
            got.append(logits[:1])
            got_other.append(logits[1:])
        assert_close(torch.cat(got)[None], ref, f"{what}, through the cache")
        assert_close(torch.cat(got_other)[None], ref_other, f"{what}, the other sequence")


def experts_used(lm: Llama, ids: torch.Tensor) -> list[set[int]]:
    """Per layer, the experts the prompt's tokens chose (the router's own choice, models/moe.py route)."""
    used, handles = [], []
    for layer in lm.layers:
        used.append(set())
        handles.append(layer.moe.register_forward_hook(
            lambda m, args, out, u=used[-1]: u.update(m.route(args[0])[0].flatten().tolist())))
    try:
        with torch.no_grad():
            forward(lm, ids)
    finally:
        for h in handles:
            h.remove()
    return used


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_safetensors_f32_equals_transformers(tmp_path, moe):
    """Qwen3.5 and Qwen3.5-MoE (transformers 5 saves its experts one module each, and the shared expert beside
    them); the MoE's 64-token prompt routes to all 8 experts in every layer."""
    model = build(vocab=320, seed=7, moe=moe)
    save(model, None, tmp_path)
    config, w, _ = load_hf_dir(tmp_path, parse_weights("f32"))
    arch = "qwen35moe" if moe else "qwen35"
    assert config.arch == arch and config.recurrent_layers == (True,) * 3 + (False,) + (True,) * 3 + (False,)
    assert config.n_kv_layers == 2 and not config.deltanet.v_tiled
    lm = Llama(config, w).eval()
    if moe:
        assert (config.n_experts, config.n_experts_used, config.expert_hidden_dim) == (8, 2, 128)
        assert config.shared_expert_hidden_dim == 192
        assert experts_used(lm, prompt(64, 320)) == [set(range(8))] * 8
    check_f32(lm, model, f"{arch} safetensors")


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_parameters_count_deltanet_layers_and_the_shared_expert(moe):
    """LlamaConfig.parameters() (`lowbit info`, /api/show) hand-computed from the tiny models' shapes, and its total
    equal to transformers' own count of the model's parameters. dim 256, 8 layers (6 DeltaNet, 2 attention),
    untied 320-token table."""
    from lowbit.models.config import LlamaConfig
    from lowbit.models.sharding import check_split

    model = build(vocab=320, seed=7, moe=moe)
    config = LlamaConfig.from_hf(model.config.to_dict())
    dim, V = 256, 320
    # attention: q 4 x 64 and its gate rows, k and v 2 x 64, o [256, 256], q/k norms [64]
    attn = dim * (2 * 256 + 2 * 128) + 256 * dim + 2 * 64
    # DeltaNet: qkv [2 x 128 + 256 = 512, 256], z [256, 256], b and a [4, 256], out [256, 256], conv [512, 4],
    # dt_bias and A [4], the gated norm [64]
    deltanet = dim * (512 + 256 + 2 * 4) + 256 * dim + 512 * 4 + 2 * 4 + 64
    norms = 2 * dim
    if moe:  # 8 experts of 128 columns (2 a token), the router [8, 256], a shared expert of 192 and its gate [256]
        shared = 3 * dim * 192 + dim
        mlp, mlp_active = 8 * 3 * dim * 128 + 8 * dim + shared, 2 * 3 * dim * 128 + 8 * dim + shared
    else:
        mlp = mlp_active = 3 * dim * 512
    total = 2 * V * dim + 2 * attn + 6 * deltanet + 8 * (norms + mlp) + dim
    active = V * dim + dim + 2 * attn + 6 * deltanet + 8 * (norms + mlp_active) + dim
    assert config.parameters() == (total, active)
    assert total == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError) as e:
        check_split(config, 2, lambda name: 0)
    one_line(e, "--tp 2:", "run in one process")


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def files(default_gguf, tmp_path_factory, request):
    """(HF model, checkpoint dir, GGUF files F32 / Q8_0 / Q4_K_M made by llama.cpp's converter and quantizer),
    with the default model's tokenizer so that the converter takes the vocabulary; Qwen3.5 and Qwen3.5-MoE."""
    d = tmp_path_factory.mktemp(request.param)
    tok = transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    tok.save_pretrained(d / "tok")
    model = build(vocab=len(tok), seed=0, moe=request.param == "qwen35moe")
    hf = save(model, d / "tok", d / "hf")
    tree = llama_cpp_source.converter_dir()
    out = {"F32": llama_cpp_source.convert(tree, hf, d / "F32.gguf")}
    for q in ("Q8_0", "Q4_K_M"):
        out[q] = llama_cpp_source.quantize(out["F32"], d / f"{q}.gguf", q)
    return model, hf, out


def test_gguf_f32_from_llama_cpps_converter_equals_transformers(files):
    model, _, paths = files
    config, w, meta = load_gguf(paths["F32"], parse_weights("f32"))
    arch = meta["general.architecture"]
    assert meta[f"{arch}.block_count"] == 9 and config.n_layers == 8  # the MTP layer is left out
    assert config.deltanet.v_tiled and config.rotary_dim == 16 and config.arch == arch
    if arch == "qwen35moe":
        assert (config.n_experts, config.n_experts_used, config.shared_expert_hidden_dim) == (8, 2, 192)
    check_f32(Llama(config, w).eval(), model, f"{arch} GGUF F32")


@pytest.mark.parametrize("moe", [False, True], ids=["qwen35", "qwen35moe"])
def test_engine_greedy_equals_transformers_with_chunked_prefill(tmp_path, moe):
    """Three requests at once through the engine (f32 weights and cache): 40-token prompts prefilled in
    chunks of a 24-token step budget, so each prompt's state crosses chunk boundaries and shares steps with
    the others' decodes; each reply's 32 greedy tokens are transformers'."""
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sampler import SamplingParams

    model = build(vocab=101, seed=5, moe=moe)  # ByteTokenizer's vocabulary
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, w, _ = load_hf_dir(tmp_path, parse_weights("f32"))
    lm = Llama(config, w).eval()
    prompts = [prompt(40, 100, seed=s) for s in (1, 2, 3)]
    engine = Engine(lm, ByteTokenizer(), EngineConfig(kv_format="f32", kv_memory=8 << 20, page_size=4,
                                                      max_step_tokens=24, max_num_seqs=3))
    rids = [engine.add_request(p[0].tolist(), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            for p in prompts]
    out = {r: [] for r in rids}
    while engine.has_work():
        for d in engine.step():
            out[d.request_id] += d.token_ids
    for r, p in zip(rids, prompts):
        assert out[r] == hf_greedy(model, p, 32), r
    assert engine.slots.num_free == 3 and engine.stats()["prefix_hit_rate"] == 0.0


class WrongAtRandom:
    """A proposer that drafts the known greedy reply with a draft made wrong at random (seeded), so that
    every number of accepted drafts, 0 to k, occurs."""

    def __init__(self, prompt_len: int, truth: list[int], seed: int = 0):
        import random

        self.start, self.truth, self.rng = prompt_len, truth, random.Random(seed)

    def propose(self, items):
        from lowbit.runtime.engine.speculative import Proposal

        out = {}
        for sid, ids, k, _ in items:
            drafts = list(self.truth[len(ids) - self.start:len(ids) - self.start + k])
            wrong = self.rng.randrange(len(drafts) + 1)
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % 100
            out[sid] = Proposal(drafts)
        return out

    def release(self, seq_id):
        pass


def test_speculative_decoding_takes_rejected_drafts_out_of_the_state(tmp_path):
    """Drafts with rejections (a proposer wrong at a random draft) and verified greedy keep plain greedy
    decoding's reply on the int8 model over a k8v4 cache: the state keeps the pending token and the accepted
    drafts only (runtime/engine/state_cache.py keep)."""
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sampler import SamplingParams
    from lowbit.runtime.engine.speculative import VERIFIED_GREEDY, SpecConfig

    model = build(vocab=101, seed=4)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, w, _ = load_hf_dir(tmp_path, parse_weights("int8-g32"))
    lm = Llama(config, w).eval()
    ids = [5, 6, 7, 8] * 6

    def reply(proposer=None, **kw):
        engine = Engine(lm, ByteTokenizer(), EngineConfig(kv_memory=4 << 20, page_size=4, max_num_seqs=2, **kw))
        engine.proposer = proposer or engine.proposer
        rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        out = []
        while engine.has_work():
            out += [t for d in engine.step() if d.request_id == rid for t in d.token_ids]
        return out, engine

    plain, _ = reply()
    spec, engine = reply(WrongAtRandom(len(ids), plain), speculative=SpecConfig.parse("ngram,k=3"))
    assert len(plain) == 24 and spec == plain
    assert 0 < engine.spec.accepted < engine.spec.drafted, "no rejected draft: the state's rollback is untested"
    exact, _ = reply(exact=True)
    verified, engine = reply(kv_format="f32", speculative=VERIFIED_GREEDY)
    assert verified == exact and engine.spec.drafted > 0


def test_hybrid_memory_and_refusals_in_one_line(tmp_path):
    """The state slots come out of the KV budget (and a budget too small for them fails in one line), a
    hybrid draft model is refused in one line."""
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.speculative import SpecConfig

    model = build(vocab=101, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, w, _ = load_hf_dir(tmp_path, parse_weights("int8-g32"))
    lm = Llama(config, w).eval()
    per_seq = config.state_bytes
    assert per_seq == 6 * 4 * (4 * 64 * 64 + 512 * 3)
    engine = Engine(lm, ByteTokenizer(), EngineConfig(kv_memory=2 << 20, max_num_seqs=4))
    assert engine.pool.states.nbytes == 4 * per_seq and engine.pool.nbytes <= 2 << 20
    with pytest.raises(ValueError) as e:
        Engine(lm, ByteTokenizer(), EngineConfig(kv_memory=4 * per_seq, max_num_seqs=4))
    one_line(e, "recurrent state of 4 sequences", "no KV page")
    with pytest.raises(ValueError) as e:
        Engine(lm, ByteTokenizer(), EngineConfig(speculative=SpecConfig.parse("draft=x")), draft_model=lm)
    one_line(e, "cannot be the draft model")


# ---- quantized GGUF: the file's exact model, and llama.cpp on the same file ------------------------

# HF name (within model.layers.{i}.) → GGUF name (within blk.{i}.), as conversion/qwen.py writes them
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    # Qwen3.5-MoE: the router, the experts (HF's stacked [E, 2I, D] gate_up is the file's gate and up, stacked),
    # the shared expert and its gate
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight":
    "ffn_up_shexp.weight", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def dequantized_model(model, path: Path):
    """A copy of the HF model holding the file's weights, dequantized by gguf.quants and mapped back by the
    table above: norms less the 1 the converter added (not the gated norm's), A_log = log(-A), and the value
    heads of the DeltaNet tensors back from llama.cpp's tiled order to HF's grouped one."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    c = model.config
    Hk, Hv, Dk, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = Hv // Hk
    # grouped head kh * r + i is tiled head i * Hk + kh
    tiled_of = (torch.arange(r)[None, :] * Hk + torch.arange(Hk)[:, None]).reshape(-1)  # [Hv], in grouped order

    def heads(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        idx = (tiled_of[:, None] * size + torch.arange(size)).reshape(-1)
        return x.index_select(dim, idx)

    def read(g: str) -> torch.Tensor:
        t = tensors[g]
        return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32))

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for hf_name, p in ref.named_parameters():
            if hf_name.startswith("model.layers."):
                i, rest = hf_name[len("model.layers."):].split(".", 1)
                names = GGUF_NAMES[rest]
                g = [f"blk.{i}.{n}" for n in names] if isinstance(names, tuple) else f"blk.{i}.{names}"
            else:
                g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[hf_name]
            if isinstance(g, list):  # gate_up_proj [E, 2I, D]: each expert's gate rows, then its up rows
                E, I2, D = p.shape
                v = torch.cat([read(n).reshape(E, I2 // 2, D) for n in g], dim=1)
            else:
                v = read(g).reshape(p.shape)
            if "norm" in hf_name and "linear_attn.norm" not in hf_name:
                v = v - 1.0
            if hf_name.endswith("A_log"):
                v = torch.log(-v)
            if "linear_attn." in hf_name:
                if "in_proj_qkv" in hf_name or "conv1d" in hf_name:
                    qk = 2 * Hk * Dk
                    v = torch.cat([v[:qk], heads(v[qk:], 0, Dv)])
                elif "in_proj_z" in hf_name:
                    v = heads(v, 0, Dv)
                elif any(n in hf_name for n in ("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
                    v = heads(v, 0, 1)
                elif "out_proj" in hf_name:
                    v = heads(v, 1, Dv)
            p.copy_(v)
    return ref


def test_dequantized_reference_maps_the_f32_file_back_exactly(files):
    """The reference's own check: the F32 file mapped back is the HF model, bit for bit."""
    model, _, paths = files
    ref = dequantized_model(model, paths["F32"])
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), n


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_quantized_gguf_is_the_files_exact_model_and_agrees_with_llama_cpp(files, qtype):
    """Qwen3.5 and Qwen3.5-MoE (its experts sliced out of the file's 3-D tensors, its shared expert beside them)."""
    from lowbit.runtime.load.loader import load

    model, _, paths = files
    path = paths[qtype]
    lm = load(str(path), "auto", progress=False)
    held, total = lm.weight_bytes, gguf_tensor_bytes(path)
    assert held <= 1.02 * total, f"{qtype}: {held / total:.3f}x the file's tensor bytes"
    ids = prompt(256, lm.config.vocab_size, seed=3)
    with torch.no_grad():
        ref = dequantized_model(model, path)(ids).logits.float()[0]
        got = forward(lm.model, ids)[0]
    mean = kl(ref, got).mean().item()
    assert mean <= QUANT_KL, f"{qtype}: mean KL {mean:.3g} against the dequantized file (≤ {QUANT_KL})"
    theirs = llama_cpp_logits(path, ids[0].tolist())
    arch = lm.config.arch
    bound = LLAMA_CPP_KL[(arch, qtype)]
    their_err, apart = kl(ref, theirs).mean().item(), kl(theirs, got).mean().item()
    print(f"{arch} {qtype}: lowbit {mean:.3g}, llama.cpp {their_err:.3g} against the file; apart {apart:.3g}")
    assert their_err <= bound, f"{qtype}: llama.cpp's mean KL {their_err:.3g} (≤ {bound}): the file is wrong?"
    assert apart <= bound, f"{qtype}: lowbit and llama.cpp {apart:.3g} apart (≤ {bound})"
