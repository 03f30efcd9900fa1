"""lowbit's CPU matmul for decode-sized inputs, in C (kernels/cpu_wq_mm.c): built on first use,
called through ctypes.

Why C, in a package otherwise made of torch and Triton: torch's fused CPU weight-only kernels
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) take bf16 activations and their cost grows
with every row, which is what speculative verification (1 + k rows) and batched decoding feed them.
Measured on this project's 2-core AVX2 machine (torch 2.13, 2 threads, warm caches, median of
5 x 100 calls), torch against C:

    1728x576 int4-g32   M = 1: 91 / 83 us    M = 5: 342 / 168 us    M = 8: 335 / 281 us
    576x1536 int4-g32   M = 1: 83 / 72 us    M = 5: 309 / 143 us
    49152x576 Q8_0      M = 1: 5.3 / 4.4 ms  M = 5: 22.8 / 11.4 ms  (the default model's LM head)

The C kernel unpacks a group's codes once for all rows (8 rows per pass), computes in fp32 with the
exact fp16 scales (no bf16 rounding of activations: decoding gets closer to the exact model), and
reads the weights in the layouts lowbit already holds, so nothing is repacked or copied. Each
output row's arithmetic is independent of the other rows (tests/test_cpu_native.py checks it bit for
bit), which speculative decoding needs.

Building: `cc -O3 -march=native -fopenmp -shared` into the user cache directory (platformdirs),
keyed by the source, the compiler and the CPU's flags, so a new source or another CPU rebuilds
(under a second). OpenMP: torch's wheel ships `libgomp.so.1` and has loaded it before this
library is opened, so both share one OpenMP runtime and its thread pool (two runtimes would spin
against each other on 2 cores).

Without a C compiler, without AVX2/FMA/F16C, or with LOWBIT_NATIVE=0 (side-by-side benchmarks),
`native()` returns None and the callers use torch's kernels: the same results to fp32 rounding,
only slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_wq_mm.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class NativeKernels:
    """The loaded library; methods check shapes, allocate the output and call in."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.lowbit_int4_mm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
        lib.lowbit_int8_mm.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int]

    def int4_mm(self, x: torch.Tensor, packed: torch.Tensor, scale_min: torch.Tensor, group_size: int) -> torch.Tensor:
        """x fp32 [M, Kp]; packed uint8 (torch 2.13's CPU tile layout of [Np, Kp] codes);
        scale_min fp16 [G, Np, P] → y fp32 [M, Np]."""
        M, K = x.shape
        G, Np, P = scale_min.shape
        _check(M, x, G * group_size == K and packed.numel() * 2 == Np * K and packed.is_contiguous()
               and scale_min.is_contiguous() and scale_min.dtype == torch.float16)
        x = x.contiguous()
        xs = torch.empty(M, G)  # group sums of x, scratch
        y = torch.empty(M, Np)
        rc = self.lib.lowbit_int4_mm(x.data_ptr(), M, K, packed.data_ptr(), scale_min.data_ptr(), P, Np, group_size,
                                     xs.data_ptr(), y.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"cpu int4 kernel refused M={M} K={K} Np={Np} group={group_size}")
        return y

    def int8_mm(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x fp32 [M, G*g]; qweight int8 [G, N, g]; scales fp16 [N, G] or fp32 [N, G] → y fp32 [M, N]."""
        M = x.shape[0]
        G, N, g = qweight.shape
        _check(M, x, x.shape[1] == G * g and tuple(scales.shape) == (N, G)
               and scales.dtype in (torch.float16, torch.float32) and scales.is_contiguous()
               and qweight.is_contiguous())
        x = x.contiguous()
        y = torch.empty(M, N)
        rc = self.lib.lowbit_int8_mm(x.data_ptr(), M, G, N, g, qweight.data_ptr(), scales.data_ptr(),
                                     int(scales.dtype == torch.float32), y.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"cpu int8 kernel refused M={M} N={N} G={G} g={g}")
        return y


def _check(M: int, x: torch.Tensor, shapes_ok: bool) -> None:
    if M < 1 or x.dtype != torch.float32 or x.device.type != "cpu" or not shapes_ok:
        raise ValueError(f"cpu native matmul: unsupported input {tuple(x.shape)} {x.dtype}")


@functools.lru_cache(maxsize=1)
def native() -> NativeKernels | None:
    """The built kernels, or None (no compiler, a failed build, a CPU without AVX2/FMA/F16C,
    LOWBIT_NATIVE=0). Built once per process; the .so is reused across processes."""
    if os.environ.get("LOWBIT_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
        if not lib.lowbit_native_ok():
            return None  # compiled without AVX2/FMA/F16C: torch's kernels are the faster choice
        return NativeKernels(lib)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        warnings.warn(f"lowbit's C decode kernels are unavailable ({e}); using torch's CPU kernels", RuntimeWarning,
                      stacklevel=2)
        return None


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(src + version.encode() + " ".join(_FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    import platformdirs  # here, not at import: kernels stay importable without it

    out = Path(platformdirs.user_cache_dir("lowbit")) / "native" / f"cpu_wq_mm-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then rename: concurrent builds are safe
        so = Path(tmp) / out.name
        r = subprocess.run([cc, *_FLAGS, str(SOURCE), "-o", str(so)], capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        os.replace(so, out)
    return out


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags (Linux), else the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()
