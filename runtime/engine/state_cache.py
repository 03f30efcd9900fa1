"""The recurrent-state pool of a hybrid model: one slot of state per running sequence, beside the KV pages.

For each Gated DeltaNet layer i (models/deltanet.py), fp32, preallocated:

    conv[i]   [S, C, K - 1]      the last K - 1 inputs of the short conv (C = q, k, v channels)
    rec[i]    [S, Hv, Dk, Dv]    the delta rule's state

S slots, numbered by runtime/engine/state_pool.py. The KV pool (runtime/engine/kv_cache.py) carries this as
`pool.states`, so the model finds it where it finds the pages; PagedBatch.state_slots says which slot each
sequence of a step reads and writes.

Speculation: a page can be truncated, a recurrence cannot. A speculative chunk (the pending token and k
drafts, attended one by one) is journaled by the model as it runs: each layer's state before the chunk and
the chunk's inputs to the recurrence. When verification keeps the first n tokens, `keep(slot, n)` puts the
state back and replays those n steps of the recurrence — the same per-token arithmetic as the run, so the
state is bit for bit the one decoding those n tokens would have left (tests/test_hybrid.py). The journal
holds one state copy per layer and speculating sequence (Qwen3.5-4B: 48 MiB) until the step's verification.
"""

from __future__ import annotations

import torch

from lowbit.kernels.gated_delta import delta_rule_ref


class StateCache:
    def __init__(self, config, num_slots: int, device: torch.device | str = "cpu"):
        """config: the model's (models/config.py: deltanet shapes, recurrent_layers)."""
        d = config.deltanet
        n = config.n_layers - config.n_kv_layers
        self.num_slots = num_slots
        self.conv = [torch.zeros(num_slots, d.conv_dim, d.conv_taps - 1, device=device) for _ in range(n)]
        self.rec = [torch.zeros(num_slots, d.v_heads, d.k_dim, d.v_dim, device=device) for _ in range(n)]
        # (layer, slot) -> (conv state before, rec state before, raw conv inputs [n, C], recurrence inputs)
        self._journal: dict[tuple[int, int], tuple] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.rec))

    def begin_step(self) -> None:
        """A new step: the previous step's journal is settled (verified or not needed)."""
        self._journal.clear()

    def record(self, layer: int, slot: int, conv_before: torch.Tensor, raw: torch.Tensor, inputs: tuple,
               rule=delta_rule_ref) -> None:
        """Called by the model for a speculative chunk, before its recurrence runs: the conv state it started
        from, its raw conv inputs [n, C], the recurrence inputs (q, k [n, Hv, Dk], v [n, Hv, Dv], g, beta
        [n, Hv]) and the rule that runs them (the torch spec, or the C step: `keep` replays with the same)."""
        self._journal[(layer, slot)] = (conv_before, self.rec[layer][slot].clone(), raw, inputs, rule)

    def keep(self, slot: int, n: int) -> None:
        """Keep the first n tokens of the slot's journaled chunk in its state (the rest were rejected)."""
        for key in [k for k in self._journal if k[1] == slot]:
            conv0, rec0, raw, (q, k, v, g, beta), rule = self._journal.pop(key)
            if n == raw.shape[0]:
                continue  # every token kept: the state already is this
            layer = key[0]
            taps = conv0.shape[1]  # K - 1
            xx = torch.cat([conv0.t(), raw[:n]], dim=0)  # [K - 1 + n, C]
            self.conv[layer][slot].copy_(xx[-taps:].t())
            self.rec[layer][slot].copy_(rec0)
            rule(q[:n], k[:n], v[:n], g[:n], beta[:n], self.rec[layer][slot])

    def save(self, slots: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the slots' states, per layer (verified greedy's drafting runs the target model itself
        over its drafts and must leave the state as it found it)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.conv[0].device if self.conv else "cpu")
        return [(c[index].clone(), r[index].clone()) for c, r in zip(self.conv, self.rec)]

    def load(self, slots: list[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        index = torch.tensor(slots, dtype=torch.long, device=self.conv[0].device if self.conv else "cpu")
        for (c, r), (c0, r0) in zip(zip(self.conv, self.rec), saved):
            c[index] = c0
            r[index] = r0
