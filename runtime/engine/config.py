"""Every engine default in one frozen record, built once from the command's flags."""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.quant.kv import DEFAULT_KV_FORMAT, parse_kv_format

# The pool's size when none is given follows the model (engine.kv_budget): one whole context of it
# where free memory allows, and at least this much — 28,137 tokens of the default model in k8v4 (9,540
# B/token): a few long chats at once. A fixed 256 MiB had refused a 3,936-token prompt at SmolLM2-1.7B's
# shapes (79 KB/token), whose context is 8,192.
DEFAULT_KV_MEMORY = 256 << 20


@dataclass(frozen=True)
class EngineConfig:
    kv_format: str = DEFAULT_KV_FORMAT  # quant/kv.py KV_FORMATS
    # one format name per KV layer (the model's n_kv_layers; a recipe's "kv": runtime/load/recipe.py), or None:
    # every layer in kv_format, which then only names the pool. `lowbit fit` gives each layer its own bits, as
    # V is the side that costs quality (k8v4 0.0047 mean KL, f16 K with V4 0.0056: quant/kv.py) and layers differ
    kv_layers: tuple[str, ...] | None = None
    # bytes, on CUDA a share (0, 1) of the free GPU memory, or None: the model's whole context (engine.kv_budget)
    kv_memory: int | float | None = None
    # tokens per KV page: 16 keeps the last page's waste under 16 tokens per sequence and a page
    # table short (a 4k context is 256 entries)
    page_size: int = 16
    max_num_seqs: int = 16  # most sequences decoded together
    max_step_tokens: int = 512  # most tokens one step runs (decodes first, then prefill chunks)
    max_waiting: int = 256  # most queued requests; more answer 429 (scheduler.QueueFull)
    prefix_caching: bool = True
    # True: every row exact fp32; False: every row fast; None: on CPU prompt rows exact, generated rows fast
    exact: bool | None = None
    max_model_len: int | None = None  # prompt + reply, in tokens (None: the model's context)
    speculative: object | None = None  # engine/speculative.py SpecConfig
    # decode steps replayed as CUDA graphs (engine/cuda_graphs.py): None where the model runs its fused
    # attention on CUDA in one process, True the same but an error where it cannot, False always eager
    cuda_graphs: bool | None = None

    def __post_init__(self):
        parse_kv_format(self.kv_format)  # a one-line ValueError for an unknown name
        if self.kv_layers is not None:
            if isinstance(self.kv_layers, str) or not self.kv_layers:
                raise ValueError(f"kv_layers must be a non-empty sequence of KV format names, got {self.kv_layers!r}")
            object.__setattr__(self, "kv_layers", tuple(self.kv_layers))  # a list from a recipe: hashable, frozen
            for i, name in enumerate(self.kv_layers):
                try:
                    parse_kv_format(name)
                except ValueError as e:
                    raise ValueError(f"kv_layers[{i}]: {e}") from None
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.exact is False and getattr(self.speculative, "method", None) == "verify":
            raise ValueError("verified greedy verifies on the exact path: it cannot run with exact=False")
        if self.kv_layers is not None and getattr(self.speculative, "method", None) == "verify":
            # its exact pass must read back exactly what it wrote: an f32 cache in every layer
            raise ValueError("verified greedy runs over an f32 KV cache: it cannot run with kv_layers")
