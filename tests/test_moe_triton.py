"""The grouped expert matmul (kernels/moe_triton.py): every expert a step uses in one Triton launch per
projection, against the per-expert loop it replaces (models/moe.py `_per_expert`), bit for bit.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py); the `gpu` cases repeat the
checks compiled. The experts are GGUF files from llama.cpp's converter and quantizer (tests/test_moe.py's
fixtures): the tiny Qwen3-MoE in Q4_K_M (Q4_K gate/up, Q6_K down) and the tiny gpt-oss in MXFP4_MOE
(MXFP4 experts with biases, clamped SwiGLU).
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.moe_triton import BLOCK_M, sort_by_expert
from lowbit.kernels.triton_import import interpreting
from tests.test_moe import E

pytest.importorskip("triton")
DEVICES = [pytest.param("cpu", id="interp"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _device(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if device == "cpu" and not interpreting():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1 (conftest sets it)")
    return device


def _load(path, device: str):
    from lowbit.models.backend import triton_backend
    from lowbit.runtime.load.loader import load

    return load(str(path), "auto", progress=False, backend=triton_backend(_device(device), "float16")).model


def test_pairs_sorted_by_expert_into_whole_tiles():
    """Hand-checked: 3 tokens x 2 slots over 4 experts → expert 0 holds tokens 0, 1; expert 1 tokens 1, 2;
    expert 2 tokens 0, 2; expert 3 nothing. Each used expert starts a tile of its own, in ascending order,
    its tokens ascending, the rest of the tile padding (-1); tiles past the used ones name no expert (4)."""
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    r = sort_by_expert(ids, 4)
    assert r.blocks == 1 + 4  # cdiv(6, 16) + min(6, 4): the bound, for any routing of 6 pairs
    pad = [-1] * (BLOCK_M - 2)
    assert r.rows.tolist() == [0, 1] + pad + [1, 2] + pad + [0, 2] + pad + [-1] * 2 * BLOCK_M
    assert r.block_expert.tolist() == [0, 1, 2, 4, 4]
    assert r.where.tolist() == [[2 * BLOCK_M, 0], [1, BLOCK_M], [2 * BLOCK_M + 1, BLOCK_M + 1]]


def test_an_expert_with_more_tokens_than_a_tile_takes_several():
    """40 tokens all choosing experts 3 and 5 of 8: 40 rows each, so three tiles each (the last 8 rows
    padding), and every (token, slot) lands on a row naming its token inside its expert's tiles."""
    ids = torch.tensor([[5, 3]] * 40)
    r = sort_by_expert(ids, 8)
    used = r.block_expert[r.block_expert < 8].tolist()
    assert used == [3, 3, 3, 5, 5, 5]
    for t in range(40):
        for j, e in enumerate(ids[t].tolist()):
            p = r.where[t, j].item()
            assert r.rows[p].item() == t and r.block_expert[p // BLOCK_M].item() == e
    assert (r.rows >= 0).sum().item() == 80


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["qwen3moe-Q4_K_M", "gpt-oss-MXFP4_MOE"])
@torch.inference_mode()
def test_grouped_launches_equal_the_per_expert_loop(which, device, moe_gguf, oss_quants):
    """A layer's experts, grouped against the loop on the same routing: a 48-token step (some experts
    take more than one tile) and a decode row, fp16 activations (and the exact fp32 path for the row), bit
    for bit; and a grouped step calls no expert's own matmul (hooks on every expert's projections see none)."""
    path = moe_gguf if which.startswith("qwen3moe") else oss_quants["MXFP4_MOE"]
    lm = _load(path, device)
    # one layer of each file (the interpreter runs ~30 s a layer): the first whose routing of these 48 tokens
    # uses every expert and gives one expert more rows than a tile; every layer's experts are stacked
    assert all(layer.moe.grouped is not None for layer in lm.layers)
    h = torch.randn(48, lm.config.dim, generator=torch.Generator().manual_seed(31)).to(device)
    for i, layer in enumerate(lm.layers):
        ids, _ = layer.moe.route(h.half())
        if ids.unique().numel() == E and ids.flatten().bincount().max() > BLOCK_M:
            break
    else:
        raise AssertionError("no layer groups as much as the test says")
    moe = layer.moe
    calls = []
    hooks = [q.register_forward_hook(lambda *a: calls.append(1)) for x in moe.experts for q in (x.gate_up, x.w_down)]
    try:
        got = {(m, ex): moe(h[:m].half(), ex, torch.float32) for m, ex in ((48, None), (1, None), (1, True))}
    finally:
        for hk in hooks:
            hk.remove()
    assert calls == []
    grouped, moe.grouped = moe.grouped, None
    try:
        for (m, ex), y in got.items():
            want = moe(h[:m].half(), ex, torch.float32)
            assert torch.equal(y, want), f"layer {i}, {m} rows, exact={ex}: {(y - want).abs().max()}"
    finally:
        moe.grouped = grouped


@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_stacked_experts_are_held_once(device, moe_gguf):
    """Stacking keeps the bytes the file's experts take: every expert's buffers are views of its layer's
    stacks (no copy left behind), and the model's buffers count the same bytes as the per-expert form."""
    from lowbit.models.backend import triton_backend
    from lowbit.models.moe import Experts
    from lowbit.runtime.load.loader import load

    lm = _load(moe_gguf, device)
    held = sum(b.nbytes for b in lm.buffers())
    for layer in lm.layers:
        gate_up, down = layer.moe.grouped
        for e, x in enumerate(layer.moe.experts):
            assert x.gate_up.parts[0].data.data_ptr() == gate_up.runs[0].data[e].data_ptr()
            assert x.w_down.data.data_ptr() == down.runs[0].data[e].data_ptr()
    original = Experts.__init__.__globals__["_grouped"]
    Experts.__init__.__globals__["_grouped"] = lambda experts: None
    try:
        loop = load(str(moe_gguf), "auto", progress=False, backend=triton_backend(device, "float16")).model
    finally:
        Experts.__init__.__globals__["_grouped"] = original
    assert held == sum(b.nbytes for b in loop.buffers())


def test_moe_decode_is_graphed_only_with_the_grouped_kernel(moe_gguf):
    """A capture forbids the loop's host sync (ids.tolist()): GGUF experts (grouped) may be graphed, and a
    model whose experts take the loop is eager with the reason."""
    from lowbit.quant.kv import KV_FORMATS
    from lowbit.runtime.engine.cuda_graphs import why_eager
    from lowbit.runtime.engine.kv_cache import KVPool

    lm = _load(moe_gguf, "cpu")
    c = lm.config
    pool = KVPool(KV_FORMATS["f16"], c.n_layers, c.n_kv_heads, c.head_dim, 10, 16)
    assert why_eager(lm, pool, on_cuda=False) is None
    lm.layers[1].moe.grouped = None
    assert "experts" in why_eager(lm, pool, on_cuda=False)
