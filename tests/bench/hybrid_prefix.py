"""What switching the prefix cache off costs a hybrid model (Qwen3.5): an agent's second request sharing a
512-token prefix with its first prefills all of it again. Measures, on one random Qwen3.5 (tiny dims by
default; --dim for more), through the engine with int8 weights and the default k8v4 cache:

  ttft_second_ms   time to first token of the second request (512 shared + 32 new tokens, no cache)
  ttft_hit_ms      what a cache hit would cost: the 32 new tokens prefilled after the 512-token state
                   (the same engine path, the prefix's state and pages already in place)

Run: .venv/bin/python -P tests/bench/hybrid_prefix.py [--dim 1024 --layers 8]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

import torch

importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")  # before the repo root shadows `kernels`
sys.path.append(str(Path(__file__).resolve().parents[2]))

from lowbit.models.llama import Llama
from lowbit.quant import parse_weights
from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.engine import Engine
from lowbit.runtime.engine.sampler import SamplingParams
from lowbit.runtime.load.safetensors import load_hf_dir
from tests.helpers import ByteTokenizer
from tests.hybrid_models import build


def ttft(engine: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_work():
        for d in engine.step():
            if d.request_id == rid and d.token_ids:
                t = time.perf_counter() - t0
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(2)
    heads = max(4, args.dim // 64)
    model = build(vocab=101, seed=0, hidden_size=args.dim, intermediate_size=3 * args.dim,
                  num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                  linear_num_key_heads=heads // 2, linear_num_value_heads=heads)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        config, w, _ = load_hf_dir(Path(d), parse_weights("int8-g32"))
    lm = Llama(config, w).eval()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 100, (512,), generator=g).tolist()
    first, second = prefix + torch.randint(0, 100, (16,), generator=g).tolist(), \
        prefix + torch.randint(0, 100, (32,), generator=g).tolist()
    engine = Engine(lm, ByteTokenizer(), EngineConfig(max_num_seqs=2, max_step_tokens=1024))
    ttft(engine, first)  # warm up
    ttft(engine, first)
    second_ms = min(ttft(engine, second) for _ in range(3)) * 1e3
    # a cache hit's cost: the state and pages after the prefix are in place, the 32 new tokens run
    from tests.helpers import Sequences

    hit = []
    for _ in range(3):
        seqs = Sequences(lm, 1, 544, kv="k8v4")
        seqs.step(torch.tensor([prefix]))
        t0 = time.perf_counter()
        seqs.step(torch.tensor([second[512:]]))
        hit.append(time.perf_counter() - t0)
    print(f"dim {args.dim}, {args.layers} layers ({config.n_layers - config.n_kv_layers} DeltaNet): "
          f"ttft_second_ms {second_ms:.1f}, ttft_hit_ms {min(hit) * 1e3:.1f} "
          f"({second_ms / (min(hit) * 1e3):.1f}x); prefix_hit_rate {engine.stats()['prefix_hit_rate']:.2f}")


if __name__ == "__main__":
    main()
