"""Scheduler: continuous batching, chunked prefill, preemption, prefix reuse, aborts, rollback.

Pure Python (no torch). A fake model stands in for the runner: it writes each scheduled token's
"KV" (its position and id) into a simulated pool slot, and samples the next token from the context
it READS BACK through the block table. A wrong slot, a shared page rewritten or a stale page after
preemption therefore changes the outputs, which must equal the direct reference `generate`."""

import random

import pytest

from lowbit.runtime.engine.config import EngineConfig
from lowbit.runtime.engine.pages import PageManager
from lowbit.runtime.engine.scheduler import QueueFull, Scheduler, Sequence, Status


def next_token(context):
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % 1000


def generate(prompt, max_tokens):
    out = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
    return out


class FakeRunner:
    def __init__(self, bm):
        self.bm = bm
        self.pool = [None] * (bm.num_pages * bm.page_size)  # slot -> (position, token id)

    def read(self, seq, end):
        """Token ids at positions [0, end) as read back from the cache."""
        ps, table = self.bm.page_size, self.bm.block_table(seq.seq_id)
        kv = [self.pool[table[p // ps] * ps + p % ps] for p in range(end)]
        assert [pos for pos, _ in kv] == list(range(end)), f"{seq.seq_id}: a slot holds another position"
        return [tok for _, tok in kv]

    def write(self, batch):
        ps, written = self.bm.page_size, set()
        for item in batch:
            assert item.seq.status is Status.RUNNING and len(item.slots) == item.num_tokens
            for pos, sl in zip(range(item.start, item.start + item.num_tokens), item.slots):
                page = sl // ps
                assert self.bm.ref_count[page] == 1 and self.bm.page_key[page] is None, "writes a shared page"
                assert sl not in written, "two tokens of one step in one slot"
                written.add(sl)
                self.pool[sl] = (pos, item.seq.all_ids[pos])

    def run(self, batch):
        self.write(batch)  # the whole step's KV first, then attention reads, as on the device
        return {it.seq.seq_id: next_token(self.read(it.seq, it.start + it.num_tokens)) for it in batch if it.sample}


def make(num_pages, page_size=4, prefix_caching=True, **kwargs):
    """A scheduler with the engine's defaults but for the limits given."""
    bm = PageManager(num_pages, page_size, prefix_caching)
    d = EngineConfig()
    limits = {"max_num_seqs": d.max_num_seqs, "max_step_tokens": d.max_step_tokens, "max_waiting": d.max_waiting}
    return Scheduler(bm, **(limits | kwargs)), FakeRunner(bm)


def step(sched, runner):
    running_decodes = {s.seq_id for s in sched.running if s.num_tokens - s.num_computed == 1}
    batch = sched.schedule()
    ids = [it.seq.seq_id for it in batch]
    assert len(ids) == len(set(ids)) and sum(it.num_tokens for it in batch) <= sched.max_step_tokens
    for it in batch:  # chunks continue where the cache ends, and sample only at the end
        assert it.start == it.seq.num_computed and it.sample == (it.start + it.num_tokens == it.seq.num_tokens)
    # decode never stalls: every decode that was running is still scheduled, or was preempted
    assert all(s in ids or sched.seqs[s].status is Status.WAITING for s in running_decodes if s in sched.seqs)
    finished = sched.postprocess(batch, runner.run(batch))
    sched.bm.check_invariants()
    return batch, finished


def drain(sched, runner, arrivals=(), max_steps=5000):
    """Run to completion; arrivals: (step, Sequence) added at that step. Returns finished by id."""
    arrivals, done = sorted(arrivals, key=lambda a: a[0]), {}
    for n in range(max_steps):
        while arrivals and arrivals[0][0] <= n:
            sched.add(arrivals.pop(0)[1])
        if not sched.seqs and not arrivals:
            assert_all_free(sched)
            return done
        for seq in step(sched, runner)[1]:
            done[seq.seq_id] = seq
    raise AssertionError("engine loop did not finish")


def assert_all_free(sched):
    bm = sched.bm
    bm.check_invariants()
    assert not sched.running and not sched.waiting and not sched.seqs
    assert bm.tables == {} and bm.num_used_pages == 0 and bm.num_free_pages == bm.num_pages


def workload(rng, n, page_size):
    system = [rng.randrange(1000) for _ in range(3 * page_size + 1)]  # shared by half the requests
    out = []
    for i in range(n):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        out.append((system + prompt) if i % 2 else prompt)
    return [(p, rng.randrange(1, 30)) for p in out]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_preemption_under_page_pressure_keeps_every_output(seed, prefix_caching):
    rng = random.Random(seed)
    page_size = rng.choice([2, 4, 8])
    reqs = workload(rng, 16, page_size)
    # alone, with plenty of pages
    for i, (prompt, max_tokens) in enumerate(reqs[:4]):
        sched, runner = make(256, page_size, prefix_caching)
        done = drain(sched, runner, [(0, Sequence(f"r{i}", list(prompt), max_tokens))])
        assert done[f"r{i}"].output_ids == generate(prompt, max_tokens)
    # together, in a pool that holds the longest request and little more
    longest = max(len(p) + m for p, m in reqs)
    sched, runner = make(-(-longest // page_size) + 2, page_size, prefix_caching, max_num_seqs=8, max_step_tokens=24)
    arrivals = [(rng.randrange(30), Sequence(f"r{i}", list(p), m)) for i, (p, m) in enumerate(reqs)]
    done = drain(sched, runner, arrivals)
    assert sched.num_preemptions > 0 and sum(s.preemptions for s in done.values()) == sched.num_preemptions
    for i, (prompt, max_tokens) in enumerate(reqs):
        seq = done[f"r{i}"]
        assert (seq.status, seq.finish_reason) == (Status.FINISHED, "length")
        assert seq.output_ids == generate(prompt, max_tokens), f"r{i}"
    assert (sched.bm.prefix_hits_tokens > 0) == prefix_caching


def test_chunked_prefill_respects_the_budget_and_never_stalls_decodes():
    sched, runner = make(128, 4, max_num_seqs=8, max_step_tokens=16)
    for i in range(3):
        sched.add(Sequence(f"d{i}", [i + 1, 2, 3], 60))
    step(sched, runner)  # three short prompts prefilled together
    assert all(s.num_tokens - s.num_computed == 1 for s in sched.running)
    long_prompt = [(7 * i) % 1000 for i in range(200)]
    sched.add(Sequence("long", long_prompt, 3))
    chunks = []
    for _ in range(100):
        if any(s.seq_id == "long" and s.output_ids for s in sched.running):
            break
        batch, _ = step(sched, runner)
        assert sum(it.num_tokens for it in batch) <= 16
        assert {f"d{i}" for i in range(3)} <= {it.seq.seq_id for it in batch}  # decodes every step
        chunks += [(it.start, it.num_tokens) for it in batch if it.seq.seq_id == "long"]
    assert chunks[0] == (0, 13) and len(chunks) == -(-200 // 13)  # 16 - 3 decodes per step
    assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
    done = drain(sched, runner)
    assert done["long"].output_ids == generate(long_prompt, 3)
    assert all(done[f"d{i}"].output_ids == generate([i + 1, 2, 3], 60) for i in range(3))


def test_waiting_queue_bound_raises_queue_full():
    sched, runner = make(64, max_waiting=3)
    for i in range(3):
        sched.add(Sequence(f"s{i}", [i + 1], 4))
    with pytest.raises(QueueFull, match="3"):
        sched.add(Sequence("s3", [1], 4))
    assert sched.num_waiting == 3 and "s3" not in sched.seqs
    step(sched, runner)  # admitted: the queue has room again
    assert (sched.num_waiting, sched.num_running) == (0, 3)
    sched.add(Sequence("s3", [1], 4))
    with pytest.raises(ValueError):
        sched.add(Sequence("s3", [1], 4))  # the same id twice
    drain(sched, runner)


def test_abort_of_waiting_running_and_in_flight_sequences_frees_everything():
    sched, runner = make(64, max_num_seqs=2)
    for i in range(4):
        sched.add(Sequence(f"s{i}", [i + 1] * 10, 20))
    step(sched, runner)
    assert [s.seq_id for s in sched.running] == ["s0", "s1"] and sched.num_waiting == 2
    assert sched.abort("s3").finish_reason == "abort"  # waiting
    assert sched.abort("s0").status is Status.FINISHED  # running
    assert sched.abort("s0") is None and sched.abort("nope") is None
    batch = sched.schedule()
    sampled = runner.run(batch)
    sched.abort("s1")  # after its step ran, before postprocess: skipped there
    assert sched.postprocess(batch, sampled) == [] and sched.bm.seq_len("s1") == 0
    assert sched.seqs.keys() == {"s2"}
    sched.abort("s2")
    assert_all_free(sched)


def test_prefix_cache_hits_are_reported_for_a_repeated_prompt_and_a_second_turn():
    sched, runner = make(64, 4)
    prompt = list(range(1, 21))  # 20 tokens: 4 full pages reusable (the 5th holds the last token)
    first = drain(sched, runner, [(0, Sequence("a", prompt, 10))])["a"]
    assert first.num_cached == 0
    again = drain(sched, runner, [(0, Sequence("b", prompt, 10))])["b"]
    assert again.num_cached == 16 and again.output_ids == first.output_ids
    # a second turn: the first's prompt + outputs had 29 tokens of KV, 7 full pages committed
    turn2 = first.all_ids + [5, 6, 7]
    seq = drain(sched, runner, [(0, Sequence("c", turn2, 4))])["c"]
    assert seq.num_cached == 28 and seq.output_ids == generate(turn2, 4)
    assert sched.bm.prefix_hits_tokens == 44 and sched.bm.prefix_queried_tokens == 20 + 20 + 33


def test_a_sequence_outgrowing_the_whole_pool_finishes_with_length():
    sched, runner = make(4, 4)  # 16 slots
    with pytest.raises(ValueError, match="16"):
        sched.add(Sequence("huge", [1] * 17, 1))
    prompt = list(range(14))
    done = drain(sched, runner, [(0, Sequence("a", prompt, 10)), (0, Sequence("b", [3, 4], 10))])
    # 14 prompt + 2 outputs fill the pool's 16 slots; the 3rd output has no slot to continue from
    assert done["a"].finish_reason == "length" and done["a"].output_ids == generate(prompt, 10)[:3]
    assert done["b"].output_ids == generate([3, 4], 10)


def test_rollback_after_a_step_recomputes_and_continues_identically():
    sched, runner = make(32, 4)
    prompt = list(range(7))
    sched.add(Sequence("a", prompt, 12))
    while len(sched.seqs["a"].output_ids) < 6:
        step(sched, runner)
    seq = sched.seqs["a"]
    assert seq.num_computed == 12 and sched.bm.committed_len("a") == 12
    sched.rollback("a", 2)  # keep 11 tokens; the 11th is recomputed from the committed page's start
    assert seq.output_ids == generate(prompt, 4) and seq.num_computed == 8 == sched.bm.seq_len("a")
    with pytest.raises(ValueError):
        sched.rollback("a", 5)
    sched.rollback("a", 0)
    assert drain(sched, runner)["a"].output_ids == generate(prompt, 12)


def test_rollback_while_a_recompute_chunk_is_in_flight():
    sched, runner = make(8, 4, max_num_seqs=2, max_step_tokens=8)
    prompt = [5, 6, 7, 8, 9]
    sched.add(Sequence("a", prompt, 12))
    while len(sched.seqs["a"].output_ids) < 8:
        step(sched, runner)
    seq = sched.seqs["a"]
    sched.bm.free("a")  # as a preemption would: recompute prompt + outputs from scratch
    seq.num_computed = 0
    batch = sched.schedule()
    assert (batch[0].start, batch[0].num_tokens, batch[0].sample) == (0, 8, False)
    sampled = runner.run(batch)
    sched.rollback("a", 6)  # keeps 7 tokens, all inside the chunk that just ran
    sched.postprocess(batch, sampled)
    assert seq.num_computed == 6 and seq.output_ids == generate(prompt, 2)  # the 7th is recomputed
    assert drain(sched, runner)["a"].output_ids == generate(prompt, 12)


@pytest.mark.parametrize("seed", range(3))
def test_speculative_drafts_roll_back_the_rejected_tokens(seed):
    """The speculator appends k drafts, the step runs them in one chunk, the engine checks each
    against the target's token at that position, rolls back the rejected ones before postprocess,
    and postprocess appends the target's token after the accepted drafts."""
    rng = random.Random(seed)
    sched, runner = make(12, 4, max_step_tokens=32)
    prompts = {f"s{i}": [rng.randrange(1000) for _ in range(rng.randrange(1, 12))] for i in range(3)}
    for sid, prompt in prompts.items():
        sched.add(Sequence(sid, list(prompt), 20))
    while sched.seqs:
        for seq in sched.running:
            if seq.num_tokens - seq.num_computed == 1:
                truth = generate(seq.prompt_ids, seq.max_tokens)[len(seq.output_ids) :]
                k = min(rng.randrange(5), len(truth) - 1)
                seq.output_ids += [t if rng.random() < 0.7 else t + 1 for t in truth[:k]]
        batch = sched.schedule()
        runner.write(batch)
        sampled = {}
        for it in batch:
            if not it.sample:
                continue
            seq, ends = it.seq, range(max(it.start + 1, len(it.seq.prompt_ids)), it.start + it.num_tokens + 1)
            target = [next_token(runner.read(seq, end)) for end in ends]
            drafts = seq.all_ids[ends[0] :]
            accepted = next((j for j, (d, t) in enumerate(zip(drafts, target)) if d != t), len(drafts))
            sched.rollback(seq.seq_id, len(drafts) - accepted)
            sampled[seq.seq_id] = target[accepted]
        for seq in sched.postprocess(batch, sampled):
            assert seq.output_ids == generate(prompts[seq.seq_id], 20)
        for it in batch:  # the accepted drafts' KV is kept: nothing is recomputed
            assert it.seq.status is not Status.RUNNING or it.seq.num_tokens - it.seq.num_computed == 1
        sched.bm.check_invariants()
    assert_all_free(sched)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_aborts_returns_every_page(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 3, 4])
    # 48 slots: the longest request (24 + 19 tokens) fits alone, six at once do not
    sched, runner = make(48 // page_size, page_size, max_num_seqs=6, max_step_tokens=20, max_waiting=8)
    expected, n = {}, 0
    for _ in range(300):
        if rng.random() < 0.3:
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 25))]
            try:
                sched.add(Sequence(f"r{n}", prompt, rng.randrange(1, 20)))
                expected[f"r{n}"] = prompt
            except QueueFull:
                assert sched.num_waiting == 8
            n += 1
        if sched.seqs and rng.random() < 0.1:
            assert sched.abort(rng.choice(sorted(sched.seqs))).finish_reason == "abort"
        for seq in step(sched, runner)[1]:
            full = generate(expected[seq.seq_id], seq.max_tokens)
            assert seq.output_ids == full[: len(seq.output_ids)]
            assert seq.finish_reason == "length"
    assert sched.num_preemptions > 0
    for sid in list(sched.seqs):
        sched.abort(sid)
    assert_all_free(sched)
