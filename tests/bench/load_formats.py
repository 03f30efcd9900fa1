"""Load time and bytes held for GGUF files of every common type, against the default model's Q4_1 file.

    python tests/bench/load_formats.py [--dir DIR] [--reps 5]

Makes the files as tests/test_ggml_kquants.py does (the default model written to F32 with gguf's
writer, then llama.cpp's quantizer: Q4_K_M, Q5_K_M, Q3_K_S, Q2_K pure, IQ4_XS) into --dir unless they
are there, then loads each with `--weights auto` on the CPU, --reps times interleaved with the Q4_1
file (lowbit's loader, C kernels on), and prints the median load seconds, the ratio to Q4_1's, and the
weight bytes held against the file's tensor bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.test_ggml_kquants' file makers

from lowbit.runtime.load.gguf import gguf_tensor_bytes, gguf_tensor_types  # noqa: E402
from lowbit.runtime.load.loader import load  # noqa: E402
from lowbit.runtime.load.registry import resolve  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/lowbit-kquants"), help="where the files are made")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from tests.test_ggml_kquants import MIXES, quantize, write_f32_gguf

    base = resolve(None)
    args.dir.mkdir(parents=True, exist_ok=True)
    f32 = args.dir / "f32.gguf"
    files = {"Q4_1 (default)": base}
    for name, (ftype, pure) in MIXES.items():
        path = args.dir / f"{name}.gguf"
        if not path.exists():
            if not f32.exists():
                write_f32_gguf(base, f32)
            quantize(f32, path, ftype, pure)
        files[name] = path
    times: dict[str, list[float]] = {k: [] for k in files}
    held: dict[str, int] = {}
    for _ in range(args.reps):
        for name, path in files.items():
            lm = load(str(path), "auto", progress=False, device="cpu")
            times[name].append(lm.load_seconds)
            held[name] = lm.weight_bytes
            del lm
    q41 = statistics.median(times["Q4_1 (default)"])
    print(f"{'file':<16} {'load s':>7} {'vs Q4_1':>8} {'held / file bytes':>18}  tensor types")
    for name, path in files.items():
        t = statistics.median(times[name])
        types = ", ".join(f"{k} {n}" for k, (n, _) in gguf_tensor_types(path).items())
        print(f"{name:<16} {t:7.2f} {t / q41:7.2f}x {held[name] / gguf_tensor_bytes(path):17.3f}x  {types}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
