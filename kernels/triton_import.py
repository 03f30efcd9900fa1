"""Triton, or a stand-in where it is not installed.

Triton comes with CUDA builds of torch and with the test extra; a CPU-only install has no use for
it. Kernel modules import `triton` and `tl` from here so that they — and their plain-torch `_ref`
functions, which the CPU backend runs — import either way; only launching a kernel needs Triton.
"""

from __future__ import annotations

import os
import types

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

    class OutOfResources(Exception):  # never raised: nothing launches without Triton
        pass

    class _Unavailable:
        def __init__(self, name: str):
            self.__name__ = name

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.__name__} needs Triton, which is not installed (pip install triton)")

    def _jit(fn=None, **_):
        return _Unavailable(fn.__name__) if fn is not None else _jit

    triton = types.SimpleNamespace(jit=_jit, constexpr_function=lambda fn: fn, cdiv=lambda a, b: -(-a // b),
                                   next_power_of_2=lambda n: 1 << max(0, int(n) - 1).bit_length())
    class _Constexpr:  # an annotation of kernel arguments, and the wrapper of module-level constants (PTX)
        def __init__(self, value=None):
            self.value = value

    tl = types.SimpleNamespace(constexpr=_Constexpr)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1), which
    the tests use to check every kernel without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter; anything else is a
    caller's mistake worth one clear line."""
    for t in tensors:
        if t is not None and t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
            raise ValueError(f"Triton kernels need CUDA tensors (got {t.device}); CPU runs torch's kernels")
