"""Model reference → a ready model + tokenizer: resolve, read (GGUF or safetensors), build."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.models.backend import select_backend
from lowbit.models.config import LlamaConfig
from lowbit.models.llama import Llama
from lowbit.models.sharding import Shard, TPGroup, shard_weights
from lowbit.quant import parse_weights
from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.registry import resolve
from lowbit.runtime.load.sampling_defaults import gguf_defaults, hf_defaults
from lowbit.runtime.load.tokenizer import Tokenizer

DEFAULT_HF_WEIGHTS = "int4-g32"


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: Tokenizer
    config: LlamaConfig
    path: Path
    source: str  # "gguf" | "safetensors"
    weights: str  # the --weights the model was loaded with
    load_seconds: float
    # the model's own sampling defaults (runtime/load/sampling_defaults.py): SamplingParams fields
    sampling: dict = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        """Bytes held by the model's tensors (shared tensors counted once)."""
        return sum(b.numel() * b.element_size() for b in self.model.buffers())


# A load shorter than this shows no bar (the default model: ~1 s); an 8B one, or a first read from disk,
# shows its layers going by.
PROGRESS_DELAY_S = 2.0


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "layer"):
    """→ (update(n done), close) of a tqdm bar on stderr that shows only once PROGRESS_DELAY_S have gone by."""
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, delay=PROGRESS_DELAY_S)
    return (lambda n: bar.update(n - bar.n)), bar.close


def load(ref: str | None, weights: str = "auto", progress: bool | None = None, device: str = "auto",
         dtype: str = "float16", shard: Shard | None = None, backend=None, recipe=None) -> LoadedModel:
    """weights: `auto` (GGUF: lossless native layouts; safetensors: int4-g32) or a layout name.
    recipe: a runtime/load/recipe.py Recipe (`lowbit fit`'s), which names each matrix's layout in place of
    `weights`; its KV formats are the engine's to take (EngineConfig.kv_layers).
    device: auto (CUDA when there is a GPU and Triton) | cpu | cuda[:N]; dtype: the activations'
    on CUDA, float16 | bfloat16 (CPU computes in fp32). shard: build only this tensor-parallel
    rank's slice of the model (models/sharding.py; runtime/engine/tp.py starts the ranks). backend:
    the kernels to build the model on (models/backend.py), in place of the device's own choice."""
    if progress is None:
        progress = sys.stderr.isatty()
    try:
        backend = backend or select_backend(device, dtype)
    except (ValueError, RuntimeError) as e:
        raise LowbitError(str(e)) from None
    say = (lambda s: print(f"lowbit: {s}", file=sys.stderr)) if progress else None
    path = resolve(ref, progress=say)
    t0 = time.perf_counter()
    if recipe is not None and weights != "auto":
        raise LowbitError(f"--weights {weights} and --recipe: the recipe sets every tensor's layout; give one of them")
    try:
        spec = None if weights == "auto" else parse_weights(weights)
    except ValueError as e:
        raise LowbitError(str(e)) from None
    close = lambda: None  # noqa: E731 - the GGUF branch's bar, closed once the model is built
    if path.is_dir():
        from lowbit.runtime.load.safetensors import load_hf_dir

        spec = spec or parse_weights(DEFAULT_HF_WEIGHTS)
        try:
            tokenizer = Tokenizer.from_hf_dir(path)
        except ValueError as e:
            raise LowbitError(f"{path}: {e}") from None
        _check_fits(path, _hf_tensors(path), spec, backend, shard)
        n_layers = _hf_layers(path)
        update, close = progress_bar(n_layers, f"loading {path.name}", progress)
        try:
            config, w, cfg = load_hf_dir(path, spec, update)
            if recipe is not None:  # each layout's conversion held whole: a checkpoint is converted as it is read
                base = w
                w = _recipe_weights(recipe, lambda s: base if (s or spec) == spec else load_hf_dir(path, s or spec)[1])
        except ValueError as e:  # a layout that cannot hold this model (e.g. bnb-nf4 on odd widths)
            raise LowbitError(f"{path}: {e}") from None
        finally:
            close()
        qc = cfg.get("quantization_config")
        # a GPTQ/AWQ checkpoint keeps its own codes whatever quantized layout was asked for
        method = qc.get("quant_method") if isinstance(qc, dict) and spec.quantized else None
        source, used = "safetensors", f"{method} (as stored)" if method else spec.name
        sampling = hf_defaults(path)
    else:
        from lowbit.runtime.load.gguf_file import GGUFFile
        from lowbit.runtime.load.gguf import load_gguf

        gguf = GGUFFile(path)
        _check_fits(path, [(t.n_elements, len(t.shape) > 1, t.n_bytes) for t in gguf.tensors], spec, backend, shard)
        meta = gguf.metadata
        arch = meta.get("general.architecture")
        # the bar runs while the model is built: its weights are read then, a layer at a time (load_gguf)
        update, close = progress_bar(int(meta.get(f"{arch}.block_count", 0) or 0), f"loading {path.name}", progress)
        try:
            config, w, _ = load_gguf(gguf, spec, update, note=lambda s: print(f"lowbit: note: {s}", file=sys.stderr))
            if recipe is not None:  # every layout's weights read lazily: the peak is still the model + one layer
                base = w
                w = _recipe_weights(recipe, lambda s: base if s is None else load_gguf(gguf, s, update)[1])
        except ValueError as e:
            close()
            raise LowbitError(f"{path}: {e}") from None
        try:
            tokenizer = Tokenizer.from_gguf_metadata(meta)
        except ValueError as e:
            raise LowbitError(f"{path}: {e}") from None
        source, used = "gguf", weights
        sampling = gguf_defaults(meta)
    if recipe is not None:
        from lowbit.runtime.load.recipe import check

        check(recipe, w, config.n_kv_layers, path.name)
        used = f"recipe {recipe.name}"
    tp = None
    if shard is not None:
        try:
            w, tp = shard_weights(config, w, shard), TPGroup(shard)
        except ValueError as e:  # a split the model's shapes do not allow
            raise LowbitError(f"{path.name}: {e}") from None
    try:
        with torch.no_grad():
            model = Llama(config, w, backend, tp).eval()
    except (RuntimeError, ValueError) as e:  # e.g. a torch build whose int4 packing lowbit does not know
        raise LowbitError(f"{path}: cannot build the model: {str(e).splitlines()[0]}") from None
    except OSError as e:  # the file read as the weights are packed (a disk error, a file cut short since)
        raise LowbitError(f"{path}: cannot read the weights: {e}") from None
    finally:
        if not path.is_dir():
            close()
    del w
    return LoadedModel(model, tokenizer, config, path, source, used, time.perf_counter() - t0, sampling)


def _recipe_weights(recipe, weights_at):
    """The recipe's weights (runtime/load/recipe.py chosen): weights_at(spec) → the model's weights at that
    layout (spec None: `auto`)."""
    from lowbit.runtime.load.recipe import chosen

    return chosen(recipe, {name: weights_at(None if name == "auto" else parse_weights(name)) for name in recipe.used})


def _check_fits(path: Path, tensors: list[tuple[int, bool, int]], spec, backend, shard) -> None:
    """One line and no load when the weights cannot fit (runtime/load/fits.py). tensors: (elements, whether
    a matrix, bytes in the file); a GGUF kept as it is (spec None) holds the file's bytes, else a matrix
    takes the layout's bytes and a vector fp32."""
    from lowbit.runtime.load.fits import check_fits, spec_bytes

    needed = sum(b if spec is None else spec_bytes(n, spec) if matrix else 4 * n for n, matrix, b in tensors)
    try:
        check_fits(path.name, needed // (shard.world if shard is not None else 1), str(backend.device))
    except ValueError as e:
        raise LowbitError(str(e)) from None


def _hf_tensors(path: Path) -> list[tuple[int, bool, int]]:
    """(elements, whether a matrix, bytes) of each tensor in a checkpoint's shards, from the headers."""
    import math

    from safetensors import safe_open

    from lowbit.runtime.load.safetensors import shard_files

    out = []
    try:
        for f in shard_files(path):
            with safe_open(f, framework="pt") as h:
                for name in h.keys():
                    shape = h.get_slice(name).get_shape()
                    out.append((math.prod(shape), len(shape) > 1, 0))
    except Exception:  # an unreadable checkpoint: the loader itself says what is wrong, in its own words
        return []
    return out


def _hf_layers(path: Path) -> int:
    import json

    try:
        return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError):
        return 0


def weight_elements(path: Path) -> int:
    """Values in the checkpoint's tensors (a tied table once), from the file's headers: what bits per weight
    divides by."""
    if path.is_dir():
        return sum(n for n, _, _ in _hf_tensors(path))
    from lowbit.runtime.load.gguf_file import GGUFFile

    return sum(t.n_elements for t in GGUFFile(path).tensors)


def lossless_weights(path: Path) -> str:
    """The layout that holds a checkpoint as stored: GGUF blocks relaid losslessly (`auto`), or a safetensors
    checkpoint's own float dtype (its config's torch_dtype; bf16 when it names none): a reference's weights."""
    import json

    if not path.is_dir():
        return "auto"
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "bf16"
    if isinstance(cfg.get("quantization_config"), dict):
        return "auto"  # GPTQ/AWQ: kept as stored under any quantized layout
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return {"float32": "f32", "float16": "f16"}.get(str(dtype), "bf16")


def read_weights(path: Path, weights: str) -> tuple[LlamaConfig, dict]:
    """(config, weights by name) of a checkpoint at a layout, without building the model: `lowbit eval
    --attribute` builds blocks from two layouts' weights. A GGUF's are read from the file and converted
    each time one is asked for (runtime/load/gguf.py LazyWeights); a safetensors checkpoint's are all
    converted here and held."""
    try:
        spec = None if weights == "auto" else parse_weights(weights)
    except ValueError as e:
        raise LowbitError(str(e)) from None
    try:
        if path.is_dir():
            from lowbit.runtime.load.safetensors import load_hf_dir

            config, w, _ = load_hf_dir(path, spec or parse_weights(DEFAULT_HF_WEIGHTS))
        else:
            from lowbit.runtime.load.gguf import load_gguf

            config, w, _ = load_gguf(path, spec)
    except ValueError as e:
        raise LowbitError(f"{path}: {e}") from None
    return config, w


def read_tokenizer(path: Path) -> Tokenizer:
    """The checkpoint's tokenizer alone (a GGUF's from its metadata, a directory's from its files)."""
    try:
        if path.is_dir():
            return Tokenizer.from_hf_dir(path)
        from lowbit.runtime.load.gguf_file import GGUFFile

        return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    except ValueError as e:
        raise LowbitError(f"{path}: {e}") from None
