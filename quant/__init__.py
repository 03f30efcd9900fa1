"""Weight formats. One module per format; `quantize_weight` (quant/weight.py) picks by spec.

The names below load on first use (PEP 562), so that importing `lowbit.quant.kv` — the KV formats
the command line lists — does not import torch: `lowbit --help` then answers in about 0.3 s, not 4.
"""

from __future__ import annotations

import importlib

_HOMES = {"BnbWeight": "bnb", "FloatWeight": "dense", "Int4Weight": "int4", "Int8Weight": "int8",
          "WeightSpec": "spec", "parse_weights": "spec", "Weight": "weight", "quantize_weight": "weight"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'lowbit.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lowbit.quant.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
