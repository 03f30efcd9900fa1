"""`lowbit run`: one prompt, the reply streamed to stdout, one stats line on stderr."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from lowbit.runtime.cli.engine_args import (SPECULATIVE_HELP, add_kv_args, add_model_args, add_sampling_args,
                                            engine_config, load_draft, load_model, parse_size, parse_speculative,
                                            sampling_defaults)
from lowbit.runtime.errors import LowbitError

RUN_DEFAULTS = {"temperature": 0.7, "top_p": 0.95}  # where the model names none: a chat-like reply

VERIFY_SLACK = 32  # tokens past the reply: a block of drafts (15) and page rounding (16)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float  # prompt in → first token chosen
    decode_s: float  # first token chosen → last token kept
    finish_reason: str  # "stop" (end token) | "length"

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="answer one prompt, streaming the reply to stdout",
                         description="Render the prompt with the model's chat template, stream the reply "
                                     "to stdout, then print one stats line on stderr.")
    run.add_argument("prompt", nargs="?", help="the user message (read from stdin when omitted)")
    add_model_args(run)
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument("--max-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    add_sampling_args(run, "temperature 0.7, top-p 0.95")
    run.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("--fast-greedy", action="store_true",
                     help="with --temperature 0, skip the exact verification of greedy tokens (faster; the fast "
                          "kernels' rounding may then pick the other token of a near-tie)")
    add_kv_args(run, SPECULATIVE_HELP + "; with --temperature 0 it replaces verified greedy (as --fast-greedy "
                                        "does) and --kv-cache applies; verified greedy runs on an f32 cache "
                                        "sized to the prompt and reply")


def cmd_run(args) -> int:
    from lowbit.runtime.engine.sampler import SamplingParams
    from lowbit.runtime.engine.speculative import VERIFIED_GREEDY

    prompt = args.prompt if args.prompt is not None else ("" if sys.stdin.isatty() else sys.stdin.read())
    if not prompt.strip():
        raise LowbitError("empty prompt: pass it as an argument or on stdin")
    if args.max_tokens < 1:
        raise LowbitError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sample = lambda model: SamplingParams(**sampling_defaults(args, model, RUN_DEFAULTS),  # noqa: E731
                                          seed=args.seed, max_tokens=args.max_tokens)
    try:
        sample({})  # a bad flag is one line before the model loads
    except ValueError as e:
        raise LowbitError(str(e)) from None
    kv_memory = parse_size(args.kv_memory)
    spec = parse_speculative(args.speculative)
    lm = load_model(args.model, args)
    try:
        params = sample(lm.sampling)
    except ValueError as e:
        raise LowbitError(f"the model's sampling defaults: {e}") from None
    draft = load_draft(spec, lm, args.device, args.dtype)
    tok = lm.tokenizer
    if args.raw:
        ids = tok.encode(prompt, add_special=True)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        try:
            ids = tok.encode_chat(messages, add_generation_prompt=True)
        except ValueError as e:
            raise LowbitError(str(e)) from None

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    config = engine_config(args, kv_memory, spec)
    kv = args.kv_cache if config.kv_layers is None else f"per layer ({args.recipe})"
    # verified greedy: the exact model's greedy reply, drafted by the fast kernels, over an fp32 cache
    # (so the exact pass reads back exactly what it wrote); with --tp, greedy is the fast kernels' own
    verified = params.temperature == 0 and not args.fast_greedy and spec is None and args.tp == 1
    if verified:
        config = dataclasses.replace(config, kv_format="f32", kv_layers=None, speculative=VERIFIED_GREEDY,
                                     kv_memory=_room(lm, len(ids) + args.max_tokens)
                                     + lm.config.state_bytes * config.max_num_seqs)  # hybrid: its state slots
        kv = "f32 (verified greedy)"
    try:
        res, spec_stats = _engine_run(lm, ids, params, config, write, draft)
    except ValueError as e:
        raise LowbitError(str(e)) from None
    if not res.text.endswith("\n"):
        write("\n")
    speculated = ""
    if spec is not None:
        s = spec_stats
        speculated = (f", speculative {args.speculative}: no drafts" if s is None else
                      f", speculative {args.speculative}: {s.accepted}/{s.drafted} drafts accepted "
                      f"({100 * s.acceptance_rate:.0f}%), {s.tokens_per_pass:.2f} tokens per target pass")
    tp = f" tp {args.tp}" if args.tp > 1 else ""
    print(f"[{lm.path.name} {lm.weights} {lm.model.device.type}{tp} kv {kv}] prompt {res.prompt_tokens} tokens, "
          f"TTFT {res.ttft_s * 1000:.0f} ms, "
          f"{len(res.token_ids)} tokens at {res.decode_tok_s:.1f} tok/s decode, finish: {res.finish_reason}{speculated}",
          file=sys.stderr)
    return 0


def _room(lm, tokens: int) -> int:
    """Bytes of an f32 pool that holds the prompt, the reply and a block of drafts: verified greedy's
    pool is sized to its one request, not by --kv-memory (f32 takes 4.8x k8v4's bytes a token, so
    --kv-memory's default would cap a 1.7B model's context at ~700 tokens)."""
    from lowbit.quant.kv import KV_FORMATS

    c = lm.config
    per_token = KV_FORMATS["f32"].bytes_per_token(c.n_kv_layers, lm.model.kv_heads, c.head_dim)
    return per_token * (min(tokens, c.max_seq_len) + VERIFY_SLACK)


def _engine_run(lm, ids, params, config, write, draft=None):
    """One request through the paged engine, streamed → (result, speculative stats or None)."""
    import time

    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.speculative import VERIFIED_GREEDY

    engine = Engine(lm.model, lm.tokenizer, config, draft_model=draft)
    if config.speculative is not VERIFIED_GREEDY:  # verified greedy's f32 pool is sized to the request
        print(f"lowbit: {engine.describe_pool()}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rid = engine.add_request(ids, params)
    out, pieces, t_first, t_last, finish, spec_stats = [], [], None, None, "length", None
    while engine.has_work():
        for d in engine.step():
            now = time.perf_counter()
            if d.token_ids:
                t_first = t_first or now
                t_last = now
                out += d.token_ids
            if d.text:
                pieces.append(d.text)
                write(d.text)
            if d.finish_reason is not None and d.request_id == rid:
                finish = d.finish_reason
                spec_stats = d.usage.spec if d.usage is not None else None
    t_first = t_first or time.perf_counter()
    res = GenerationResult(out, "".join(pieces), len(ids), t_first - t0, (t_last or t_first) - t_first, finish)
    return res, spec_stats
