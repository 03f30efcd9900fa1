"""Random-weight GGUF files in the shapes people run, made once and kept: what tests/bench/real_sizes.py
measures. Written tensor by tensor with gguf's writer (an 8B F16 never sits in memory: one matrix at a
time, ~235 MB at most), then quantized by llama.cpp's own quantizer (llama_cpp.llama_model_quantize)
with its defaults for the file type, so each file holds the type mix a downloaded one holds (Q4_K_M:
Q4_K, Q6_K for the output, half the attn_v and ffn_down).

    python tests/bench/real_models.py [--models 8b:Q4_K_M,1.7b:Q4_K_M,1.7b:Q4_0] [--dir DIR] [--threads 2]

Shapes (the vocabulary is the default model's tokenizer, 49,152 tokens, whose metadata is copied):

    8b    Llama-3-8B's: dim 4096, 32 layers, 32 heads / 8 KV heads of 128, FFN 14336, untied output,
          rope base 500000, context 8192 (the F16 is 15 GB on disk; Q4_K_M 4.35 GB)
    1.7b  SmolLM2-1.7B's: dim 2048, 24 layers, 32 / 32 heads of 64, FFN 8192, tied embeddings, rope
          base 130000, context 8192
    qwen3-8b   Qwen3-8B's (architecture qwen3): dim 4096, 36 layers, 32 / 8 heads of 128 with per-head
          q/k norms, FFN 12288, untied, rope base 1e6 — within 0.5% of the 8b file's bytes, so the 8b
          Llama shape is its same-bytes twin
    gemma3-4b  Gemma-3-4B's (architecture gemma3): dim 2560, 34 layers, 8 / 4 heads of 256, q/k norms,
          four norms a block, GeGLU, tied, 5 local layers (window 1024) per global one
    4b    the same shapes as gemma3-4b as a plain Llama block: its same-bytes twin
    qwen3.5-4b  Qwen3.5-4B's (architecture qwen35), 8 of its 32 layers: dim 2560, FFN 9216, tied; layers 0-2, 4-6
          Gated DeltaNet (16 key / 32 value heads of 128, conv 4), 3 and 7 gated attention (16 / 4 heads of 256,
          q/k norms, rotary on 64 of 256 dims)
    qwen3-30b-a3b  Qwen3-30B-A3B's (architecture qwen3moe), 8 of its 48 layers: dim 2048, 32 / 4 heads of
          128 with q/k norms, 128 experts of 768 columns, 8 per token (F32 router), untied, rope base 1e6
    gpt-oss-20b  gpt-oss-20b's (architecture gpt-oss), 4 of its 24 layers: dim 2880, 64 / 8 heads of 64 with
          sinks and biases, window 128 on every other layer, 32 experts of 2880 columns (biases), 4 per
          token; made for MXFP4_MOE (experts MXFP4 as llama.cpp's quantizer writes them, the rest Q8_0)

Weights: seed 0, N(0, 0.02) (norms 1), generated a matrix at a time. Speed and memory depend on the
shapes and the layouts only; no claim about quality is made on these files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SHAPES = {
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden=14336, tied=False,
               rope_base=500000.0, name="Llama-3-8B"),
    "1.7b": dict(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, head_dim=64, hidden=8192, tied=True,
                 rope_base=130000.0, name="SmolLM2-1.7B"),
    # the families of models/families.py at their real sizes, and a Llama-shaped twin of the same bytes
    "qwen3-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden=12288, tied=False,
                     rope_base=1e6, name="Qwen3-8B", arch="qwen3", qk_norm=True),
    "gemma3-4b": dict(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, hidden=10240, tied=True,
                      rope_base=1e6, name="Gemma-3-4B", arch="gemma3", qk_norm=True, sandwich=True, window=1024),
    "4b": dict(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, hidden=10240, tied=True,
               rope_base=1e6, name="Gemma-3-4B shapes as a Llama block"),
    # mixture of experts: 8 of the real 48 layers (the whole F16 would be 61 GB); per-token ratios do not
    # depend on the layer count
    "qwen3-30b-a3b": dict(dim=2048, n_layers=8, n_heads=32, n_kv_heads=4, head_dim=128, hidden=6144, tied=False,
                          rope_base=1e6, name="Qwen3-30B-A3B (8 of 48 layers)", arch="qwen3moe", qk_norm=True,
                          experts=(128, 8, 768)),
    # 4 of gpt-oss-20b's 24 layers: dim 2880, 64 / 8 heads of 64 with sinks and biases, window 128 on every other
    # layer, 32 experts of 2880 columns with biases, 4 per token; MXFP4_MOE: experts MXFP4, the rest Q8_0
    "gpt-oss-20b": dict(dim=2880, n_layers=4, n_heads=64, n_kv_heads=8, head_dim=64, hidden=2880, tied=False,
                        rope_base=150000.0, name="gpt-oss-20b (4 of 24 layers)", arch="gpt-oss", window=128,
                        experts=(32, 4, 2880), oss=True),
    # 8 of Qwen3.5-4B's 32 layers (architecture qwen35; a Q4_K_M of all 32 takes ~25 min to write and quantize on 2
    # cores): dim 2560, FFN 9216, tied; three layers in four Gated DeltaNet (16 key heads, 32 value heads of 128,
    # conv 4), the fourth gated attention (16 / 4 heads of 256, q/k norms, rotary on 64 dims, rope base 1e7)
    "qwen3.5-4b": dict(dim=2560, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=256, hidden=9216, tied=True,
                       rope_base=1e7, name="Qwen3.5-4B (8 of 32 layers)", arch="qwen35", qk_norm=True,
                       deltanet=(16, 32, 128, 4)),
}
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18,  # llama.h LLAMA_FTYPE_MOSTLY_*
          "MXFP4_MOE": 38}
CONTEXT = 8192


def default_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("lowbit")) / "bench"


def _recurrent(s: dict, i: int) -> bool:
    """Whether layer i is a Gated DeltaNet layer (qwen35: three in four, as llama.cpp's full_attention_interval 4)."""
    return bool(s.get("deltanet")) and (i + 1) % 4 != 0


def _matrices(s: dict) -> list[tuple[str, tuple[int, int]]]:
    """Every 2-D tensor of the model in file order: (name, (rows, cols))."""
    D, H, Hkv, hd, F = s["dim"], s["n_heads"], s["n_kv_heads"], s["head_dim"], s["hidden"]
    out = []
    for i in range(s["n_layers"]):
        b = f"blk.{i}."
        if _recurrent(s, i):  # in projections qkv [C, D], z [Hv Dv, D], beta and alpha [Hv, D]; out [D, Hv Dv]
            Hk, Hv, Dh, _ = s["deltanet"]
            out += [(b + "attn_qkv.weight", ((2 * Hk + Hv) * Dh, D)), (b + "attn_gate.weight", (Hv * Dh, D)),
                    (b + "ssm_beta.weight", (Hv, D)), (b + "ssm_alpha.weight", (Hv, D)),
                    (b + "ssm_out.weight", (D, Hv * Dh))]
        else:  # qwen35's attn_q holds each head's query and its gate: twice the rows
            q_rows = H * hd * (2 if s.get("deltanet") else 1)
            out += [(b + "attn_q.weight", (q_rows, D)), (b + "attn_k.weight", (Hkv * hd, D)),
                    (b + "attn_v.weight", (Hkv * hd, D)), (b + "attn_output.weight", (D, H * hd))]
        if s.get("experts"):  # E matrices each, one 3-D tensor [E, rows, cols]
            E, _, I = s["experts"]
            out += [(b + "ffn_gate_exps.weight", (E, I, D)), (b + "ffn_up_exps.weight", (E, I, D)),
                    (b + "ffn_down_exps.weight", (E, D, I))]
        else:
            out += [(b + "ffn_gate.weight", (F, D)), (b + "ffn_up.weight", (F, D)), (b + "ffn_down.weight", (D, F))]
    return out


def write_f16(path: Path, shape: str, tokenizer_gguf: Path) -> None:
    """The shape's model with random weights and the given file's tokenizer → an F16 GGUF, one tensor
    in memory at a time (gguf's writer: tensor infos first, then each tensor's data in order)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    s = SHAPES[shape]
    vocab = None
    rng = np.random.default_rng(0)
    part = Path(str(path) + ".part")
    w = GGUFWriter(str(part), s.get("arch", "llama"))
    w.add_name(f"random {s['name']} shapes")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(s["dim"])
    w.add_block_count(s["n_layers"])
    w.add_feed_forward_length(s["hidden"])
    w.add_head_count(s["n_heads"])
    w.add_head_count_kv(s["n_kv_heads"])
    w.add_rope_dimension_count(s["head_dim"] // 4 if s.get("deltanet") else s["head_dim"])  # qwen35: rotary on 1/4
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    if s.get("window"):
        w.add_sliding_window(s["window"])
    if s.get("experts"):
        w.add_expert_count(s["experts"][0])
        w.add_expert_used_count(s["experts"][1])
        w.add_expert_feed_forward_length(s["experts"][2])
    w.add_rope_freq_base(s["rope_base"])
    if s.get("deltanet"):  # the keys llama.cpp's qwen35 loader reads (conversion/qwen.py writes them)
        Hk, Hv, Dh, K = s["deltanet"]
        w.add_ssm_conv_kernel(K)
        w.add_ssm_state_size(Dh)
        w.add_ssm_group_count(Hk)
        w.add_ssm_time_step_rank(Hv)
        w.add_ssm_inner_size(Hv * Dh)
        w.add_full_attention_interval(4)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # MOSTLY_F16
    for name, field in GGUFReader(str(tokenizer_gguf)).fields.items():
        if name.startswith("tokenizer."):
            types = field.types
            sub = types[1] if types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), types[0], sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                vocab = len(field.contents())
    D = s["dim"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, D)), ("output_norm.weight", (D,))]
    if not s["tied"]:
        tensors.append(("output.weight", (vocab, D)))
    oss = s.get("oss")  # gpt-oss: its MLP norm's name, sinks, and biases on attention, router and experts
    for i in range(s["n_layers"]):
        b = f"blk.{i}."
        mlp_norm = "post_attention_norm" if oss or s.get("deltanet") else "ffn_norm"
        tensors += [(b + "attn_norm.weight", (D,)), (b + mlp_norm + ".weight", (D,))]
        if _recurrent(s, i):  # conv [C, K] (F32), dt bias, A (0 here: no decay) [Hv], the gated norm [Dv]
            Hk, Hv, Dh, K = s["deltanet"]
            tensors += [(b + "ssm_conv1d.weight", ((2 * Hk + Hv) * Dh, K)), (b + "ssm_dt.bias", (Hv,)),
                        (b + "ssm_a", (Hv,)), (b + "ssm_norm.weight", (Dh,))]
        if oss:
            E, _, I = s["experts"]
            H, Hkv, hd = s["n_heads"], s["n_kv_heads"], s["head_dim"]
            tensors += [(b + "attn_sinks.weight", (H,)), (b + "attn_q.bias", (H * hd,)), (b + "attn_k.bias", (Hkv * hd,)),
                        (b + "attn_v.bias", (Hkv * hd,)), (b + "attn_output.bias", (D,)), (b + "ffn_gate_inp.bias", (E,)),
                        (b + "ffn_gate_exps.bias", (E, I)), (b + "ffn_up_exps.bias", (E, I)),
                        (b + "ffn_down_exps.bias", (E, D))]
        if s.get("qk_norm") and not _recurrent(s, i):
            tensors += [(f"blk.{i}.attn_{n}_norm.weight", (s["head_dim"],)) for n in "qk"]
        if s.get("sandwich"):
            tensors += [(f"blk.{i}.post_attention_norm.weight", (D,)), (f"blk.{i}.post_ffw_norm.weight", (D,))]
        if s.get("experts"):  # the router: F32, as llama.cpp's converter writes it and its quantizer keeps it
            tensors.append((f"blk.{i}.ffn_gate_inp.weight", (s["experts"][0], D)))
    tensors += _matrices(s)
    F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32

    def is_f32(name, shp):
        return len(shp) == 1 or "ffn_gate_inp" in name or name.endswith(".bias") or "ssm_conv1d" in name

    for name, shp in tensors:
        dtype = np.float32 if is_f32(name, shp) else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize,
                          raw_dtype=F32 if is_f32(name, shp) else F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shp) in enumerate(tensors):
        if len(shp) == 1 or name.endswith(".bias"):  # norms 1; biases and sinks 0 (no claim on quality here)
            data = np.full(shp, 1.0 if name.endswith("norm.weight") else 0.0, np.float32)
        else:
            data = np.empty(shp, np.float32 if is_f32(name, shp) else np.float16)
            rows = data.reshape(-1, shp[-1])  # [E * N, K] for an expert tensor
            for r in range(0, rows.shape[0], 4096):  # ~4096 rows of f32 at a time
                rows[r:r + 4096] = rng.standard_normal((min(4096, rows.shape[0] - r), shp[-1]), dtype=np.float32) * 0.02
        w.write_tensor_data(data)
        print(f"\r  {i + 1}/{len(tensors)} tensors", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    w.close()
    part.rename(path)


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> None:
    """llama.cpp's quantizer with its defaults for `ftype` (llama_model_quantize_default_params)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    tmp = Path(str(dst) + ".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        sys.exit(f"llama.cpp could not quantize {src} to {ftype}")
    tmp.rename(dst)


def model_file(shape: str, ftype: str, directory: Path | None = None, threads: int = 2,
               keep_f16: bool = True) -> Path:
    """The quantized file for (shape, ftype), made (F16, then llama.cpp's quantizer) unless it exists."""
    from lowbit.runtime.load.registry import resolve

    if shape not in SHAPES:
        sys.exit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if ftype not in FTYPES:
        sys.exit(f"unknown file type {ftype!r}; choose from {', '.join(FTYPES)}")
    directory = directory or default_dir()
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{shape}-shapes.{ftype}.gguf"
    if out.exists():
        return out
    src = directory / f"{shape}-shapes.F16.gguf"
    if not src.exists():
        print(f"writing {src} (random weights, once)", file=sys.stderr, flush=True)
        write_f16(src, shape, resolve("smollm2-135m"))
    print(f"quantizing {src.name} to {ftype} with llama.cpp's quantizer (once)", file=sys.stderr, flush=True)
    quantize(src, out, ftype, threads)
    if not keep_f16:
        src.unlink()
    return out


def parse_models(spec: str) -> list[tuple[str, str]]:
    """"8b:Q4_K_M,1.7b:Q4_0" → [("8b", "Q4_K_M"), ("1.7b", "Q4_0")]."""
    out = []
    for item in spec.split(","):
        if item.strip():
            shape, _, ftype = item.strip().partition(":")
            out.append((shape, ftype or "Q4_K_M"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--models", default="8b:Q4_K_M,1.7b:Q4_K_M,1.7b:Q4_0", help="shape:ftype, comma-separated")
    ap.add_argument("--dir", type=Path, default=None, help="where the files are made and kept")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    for shape, ftype in parse_models(a.models):
        print(model_file(shape, ftype, a.dir, a.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
