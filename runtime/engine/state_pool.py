"""Which recurrent-state slot each running sequence holds (hybrid models: Qwen3.5's Gated DeltaNet layers).

Pure Python, no torch, beside pages.py: the state's tensors live in runtime/engine/state_cache.py; this module
only hands out slot numbers 0..num_slots-1. A page holds 16 tokens' K/V and a sequence holds as many pages as
its length needs; a slot holds a whole sequence's recurrent state (every DeltaNet layer's, a fixed size
whatever the length: 50.25 MiB at Qwen3.5-4B's shapes), so a sequence holds exactly one from admission until it
finishes, is aborted or is preempted. The scheduler takes and returns slots with the sequence
(runtime/engine/scheduler.py); a preempted sequence gives its slot back and recomputes its state from
position 0 when it is admitted again, as it recomputes its pages.

What a slot holds is not kept for anyone after its sequence leaves: there is no prefix cache of states (the
engine switches page sharing off for hybrid models, runtime/engine/engine.py says why), so a slot is
either free or held by one sequence (`check_invariants`).
"""

from __future__ import annotations

from collections import deque


class StateSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.free_list: deque[int] = deque(range(num_slots))
        self.owner: dict[str, int] = {}  # seq id -> its slot

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self, seq_id: str) -> int | None:
        """A slot for a sequence starting to run (its state is zeroed by the model when its first chunk
        starts at position 0); None when every slot is held."""
        if seq_id in self.owner:
            raise ValueError(f"allocate: sequence {seq_id!r} already holds slot {self.owner[seq_id]}")
        if not self.free_list:
            return None
        slot = self.free_list.popleft()
        self.owner[seq_id] = slot
        return slot

    def free(self, seq_id: str) -> None:
        """Give the sequence's slot back (finished, aborted, preempted). Unknown ids: no-op."""
        slot = self.owner.pop(seq_id, None)
        if slot is not None:
            self.free_list.append(slot)

    def slot(self, seq_id: str) -> int | None:
        return self.owner.get(seq_id)

    def check_invariants(self) -> None:
        """Every slot free or held by exactly one sequence (tests call it after every operation)."""
        held = list(self.owner.values())
        assert len(set(held)) == len(held), f"a slot held twice: {self.owner}"
        assert len(set(self.free_list)) == len(self.free_list), "a slot twice in the free list"
        assert not set(held) & set(self.free_list), "a slot both free and held"
        assert set(held) | set(self.free_list) == set(range(self.num_slots)), "a slot is in no state"
