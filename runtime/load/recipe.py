"""A recipe: one layout per weight matrix and one KV format per attention layer, chosen by `lowbit fit`
(runtime/eval/fit.py) for a memory budget and run by `--recipe recipe.json` (serve, run, chat, eval).

The file is JSON, written by `write` and read back by `read`:

    {"lowbit_recipe": 1,
     "model": "SmolLM2-135M-Instruct.Q4_1.gguf",      the file it was fitted to (a note: the tensors decide)
     "weights": {"default": "auto", "layers.3.wq": "int4-g128", ...},   layout per matrix; the rest at default
     "kv": ["k8v4", "k16v4", ...],                    one per attention layer (quant/kv.py side_format)
     "ctx": 8192, "memory_bytes": 120000000,          what it was fitted to
     "predicted": {"kl": ..., "weight_bytes": ..., "kv_bytes": ...}, "measured": {"kl": ..., ...}}

A model is built from a recipe as from one layout (runtime/load/loader.py load): each weight is read from the
file at its own layout when the model asks for it (a GGUF's LazyWeights), so the peak is the model plus one
layer in transit, whatever the number of layouts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lowbit.quant.kv import parse_kv_format
from lowbit.runtime.errors import LowbitError

VERSION = 1


@dataclass
class Recipe:
    model: str  # the file's name it was fitted to
    default: str  # the layout of every matrix `layouts` does not name ("auto": as the file stores it)
    layouts: dict[str, str]  # weight name ("layers.3.wq") → layout
    kv: list[str]  # one KV format name per attention layer, in order
    ctx: int | None = None
    memory_bytes: int | None = None
    predicted: dict = field(default_factory=dict)  # {"kl", "weight_bytes", "kv_bytes"}: first order
    measured: dict = field(default_factory=dict)  # the built recipe scored against the reference
    name: str = ""  # the file it was read from, for messages and `weights` in /v1/models

    def layout_of(self, name: str) -> str:
        return self.layouts.get(name, self.default)

    @property
    def used(self) -> list[str]:
        """Every layout the recipe takes weights at, the default first."""
        return list(dict.fromkeys([self.default, *self.layouts.values()]))

    def as_dict(self) -> dict:
        return {"lowbit_recipe": VERSION, "model": self.model, "weights": {"default": self.default, **self.layouts},
                "kv": self.kv, "ctx": self.ctx, "memory_bytes": self.memory_bytes, "predicted": self.predicted,
                "measured": self.measured}


def write(recipe: Recipe, path: Path) -> None:
    path.write_text(json.dumps(recipe.as_dict(), indent=1) + "\n")


def read(path: str | Path) -> Recipe:
    """The recipe in `path`; a one-line LowbitError for a missing, malformed or wrong-shaped file (the layouts'
    and KV formats' names are checked here, the tensor names against the model by `check`)."""
    from lowbit.quant import parse_weights

    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise LowbitError(f"--recipe: cannot read {p}: {e.strerror or e}") from None
    except ValueError as e:
        raise LowbitError(f"--recipe: {p} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("lowbit_recipe") != VERSION:
        raise LowbitError(f"--recipe: {p} is not a lowbit recipe (version {VERSION}; `lowbit fit --out` writes one)")
    weights, kv = doc.get("weights"), doc.get("kv")
    if not isinstance(weights, dict) or not all(isinstance(v, str) for v in weights.values()) \
            or not isinstance(kv, list) or not all(isinstance(k, str) for k in kv):
        raise LowbitError(f"--recipe: {p}: 'weights' must map names to layouts and 'kv' list format names")
    layouts = dict(weights)
    default = layouts.pop("default", "auto")
    for name in {default, *layouts.values()}:
        if name != "auto":
            try:
                parse_weights(name)
            except ValueError as e:
                raise LowbitError(f"--recipe: {p}: {e}") from None
    for name in kv:
        try:
            parse_kv_format(name)
        except ValueError as e:
            raise LowbitError(f"--recipe: {p}: {e}") from None
    return Recipe(str(doc.get("model", "")), default, layouts, list(kv), doc.get("ctx"), doc.get("memory_bytes"),
                  doc.get("predicted") or {}, doc.get("measured") or {}, p.name)


def check(recipe: Recipe, names, n_kv_layers: int, model: str) -> None:
    """A one-line LowbitError when the recipe does not fit the model: a weight it names that the model lacks,
    or another number of KV layers. names: the model's weight names."""
    unknown = sorted(set(recipe.layouts) - set(names))
    if unknown:
        more = f" and {len(unknown) - 1} more" if len(unknown) > 1 else ""
        raise LowbitError(f"--recipe names {unknown[0]}{more}, which {model} does not have (it was fitted to "
                          f"{recipe.model or 'another model'})")
    if recipe.kv and len(recipe.kv) != n_kv_layers:
        raise LowbitError(f"--recipe has {len(recipe.kv)} KV layer formats; {model} has {n_kv_layers} attention "
                          f"layers (it was fitted to {recipe.model or 'another model'})")


class Chosen(Mapping):
    """Weights by name taken from `default` but the names in `override`, each from its own mapping: a recipe's
    model (one mapping per layout), or `lowbit eval --attribute`'s model with some tensors at the candidate's
    layout. Each value is read from its source when asked for, as a load reads."""

    def __init__(self, default: Mapping, override: Mapping[str, Mapping]):
        self.default, self.override, self._names = default, override, list(default)

    def __getitem__(self, name: str):
        return self.override.get(name, self.default)[name]

    def __contains__(self, name) -> bool:  # Mapping's would read the value (a LazyWeights reads the file)
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def chosen(recipe: Recipe, sources: Mapping[str, Mapping]) -> Chosen:
    """The recipe's weights from one mapping per layout it uses (sources: layout → weights by name)."""
    return Chosen(sources[recipe.default], {k: sources[v] for k, v in recipe.layouts.items() if v != recipe.default})
