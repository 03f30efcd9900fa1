"""Whether a model's weights fit the memory of the device it is loaded on, checked before a byte of them
is read: a 30B mixture of experts (17 GB in Q4_K_M) on a 16 GB machine should fail in one line naming
what it needs and what there is, not after minutes of loading with the machine swapping, or killed by
the kernel's OOM killer with no message at all.

What is counted: the bytes of the weight tensors lowbit will hold. A GGUF loaded as it is (`auto`) holds its
tensors at the file's size (≤ 1.02x, tests/test_families.py); another layout is estimated from the element
count at that layout's bits per weight. The KV cache comes after, from what is left (--kv-memory).
"""

from __future__ import annotations

from pathlib import Path

from lowbit.quant import WeightSpec

GIB = 1 << 30


def available_bytes(device: str) -> int | None:
    """Memory a load can take on `device` now: the CPU's MemAvailable (Linux: free plus reclaimable page
    cache, the kernel's own estimate), or the GPU's free memory; None where it cannot be told."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def spec_bytes(n_elements: int, spec: WeightSpec) -> int:
    """A matrix's bytes in `spec`'s layout: its codes plus a 16-bit scale (and min, asymmetric int4) per group."""
    if not spec.quantized:
        return n_elements * spec.bits // 8
    per_group = 2 if spec.bits == 8 or getattr(spec, "symmetric", False) else 4
    groups = n_elements // spec.group_size if spec.group_size else 0
    return n_elements * spec.bits // 8 + groups * per_group


def check_fits(what: str, needed: int, device: str) -> None:
    """Raise ValueError in one line when `needed` weight bytes exceed what `device` has available."""
    have = available_bytes(device)
    if have is not None and needed > have:
        where = "the GPU" if device.startswith("cuda") else "this machine"
        raise ValueError(f"{what}: the weights need {needed / GIB:.1f} GiB but {where} has {have / GIB:.1f} GiB "
                         f"available; use a smaller file (fewer bits per weight) or free memory")
