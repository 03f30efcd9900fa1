"""GPU timing shared by the benches (gpu_kernels.py, gpu_attention.py): CUDA-graph replays over
rotated operand copies (L2-cold), the device's HBM peak, a relative error."""

from __future__ import annotations

import statistics

import torch


def peak_gbs_for(name: str) -> float | None:
    """HBM peak by product name: H200 4.8 TB/s; H100 SXM (reported as "H100 80GB HBM3") 3.35 TB/s."""
    if "H200" in name:
        return 4800.0
    if "H100" in name and ("SXM" in name or "HBM3" in name):
        return 3350.0
    return None


def graph_ms(calls: list, target_ms: float, replays: int = 10) -> float:
    """GPU ms per call of `calls` (one zero-argument callable per copy of
    the operands: weights, KV pools), captured round-robin
    into one CUDA graph of n calls (a multiple of len(calls), ~target_ms of eager time, 1..4096);
    the median over `replays` replays of replay time / n. The eager estimate is an upper bound (it
    includes the Python launch), so a launch-bound call gets fewer calls per graph, never too many."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up on the capture stream: compiles, library handles and workspaces
            call()
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        est = max(start.elapsed_time(end) / len(calls), 1e-3)
        rounds = max(1, min(4096 // len(calls), round(target_ms / est / len(calls))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rounds):
                for call in calls:
                    call()
        graph.replay()  # the first replay uploads the graph
        times = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref||: bf16 output rounding gives ~1e-3, a layout or indexing bug ~1."""
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))
