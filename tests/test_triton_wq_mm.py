"""The Triton weight-only matmul (kernels/wq_mm.py) against its spec, for every lowbit layout.

Without CUDA the kernel runs on the CPU under Triton's interpreter (tests/conftest.py); the `gpu`
cases run the same checks compiled on CUDA. The spec `wq_mm_ref` is itself tied to the loader's
layouts (quant/int4.py, quant/int8.py), whose dequantization is checked bit-exactly against
gguf.quants.dequantize in tests/test_ggml_relayout.py.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import wq_mm as wq_mm_module
from lowbit.kernels.triton_import import OutOfResources, interpreting
from lowbit.kernels.wq_mm import (
    DECODE_MAX_ROWS,
    DEQUANT_MIN_ROWS,
    LaunchConfig,
    choose_config,
    smem_estimate,
    wq_dequant_ref,
    wq_mm,
    wq_mm_ref,
    wq_pack_int4,
    wq_pack_int8,
    wq_rows,
)
from lowbit.quant import Int4Weight, parse_weights, quantize_weight

LAYOUTS = ["int4-g32", "int4-g64", "int4-g128", "int4-sym-g32", "int4-sym-g64", "int4-sym-g128",
           "int8-g32", "int8-g64", "int8-g128", "int8"]

# (atol relative to max |y|, rtol) per activation dtype. The kernel multiplies the activations by
# exact integer codes and accumulates in fp32, so what is left is the output's rounding to its
# dtype: one ulp — 2^-10 (fp16), 2^-7 (bf16; Triton's interpreter truncates fp32 -> bf16, which
# costs up to a whole ulp) — plus fp32 accumulation-order noise over K <= 600 terms, measured at
# <= 1.2e-6 of max |y| and bounded here by 1e-5. fp32 runs the dot in IEEE fp32 (the exact path).
TOL = {
    torch.float16: (1e-3, 2**-10),
    torch.bfloat16: (8e-3, 2**-7),
    torch.float32: (1e-5, 1e-5),
}

DEVICES = [
    pytest.param("cpu", id="interp"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def _device(name: str) -> torch.device:
    if name == "cpu" and not interpreting():
        pytest.skip("CPU runs of Triton kernels need TRITON_INTERPRET=1")
    return torch.device(name)


def _packed(layout: str, N: int, K: int, seed: int = 0):
    torch.manual_seed(seed)
    if layout.endswith(("-g96", "-g192")):  # GPTQ group sizes no quantizer of lowbit's makes
        g = int(layout.rsplit("g", 1)[1])
        codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
        mins = None if "sym" in layout else (torch.rand(N, K // g) - 0.5).half()
        return None, wq_pack_int4(codes, (torch.rand(N, K // g) * 0.1).half(), mins, g, K)
    w = quantize_weight(torch.randn(N, K), parse_weights(layout))
    if isinstance(w, Int4Weight):
        return w, wq_pack_int4(w.codes(), w.scales, w.mins, w.spec.group_size, K)
    return w, wq_pack_int8(w.qweight, w.scales, K)


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    assert y.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y.float().cpu(), ref.cpu(), atol=atol * float(ref.abs().max()), rtol=rtol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_spec_is_the_loader_layout(layout):
    """The GPU layout holds the same weights as the loader's layout, bit for bit, with K = 200
    leaving a partial last group for every group size (200 = 6x32 + 8 = 3x64 + 8 = 128 + 72)."""
    w, p = _packed(layout, 37, 200)
    assert torch.equal(wq_dequant_ref(p), w.dequantize())
    ids = torch.tensor([0, 36, 5, 5])
    assert torch.equal(wq_rows(p, ids), w.dequantize()[ids])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("M,N", [(1, 576), (3, 1000), (17, 1)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_ref(layout, M, N, dtype, device):
    """M = 1 and 3 take the split-K decode launch, 17 the tiled prefill launch; K = 200 is neither
    a multiple of the K block nor of any group."""
    dev = _device(device)
    _, p = _packed(layout, N, 200)
    x = torch.randn(M, 200).to(dtype)
    y = wq_mm(x.to(dev), p.to(dev))
    _check(y, wq_mm_ref(x, p), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["int4-g32", "int4-sym-g128", "int4-g64", "int8-g64", "int8"])
def test_split_k_and_tile_edges(layout, device):
    """Forced launch shapes: split-K over more splits than some column tiles have chunks (empty
    splits), a prefill launch with a partial last row tile, and per-channel K = 96 (not a whole
    tile); N = 200 leaves a partial last column tile. Run twice: the split-K tickets reset."""
    dev = _device(device)
    _, p = _packed(layout, 200, 96 if layout == "int8" else 256)
    p = p.to(dev)
    K = p.in_features
    for M, cfg in [(5, LaunchConfig(16, 3)), (5, LaunchConfig(16, 7)), (130, LaunchConfig(64))]:
        x = torch.randn(M, K, dtype=torch.float16)
        for _ in range(2):
            _check(wq_mm(x.to(dev), p, cfg), wq_mm_ref(x, p.to("cpu")), torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("layout", LAYOUTS + ["int4-g96", "int4-sym-g96", "int4-sym-g192"])
def test_decode_rows_do_not_depend_on_M(layout, dtype, device):
    """Batch invariance: a row's result is bit-identical whatever the number of rows beside it, for
    M = 1 .. 16 (one decode launch, its split chosen from the weight alone), and equal to the spec
    within tolerance. K = 600 spans several chunks and splits; groups of 96 are an odd multiple of
    32 (halves of tiles, groups straddling tiles; asymmetric, their sums for the mins span 96 of a
    128-wide block), groups of 192 three whole tiles."""
    dev = _device(device)
    K = 576 if layout.endswith(("g96", "g192")) else 600
    _, p = _packed(layout, 136, K)
    p = p.to(dev)
    x = torch.randn(DECODE_MAX_ROWS, K).to(dtype)
    cfg = choose_config(1, p, torch.device(dev))
    assert all(choose_config(M, p, torch.device(dev)) == cfg for M in range(1, DECODE_MAX_ROWS + 1))
    full = wq_mm(x.to(dev), p).cpu()
    _check(full, wq_mm_ref(x, p.to("cpu")), dtype)
    for M in range(1, DECODE_MAX_ROWS + 1):
        assert torch.equal(wq_mm(x[:M].to(dev), p).cpu(), full[:M]), M
    assert torch.equal(wq_mm(x[7:8].to(dev), p).cpu(), full[7:8])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["int4-g32", "int4-sym-g32", "int4-g64", "int4-g128", "int4-g96",
                                    "int4-sym-g96", "int4-sym-g192"])
def test_bf16_bias_cancels_inside_each_dot(layout, device):
    """bf16 int4 tiles hold u + 128, and one more k-step of each dot takes 128 (136 symmetric) x the
    32-column sums of x off again, inside the MMA. Where those sums dwarf y — every x near 50, or
    half of them near 50 and half ~N(0, 0.01), whose fine bits the MMA's fp32 partial sums of
    ~136 x sum(x) round away — the fp32 result (no output rounding to hide behind) stays within 2^-13
    of max |y| of the float64 product of the same x and weights: 16x finer than bf16's own rounding
    of y. Measured under the interpreter (K = 2304): 2^-15.3 at worst (tests/bench/wq_precision.py
    sets it beside the unbiased fp16 kernel). Taking the bias off once per split after the loop
    instead measured 2^-11.7 in the 64-row prefill tile with every x near 50, and fails this."""
    dev = _device(device)
    _, p = _packed(layout, 200, 2304)
    p = p.to(dev)
    g = torch.Generator().manual_seed(1)
    near50 = 50 + torch.randn(40, 2304, generator=g)
    mixed = torch.where(torch.rand(40, 2304, generator=g) < 0.5, near50, 0.01 * torch.randn(40, 2304, generator=g))
    for x in (near50.to(torch.bfloat16), mixed.to(torch.bfloat16)):
        ref = x.double() @ wq_dequant_ref(p.to("cpu")).double().T
        for M in (1, DECODE_MAX_ROWS, 40):  # decode (split K) and the 64-row prefill tiles
            y = wq_mm(x[:M].to(dev), p, out_dtype=torch.float32).double().cpu()
            err = float((y - ref[:M]).abs().max() / ref[:M].abs().max())
            assert err < 2**-13, (M, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout", ["int4-g128", "int4-sym-g32", "int8-g64", "int8"])
def test_dequant_form(layout, dtype, device):
    """The prefill form rounds each weight to x's dtype once (per-channel int8: y scaled after an
    exact-code matmul) and still meets the same tolerance. Its rms error / rms(y), measured: bf16
    2.3e-3 .. 3.7e-3 against 1.7e-3 for y's rounding alone; fp16 2.6e-4 .. 2.9e-4 against 2.1e-4."""
    dev = _device(device)
    _, p = _packed(layout, 96, 256)
    x = torch.randn(130, 256).to(dtype)
    y, ref = wq_mm(x.to(dev), p.to(dev), LaunchConfig(16, form="dequant")), wq_mm_ref(x, p)
    _check(y, ref, dtype)
    rms = ref.pow(2).mean().sqrt()
    assert float((y.float().cpu() - ref).pow(2).mean().sqrt() / rms) < (5e-3 if dtype == torch.bfloat16 else 4e-4)


def test_prefill_form_choice():
    """16-bit prefill from DEQUANT_MIN_ROWS rows takes the dequantize-then-cuBLAS form; fp32 x (the
    exact path) and fp32 y (the LM head's logits) keep the fused kernel, as does decode."""
    _, p = _packed("int4-g128", 256, 256)
    cpu = torch.device("cpu")
    assert choose_config(DEQUANT_MIN_ROWS, p, cpu, torch.bfloat16).form == "dequant"
    assert choose_config(DEQUANT_MIN_ROWS - 1, p, cpu, torch.bfloat16).form != "dequant"
    assert choose_config(2048, p, cpu, torch.float32).form != "dequant"
    assert choose_config(2048, p, cpu, torch.bfloat16, torch.float32).form != "dequant"
    assert choose_config(1, p, cpu, torch.bfloat16).form == "mma"


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_empty_batch(device):
    """x may be a row-strided view (e.g. a slice of a wider activation buffer); M = 0 is legal."""
    dev = _device(device)
    _, p = _packed("int4-g64", 64, 128)
    wide = torch.randn(4, 300, dtype=torch.float16)
    x = wide[:, 50:178]  # [4, 128] with row stride 300
    _check(wq_mm(x.to(dev), p.to(dev)), wq_mm_ref(x, p), torch.float16)
    assert wq_mm(torch.empty(0, 128, dtype=torch.float16, device=dev), p.to(dev)).shape == (0, 64)


def test_decode_config_streams_weights_once(monkeypatch):
    """Decode launches put all M <= 16 rows in one row tile (each weight read once) and split K so
    the grid holds ~2 programs per SM: 4096x4096 int4-g128 on 132 SMs is 32 column tiles x 8 splits.
    Prefill does not split."""
    monkeypatch.setattr(wq_mm_module, "_sm_count", lambda device: 132)
    _, p = _packed("int4-g128", 4096, 4096)
    cfg = choose_config(16, p, torch.device("cpu"))
    assert (cfg.block_m, cfg.split_k, cfg.form) == (16, 8, "mma")
    assert choose_config(17, p, torch.device("cpu")).split_k == 1


H200_SMEM = 232_448  # shared_memory_per_block_optin on an H200


def test_configs_fit_the_shared_memory(monkeypatch):
    """choose_config shrinks configs until `smem_estimate` fits the device, for every dtype and group
    size (the weights stay in registers: only x's operand tiles and the epilogue use shared memory)."""
    monkeypatch.setattr(wq_mm_module, "_smem_limit", lambda device: H200_SMEM)
    for layout in ("int4-g32", "int4-g128", "int8-g128", "int8"):
        _, p = _packed(layout, 512, 512)
        for M in (1, 16, 17, 128, 2048):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                cfg = choose_config(M, p, torch.device("cpu"), dtype)
                assert smem_estimate(cfg, dtype.itemsize, p.bits) <= H200_SMEM, (layout, M, dtype, cfg)
    monkeypatch.setattr(wq_mm_module, "_smem_limit", lambda device: 4096)
    assert choose_config(64, p, torch.device("cpu")).block_m == 16  # shrunk: 64 rows need 40 KB


def test_launch_shrinks_a_config_triton_refuses(monkeypatch):
    """If Triton still refuses a chosen config (its needs differ by version), wq_mm retries smaller
    configs; an explicit config is the caller's and its failure is raised."""
    _, p = _packed("int4-g64", 48, 128)
    x = torch.randn(40, 128)
    real, tried = wq_mm_module._launch, []

    def launch(x, w, y, cfg):
        tried.append(cfg)
        if cfg.block_m > 16:
            raise OutOfResources(300_000, H200_SMEM, "shared memory")
        real(x, w, y, cfg)

    monkeypatch.setattr(wq_mm_module, "_launch", launch)
    dev = "cpu" if interpreting() else "cuda"  # without the interpreter, the compiled kernel on the GPU
    p = p.to(dev)
    _check(wq_mm(x.to(dev), p), wq_mm_ref(x, p.to("cpu")), torch.float32)
    assert tried[-1].block_m == 16 and len(tried) > 1
    with pytest.raises(OutOfResources):
        wq_mm(x.to(dev), p, LaunchConfig(64))


def test_configs_are_chosen_once_per_bucket(monkeypatch):
    """An eager call reuses the config the weight's last call of the same row bucket launched: M = 1
    and 16 share decode's, M = 20 gets the 64-row tiles'; a config a launch had to shrink is kept
    shrunk."""
    _, p = _packed("int4-g64", 48, 128)
    dev = "cpu" if interpreting() else "cuda"
    p = p.to(dev)
    chosen, real = [], wq_mm_module.choose_config
    monkeypatch.setattr(wq_mm_module, "choose_config", lambda M, *a: chosen.append(M) or real(M, *a))
    for M in (1, 16, 5, 20, 40):
        wq_mm(torch.randn(M, 128, dtype=torch.float16).to(dev), p)
    assert chosen == [1, 20]
    real_launch = wq_mm_module._launch

    def launch(x, w, y, cfg):
        if cfg.block_m > 16:
            raise OutOfResources(300_000, H200_SMEM, "shared memory")
        real_launch(x, w, y, cfg)

    monkeypatch.setattr(wq_mm_module, "_launch", launch)
    _, q = _packed("int4-g64", 48, 128)
    q = q.to(dev)
    wq_mm(torch.randn(20, 128, dtype=torch.float16).to(dev), q)
    assert [c.block_m for c in q.configs.values()] == [16]


def test_bad_inputs_are_clear_errors():
    _, p = _packed("int4-g32", 8, 64)
    with pytest.raises(ValueError, match="expected \\[M, 64\\]"):
        wq_mm(torch.randn(2, 63, dtype=torch.float16), p)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        wq_mm(torch.randn(2, 64).to(torch.float64), p)
    with pytest.raises(ValueError, match="groups of 32"):
        wq_pack_int4(torch.zeros(8, 48, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.half), None, 32, 48)
    with pytest.raises(ValueError, match="one 128-row tile with 4 warps"):
        wq_mm(torch.randn(2, 64, dtype=torch.float16), p, LaunchConfig(16, block_n=64))
    with pytest.raises(ValueError, match="unknown form"):
        wq_mm(torch.randn(2, 64, dtype=torch.float16), p, LaunchConfig(16, form="nib"))
