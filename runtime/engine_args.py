"""Engine flags into an engine: sizes (`--kv-memory 512MiB`), `--speculative` and its draft model,
and the loaded model + engine that `lowbit serve` and `lowbit chat` serve."""

from __future__ import annotations

from lowbit.runtime.errors import LowbitError


def parse_size(text: str) -> int | float:
    """'1000000', '512MiB', '2GiB', '1.5G' → bytes (K/M/G are taken as binary units); '90%' → 0.9
    (a share of free GPU memory)."""
    if text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share < 1:
            raise LowbitError(f"a memory share must be between 0% and 100%, got {text!r}")
        return share
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num) * units[unit]
    except ValueError:
        raise LowbitError(f"cannot read the size {text!r} (examples: 268435456, 256MiB, 2GiB)") from None
    if value <= 0:
        raise LowbitError(f"a size must be positive, got {text!r}")
    return int(value)


def parse_speculative(text: str | None):
    """--speculative → SpecConfig or None (a one-line error for a bad value)."""
    if text is None:
        return None
    from lowbit.runtime.speculative import SpecConfig

    try:
        return SpecConfig.parse(text)
    except ValueError as e:
        raise LowbitError(str(e)) from None


def load_draft(spec, lm, device: str, dtype: str):
    """The draft model a `draft=` spec names: `self:<weights>` (`self` alone: int4-g128) loads the
    target's own file again in that layout; anything else is a model reference, which must share
    the target's vocabulary (same token strings), or drafts would mean other tokens."""
    if spec is None or spec.method != "draft":
        return None
    from lowbit.runtime.loader import load

    ref, weights = spec.draft, "auto"
    if ref == "self" or ref.startswith("self:"):
        ref, weights = str(lm.path), ref.partition(":")[2] or "int4-g128"
    draft = load(ref, weights, progress=False, device=device, dtype=dtype)
    a, b = lm.tokenizer, draft.tokenizer
    same = a.vocab_size == b.vocab_size and all(a.token_bytes(i) == b.token_bytes(i)
                                                for i in range(0, a.vocab_size, max(1, a.vocab_size // 512)))
    if not same or draft.config.vocab_size != lm.config.vocab_size:
        raise LowbitError(f"draft model {spec.draft}: its vocabulary differs from the target's; a draft must use "
                          "the same tokenizer")
    return draft.model


def check_engine_args(args) -> None:
    if args.max_num_seqs < 1:
        raise LowbitError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")


def load_model(ref, args, progress: bool | None = None):
    """The model the flags name: one process, or `--tp N` ranks (runtime/tp.py)."""
    if getattr(args, "tp", 1) != 1:
        from lowbit.runtime.tp import load_tp

        return load_tp(ref, args.weights, args.tp, progress, args.device, args.dtype, args.threads)
    from lowbit.runtime.loader import load

    return load(ref, args.weights, progress=progress, device=args.device, dtype=args.dtype)


def load_served(args, kv_memory, progress: bool | None = None):
    """Load the model and build its engine → what the server serves (`lowbit serve`, `lowbit chat`)."""
    from lowbit.runtime.engine import AsyncEngine, Engine
    from lowbit.runtime.server import Served

    spec = parse_speculative(args.speculative)
    model_ref = args.model_pos or args.model
    lm = load_model(model_ref, args, progress)
    draft = load_draft(spec, lm, args.device, args.dtype)
    engine = Engine(lm.model, lm.tokenizer, kv_format=args.kv_cache, kv_memory=kv_memory,
                    max_num_seqs=args.max_num_seqs, max_model_len=args.ctx_size, speculative=spec, draft_model=draft)
    name = getattr(args, "served_model_name", None) or lm.path.name
    return Served(AsyncEngine(engine), lm.tokenizer, name, engine.max_model_len,
                  {"weights": lm.weights, "kv_cache": args.kv_cache, "device": str(lm.model.device),
                   "speculative": args.speculative})
