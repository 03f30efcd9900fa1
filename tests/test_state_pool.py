"""The recurrent-state slots (runtime/engine/state_pool.py) under the scheduler's randomized workload:
sequences joining, finishing at max_tokens, aborted (waiting, running, or with a chunk in flight) and
preempted for pages. Pure Python, no torch.

A fake hybrid model stands in for the runner: besides the "KV" the scheduler tests write (tests/test_scheduler.py),
each slot holds a "recurrent state" — the tokens fed to it, in order, reset when a chunk starts at position
0, as models/deltanet.py zeroes a slot then. Every sampled token must see the same history through its
pages and through its slot, so a slot shared by two running sequences, a slot not handed back, or a
state not restarted after preemption changes the outputs, which must equal the direct reference."""

import random

import pytest

from lowbit.runtime.engine.pages import PageManager
from lowbit.runtime.engine.scheduler import QueueFull, Scheduler, Sequence, Status
from lowbit.runtime.engine.state_pool import StateSlots
from tests.test_scheduler import FakeRunner, generate, next_token


class FakeHybridRunner(FakeRunner):
    def __init__(self, bm, num_slots):
        super().__init__(bm)
        self.state = [None] * num_slots  # slot -> tokens its sequence fed, in order (the "recurrent state")

    def run(self, batch):
        self.write(batch)
        sampled = {}
        for it in batch:
            slot, seq = it.seq.state_slot, it.seq
            assert slot >= 0 and seq.status is Status.RUNNING, f"{seq.seq_id} runs without a state slot"
            if it.start == 0:
                self.state[slot] = []
            self.state[slot] += seq.all_ids[it.start:it.start + it.num_tokens]
            context = self.read(seq, it.start + it.num_tokens)
            assert self.state[slot] == context, f"{seq.seq_id}: slot {slot} holds another history"
            if it.sample:
                sampled[seq.seq_id] = next_token(context)
        return sampled


def check(sched, slots):
    slots.check_invariants()
    assert slots.owner == {s.seq_id: s.state_slot for s in sched.running}, "held slots are not the running ones"
    assert all(s.state_slot == -1 for s in sched.waiting)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_returns_every_state_slot(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 3, 4])
    max_num_seqs = rng.choice([2, 4, 6])
    bm = PageManager(48 // page_size, page_size, prefix_caching=False)  # the engine's choice for hybrid models
    slots = StateSlots(max_num_seqs)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_step_tokens=20, max_waiting=8, states=slots)
    runner = FakeHybridRunner(bm, max_num_seqs)
    expected, n, finished = {}, 0, 0
    for _ in range(400):
        if rng.random() < 0.3:
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 25))]
            try:
                sched.add(Sequence(f"r{n}", prompt, rng.randrange(1, 20)))
                expected[f"r{n}"] = prompt
            except QueueFull:
                assert sched.num_waiting >= 8  # preempted sequences may push it past the bound
            n += 1
        if sched.seqs and rng.random() < 0.1:
            sched.abort(rng.choice(sorted(sched.seqs)))
        check(sched, slots)
        batch = sched.schedule()
        check(sched, slots)
        if batch and rng.random() < 0.05:  # aborted with its chunk in flight
            sched.abort(rng.choice(batch).seq.seq_id)
        out = runner.run([it for it in batch if it.seq.status is Status.RUNNING])
        for seq in sched.postprocess(batch, out):
            assert seq.output_ids == generate(expected[seq.seq_id], seq.max_tokens)[:len(seq.output_ids)]
            assert seq.state_slot == -1
            finished += 1
        bm.check_invariants()
        check(sched, slots)
    assert sched.num_preemptions > 0 and finished > 10
    for sid in list(sched.seqs):
        sched.abort(sid)
    check(sched, slots)
    assert slots.num_free == slots.num_slots and not slots.owner


def test_slots_are_handed_out_once_and_returned():
    slots = StateSlots(2)
    assert slots.allocate("a") == 0 and slots.allocate("b") == 1 and slots.allocate("c") is None
    with pytest.raises(ValueError):
        slots.allocate("a")
    slots.free("a")
    slots.free("a")  # twice: a no-op
    assert slots.allocate("c") == 0 and slots.slot("b") == 1
    slots.check_invariants()
