"""Tensor parallelism's communication, measured against docs/tp.md's formula, and its speed next to
one process, in one run.

    python tests/bench/tp_comm.py [--model PATH] [--tp 3] [--prompt-tokens 128] [--decode-tokens 32]
                                  [--threads T]

Runs one greedy request (a WikiText prompt, then --decode-tokens tokens) through the engine twice:
once with --tp N ranks (runtime/engine/tp.py), once in one process, with the same threads in all. The ranks
talk over loopback TCP (gloo), and nothing else in this process uses loopback, so the bytes the
kernel counts on `lo` (/proc/net/dev, Linux) during the tp run are the communication, headers
included. Each step's rows (M tokens, R sampled) are recorded and the formula is summed over them:

    per step   all-reduces  (2 L + 1) x 2 (N - 1) x 4 M d    ring all-reduce of fp32 [M, d]: every
                                                              rank sends 2 (N - 1) / N of it
               logits       (N - 1) x 4 R ceil(V / N)         gathered on rank 0
               the step     (N - 1) x (pickled step + 8)      broadcast from rank 0
    + h per message: (2 L + 1) x 2 N (N - 1) + 3 (N - 1) messages (TCP/IP and gloo headers, ACKs)

h is measured first, apart from the model: N processes all-reduce fp32 [d] and [100 d] 200 times
each over gloo, and h = (loopback bytes - payload) / messages. Prints h, then measured and
predicted bytes for the prefill step and per decoded token (payload alone, and with h), and tok/s
with and without --tp (on a 2-core machine --tp 3 oversubscribes the cores: the speed row
says what that costs, not what tensor parallelism gains on a machine with cores to spare).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests/data/wikitext2_test_excerpt.txt"


def lo_bytes() -> int:
    """Bytes received on the loopback interface so far (= bytes sent on it)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    sys.exit("tp_comm.py: no loopback counters in /proc/net/dev (Linux only)")


def _calibrate_rank(rank: int, world: int, init: str, d: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rows = []
    for size in (d, 100 * d):
        x = torch.ones(size)
        dist.all_reduce(x)
        dist.barrier()
        b0 = lo_bytes()
        for _ in range(200):
            dist.all_reduce(x)
        dist.barrier()
        rows.append((size, (lo_bytes() - b0) / 200))
    if rank == 0:
        Path(out).write_text(repr(rows))
    dist.destroy_process_group()


def calibrate(world: int, d: int) -> float:
    """Bytes on loopback per gloo message beyond its payload (h), from all-reduces of fp32 [d] and
    [100 d] among `world` processes (barriers add a few messages: at most ~1%)."""
    import tempfile

    from lowbit.runtime.engine.tp import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows")
        torch.multiprocessing.spawn(_calibrate_rank, args=(world, f"tcp://127.0.0.1:{_free_port()}", d, out),
                                    nprocs=world)
        rows = eval(Path(out).read_text())  # noqa: S307 - our own repr of [(int, float)]
    msgs = 2 * world * (world - 1)
    return sum(b - 2 * (world - 1) * 4 * size for size, b in rows) / len(rows) / msgs


def run(model, tok, ids, n, on_step=None) -> tuple[list[float], list[int]]:
    """One greedy request through the engine → (wall time of each step, tokens it emitted)."""
    from lowbit.runtime.engine.config import EngineConfig
    from lowbit.runtime.engine.engine import Engine
    from lowbit.runtime.engine.sampler import SamplingParams

    engine = Engine(model, tok, EngineConfig(kv_memory=64 << 20))
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    times, out = [], []
    while engine.has_work():
        t0 = time.perf_counter()
        if on_step is not None:
            on_step("start")
        deltas = engine.step()
        if on_step is not None:
            on_step("end")
        times.append(time.perf_counter() - t0)
        out.append(sum(len(d.token_ids) for d in deltas))
    return times, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", help="GGUF path (default: the default model, pulled if absent)")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="threads in all (default: all cores)")
    a = ap.parse_args(argv)

    from lowbit.runtime.engine import tp as tpmod
    from lowbit.runtime.load.loader import load
    from lowbit.runtime.load.registry import resolve

    threads = a.threads or torch.get_num_threads()
    path = str(Path(a.model) if a.model else resolve(None))
    lm = tpmod.load_tp(path, "auto", a.tp, progress=False, threads=threads)
    c, N = lm.config, a.tp
    ids = lm.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special=False)[:a.prompt_tokens]

    steps, send = [], lm.model._send  # per step: (M, R, pickled step bytes), lo bytes

    def send_and_count(msg):
        if msg[0] == "step":
            body = msg[1]
            steps.append({"M": len(body["tokens"]), "R": len(body["logits_rows"]), "msg": len(pickle.dumps(msg))})
        send(msg)

    lm.model._send = send_and_count
    marks = []
    tp_times, emitted = run(lm.model, lm.tokenizer, ids, a.decode_tokens,
                            lambda when: marks.append(lo_bytes()))
    lm.model._send = send
    lm.model.close()
    measured = [end - start for start, end in zip(marks[::2], marks[1::2])]

    h = calibrate(N, c.dim)

    def payload(s) -> int:
        per = -(-c.vocab_size // N)
        return ((2 * c.n_layers + 1) * 2 * (N - 1) * 4 * s["M"] * c.dim
                + (N - 1) * 4 * s["R"] * per + (N - 1) * (s["msg"] + 8))

    def predicted(s) -> float:
        return payload(s) + h * ((2 * c.n_layers + 1) * 2 * N * (N - 1) + 3 * (N - 1))

    torch.set_num_threads(threads)
    one = load(path, "auto", progress=False)
    one_times, _ = run(one.model, one.tokenizer, ids, a.decode_tokens)

    tokens = max(1, sum(emitted[1:]))
    rows = [(f"prefill ({len(ids)} tokens)", measured[0], payload(steps[0]), predicted(steps[0])),
            ("per decoded token", sum(measured[1:]) / tokens, sum(payload(s) for s in steps[1:]) / tokens,
             sum(predicted(s) for s in steps[1:]) / tokens)]
    print(f"model {Path(path).name}: L {c.n_layers}, d {c.dim}, V {c.vocab_size}; --tp {N}, {threads} threads in all")
    print(f"h = {h:.0f} bytes per message (all-reduces of fp32 [{c.dim}] and [{100 * c.dim}] among {N} processes)")
    print(f"{'bytes':<26}{'measured':>13}{'payload':>13}{'ratio':>7}{'+ h/message':>13}{'ratio':>7}")
    for name, m, p, q in rows:
        print(f"{name:<26}{m:>13,.0f}{p:>13,.0f}{m / p:>7.3f}{q:>13,.0f}{m / q:>7.3f}")
    tp_tok = sum(emitted[1:]) / sum(tp_times[1:])
    one_tok = sum(emitted[1:]) / sum(one_times[1:])
    print(f"decode tok/s: --tp {N} {tp_tok:.1f}, one process {one_tok:.1f} ({tp_tok / one_tok:.2f}x); "
          f"prefill s: {tp_times[0]:.2f} vs {one_times[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
