"""Continuous batching: which tokens of which sequences run in the next forward step.

The engine loop is `batch = scheduler.schedule(); sampled = runner.run(batch);
scheduler.postprocess(batch, sampled)`; sequences join (`add`) and leave (`finish`, `abort`,
max_tokens) between any two steps. Pure Python, no torch. Policy of one `schedule()`:

1. Decodes first: every running sequence with exactly one token pending (its last sampled token)
   gets that token, so a long prompt arriving never stalls the streams already running.
2. Prefill chunks fill the rest of the `max_step_tokens` budget: running sequences mid-prefill
   (oldest first), then waiting ones admitted in arrival order while fewer than `max_num_seqs`
   run. A 3000-token prompt under a 512-token budget with 12 decodes running prefills over 6 steps
   (500 + 500 + ... tokens), the 12 decodes advancing in each.
3. Out of pages (`append_slots` gives None): preempt the newest running sequence (it may be the
   one being placed): free its pages, put it back at the FRONT of the waiting queue with its outputs
   kept, and recompute prompt + outputs on readmission (the prefix cache usually still holds its
   full pages then). Newest first because it has the least work to lose and the oldest requests
   keep their latency. Admission never preempts: a newcomer is always the newest.
4. A sequence that cannot fit even alone (every other running sequence gone, the whole pool open
   to it) finishes with "length", like a request reaching the context length; `add` already
   refuses prompts longer than the pool, so such a sequence always has outputs. Nothing loops.

Speculative decoding (runtime/engine/speculative.py) appends several tokens and rolls back the rejected
ones: the engine puts a sequence's k drafts into `output_ids` (`add_drafts`), the step schedules
its last sampled token and the drafts as one decode chunk of k + 1 tokens (pass 1, whole or with
the drafts dropped when the budget is short), the model scores every position, and before
`postprocess` the engine calls `resolve_drafts(seq_id, accepted)`, which rolls back the rejected
drafts and their KV; postprocess then appends the target's token after the accepted ones. Drafts
are never part of a preempted sequence: they are dropped with its pages.

Hybrid models (recurrent layers, runtime/engine/state_pool.py): each running sequence also holds one
recurrent-state slot, taken at admission and given back wherever its pages are (finish, abort, preemption).
`max_num_seqs` running sequences need at most that many slots, so the engine makes that many and admission
never waits for one. Preemption recomputes: the slot goes back and the sequence restarts from position 0.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from lowbit.runtime.engine.pages import PageManager
from lowbit.runtime.engine.state_pool import StateSlots


class QueueFull(Exception):
    """The waiting queue is at its bound: the server refuses the request (HTTP 503/429)."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: `seq in queue` must not compare token lists
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens of all_ids whose KV is in the cache
    num_cached: int = 0  # of those, reused from the prefix cache when this run was admitted
    arrival: int = 0  # admission order, set by Scheduler.add
    finish_reason: str | None = None
    preemptions: int = 0
    num_drafts: int = 0  # the last num_drafts output_ids are speculative drafts awaiting verification
    # attach cached prefix pages on admission: False for a request whose every row must be exact
    # (verified greedy), since a cached page may hold K/V another request computed on the fast kernels
    prefix_cache: bool = True
    state_slot: int = -1  # its recurrent-state slot while running (hybrid models), else -1

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class ScheduledSeq:
    """Run seq.all_ids[start : start + num_tokens] this step, writing their KV into `slots`
    ([num_tokens] pool slots). sample: the chunk reaches the end of all_ids, so its last logits
    are sampled and the token is handed to postprocess. num_drafts: the chunk ends with that many
    drafts, so the logits of its last num_drafts + 1 positions are all needed."""

    seq: Sequence
    start: int
    num_tokens: int
    slots: list[int]
    sample: bool
    num_drafts: int = 0


class Scheduler:
    def __init__(
        self,
        pages: PageManager,
        max_num_seqs: int,
        max_step_tokens: int,
        max_waiting: int,
        states: StateSlots | None = None,
    ):
        if max_num_seqs < 1 or max_step_tokens < max_num_seqs:
            raise ValueError(
                f"need 1 <= max_num_seqs <= max_step_tokens (every running sequence decodes each "
                f"step), got {max_num_seqs} and {max_step_tokens}"
            )
        self.bm = pages
        self.states = states  # a hybrid model's recurrent-state slots, one per running sequence
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()  # arrival order; preempted ones return to the front
        self.running: list[Sequence] = []  # arrival order
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, waiting or running
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self._finished_in_schedule: list[Sequence] = []  # handed out by the next postprocess

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.max_waiting} requests waiting)")
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        capacity = self.bm.num_pages * self.bm.page_size
        if not 0 < len(seq.prompt_ids) <= capacity or seq.max_tokens < 1:
            raise ValueError(
                f"sequence {seq.seq_id!r}: need 1 <= prompt tokens <= {capacity} (the whole KV "
                f"pool; --kv-memory sets its size) and max_tokens >= 1, got {len(seq.prompt_ids)} and "
                f"{seq.max_tokens}"
            )
        seq.status, seq.num_computed, seq.arrival = Status.WAITING, 0, next(self._arrivals)
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1 + s.num_drafts]
        for i, seq in enumerate(decodes):  # 1. decodes (with their drafts)
            if seq.status is not Status.RUNNING:  # preempted for an earlier one's pages
                continue
            if self._budget(batch) < 1:
                break
            # drafts only from what is left once every later decode has its token, and never at the
            # price of a page another sequence holds: short of either, they are dropped
            if seq.num_drafts:
                later = sum(s.status is Status.RUNNING for s in decodes[i + 1:])
                if (self._budget(batch) - later < 1 + seq.num_drafts
                        or not self.bm.can_append(seq.seq_id, 1 + seq.num_drafts)):
                    self.drop_drafts(seq)
            self._place(seq, 1 + seq.num_drafts, batch)
        for seq in list(self.running):  # 2. running prefills (drafts were placed, or dropped, in pass 1)
            if seq.status is Status.RUNNING and seq.num_tokens - seq.num_computed > 1 and not seq.num_drafts:
                if self._budget(batch) < 1:
                    break
                self._place(seq, min(seq.num_tokens - seq.num_computed, self._budget(batch)), batch)
        while self.waiting and len(self.running) < self.max_num_seqs and self._budget(batch) > 0:
            if not self._admit(self.waiting[0], batch):  # 3. admissions
                break
        return batch

    def _budget(self, batch: list[ScheduledSeq]) -> int:
        return self.max_step_tokens - sum(item.num_tokens for item in batch)

    def _place(self, seq: Sequence, n: int, batch: list[ScheduledSeq]) -> bool:
        """Schedule seq's next n tokens, preempting the newest running sequences for pages."""
        while (slots := self.bm.append_slots(seq.seq_id, n)) is None:
            if len(self.running) == 1:  # alone with the whole pool and still too long
                self._finished_in_schedule.append(self.finish(seq.seq_id, "length"))
                return False
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        start = seq.num_computed
        batch.append(ScheduledSeq(seq, start, n, slots, start + n == seq.num_tokens, seq.num_drafts))
        return True

    def _admit(self, seq: Sequence, batch: list[ScheduledSeq]) -> bool:
        """Start waiting[0]: reuse its cached prefix, schedule its first chunk. False (and it stays
        at the front) when the pages are not there; admission preempts nobody."""
        bm, ids = self.bm, seq.all_ids
        cached = bm.match_prefix(seq.seq_id, ids if seq.prefix_cache else [])
        n = min(len(ids) - cached, self._budget(batch))
        slots = bm.append_slots(seq.seq_id, n)
        if slots is None:
            bm.free(seq.seq_id)
            # the same request will be matched again when it fits: count its query once
            bm.prefix_hits_tokens -= cached
            bm.prefix_queried_tokens -= len(ids) if seq.prefix_cache else 0
            if not self.running:  # the whole pool is open to it and it still does not fit
                self._finished_in_schedule.append(self.finish(seq.seq_id, "length"))
                return True
            return False
        if self.states is not None:
            slot = self.states.allocate(seq.seq_id)
            if slot is None:  # cannot happen with a slot per max_num_seqs; never run without one
                raise RuntimeError(f"no recurrent-state slot for {seq.seq_id!r}: fewer slots than max_num_seqs")
            seq.state_slot = slot
        self.waiting.popleft()
        self.running.append(seq)
        seq.status, seq.num_computed, seq.num_cached = Status.RUNNING, cached, cached
        batch.append(ScheduledSeq(seq, cached, n, slots, cached + n == len(ids)))
        return True

    def _preempt(self, seq: Sequence, batch: list[ScheduledSeq]) -> None:
        """Free seq's pages and send it back to the front of the waiting queue; a chunk already
        placed for it this step is dropped (nothing has run yet)."""
        self.bm.free(seq.seq_id)
        self._free_state(seq)
        batch[:] = [item for item in batch if item.seq is not seq]
        self.drop_drafts(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.status, seq.num_computed, seq.num_cached = Status.WAITING, 0, 0
        seq.preemptions += 1
        self.num_preemptions += 1

    def postprocess(self, scheduled: list[ScheduledSeq], sampled: dict[str, int | list[int]]) -> list[Sequence]:
        """Account for a step that ran: advance num_computed, append sampled tokens (an int, or a
        list for multi-token steps), register newly full pages in the prefix cache and finish
        sequences at max_tokens. Returns the sequences finished in this step: here, or in the
        schedule() before it (too long for the whole pool)."""
        finished, self._finished_in_schedule = self._finished_in_schedule, []
        ps = self.bm.page_size
        for item in scheduled:
            seq = item.seq
            if seq.status is not Status.RUNNING:  # finished or aborted while the step ran
                continue
            before = seq.num_computed
            # a rollback between the run and now may have cut the chunk (rejected drafts)
            seq.num_computed = min(item.start + item.num_tokens, self.bm.seq_len(seq.seq_id))
            if item.sample:
                token = sampled[seq.seq_id]
                seq.output_ids.extend(token if isinstance(token, list) else [token])
            if seq.num_computed >= seq.num_tokens:  # only after such a rollback: recompute the last
                self._cut_cache(seq, seq.num_tokens - 1)  # token, whose logits are needed
            if seq.num_computed // ps > before // ps:
                self.bm.commit(seq.seq_id, seq.all_ids[: seq.num_computed])
            if len(seq.output_ids) >= seq.max_tokens:
                del seq.output_ids[seq.max_tokens :]
                finished.append(self.finish(seq.seq_id, "length"))
        return finished

    # -- leaving and rolling back -----------------------------------------------------------

    def finish(self, seq_id: str, reason: str) -> Sequence | None:
        """End a waiting or running sequence now (stop token, stop string, abort): its pages go
        back at once. Returns it, or None if it is unknown or already finished."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        self.bm.free(seq_id)
        self._free_state(seq)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        return seq

    def _free_state(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.free(seq.seq_id)
        seq.state_slot = -1

    def abort(self, seq_id: str) -> Sequence | None:
        return self.finish(seq_id, "abort")

    def rollback(self, seq_id: str, n: int) -> None:
        """Drop the last n output tokens and the KV written for them.

        Between a run and its postprocess (speculative verification) the KV of every kept token of
        the chunk stays, and postprocess appends the target's token after it. Otherwise the last kept
        token is recomputed at the next step, since its logits are needed to continue."""
        seq = self.seqs[seq_id]
        if not 0 <= n <= len(seq.output_ids):
            raise ValueError(f"rollback {seq_id!r}: n={n} outside [0, {len(seq.output_ids)}] outputs")
        if n == 0:
            return
        del seq.output_ids[-n:]
        if seq.status is not Status.RUNNING:
            return  # a preempted sequence holds no KV
        written = self.bm.seq_len(seq_id)
        keep = min(written, seq.num_tokens)
        if written == seq.num_computed:  # no chunk in flight
            keep = min(keep, seq.num_tokens - 1)
        self._cut_cache(seq, keep)

    def add_drafts(self, seq_id: str, drafts: list[int]) -> None:
        """Append speculative drafts to a running sequence that is about to decode (its last sampled
        token pending, no drafts yet); they run with that token in the next step."""
        seq = self.seqs[seq_id]
        if seq.status is not Status.RUNNING or seq.num_drafts or seq.num_tokens - seq.num_computed != 1:
            raise ValueError(f"add_drafts {seq_id!r}: only a running sequence ready to decode takes drafts")
        seq.output_ids.extend(drafts)
        seq.num_drafts = len(drafts)

    def drop_drafts(self, seq: Sequence) -> None:
        """Forget drafts that were never run (no budget, preempted); no KV was written for them."""
        if seq.num_drafts:
            del seq.output_ids[-seq.num_drafts :]
            seq.num_drafts = 0

    def resolve_drafts(self, seq_id: str, accepted: int) -> None:
        """After the step that ran a sequence's drafts and before its postprocess: keep the first
        `accepted`, roll back the rest with their KV; the kept ones become ordinary outputs."""
        seq = self.seqs[seq_id]
        if not 0 <= accepted <= seq.num_drafts:
            raise ValueError(f"resolve_drafts {seq_id!r}: accepted={accepted} outside [0, {seq.num_drafts}]")
        rejected, seq.num_drafts = seq.num_drafts - accepted, 0
        self.rollback(seq_id, rejected)

    def _cut_cache(self, seq: Sequence, keep: int) -> None:
        """Keep KV for the first `keep` tokens. Below the committed (possibly shared) pages the cut
        goes down to a page boundary: the page is dropped whole and recomputed privately rather than
        rewritten under other sequences' feet (page_size 16, keep 37 → 32 once page 2 is shared)."""
        if keep < self.bm.committed_len(seq.seq_id):
            keep -= keep % self.bm.page_size
        self.bm.truncate(seq.seq_id, keep)
        seq.num_computed = min(seq.num_computed, keep)
