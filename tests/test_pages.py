"""Page manager: slots, exhaustion, ref counts, prefix sharing, eviction, truncation.

Pure Python (no torch). Every PageManager here checks its invariants after each public call and,
at the end of every test, must have handed every page back."""

import random

import pytest

from lowbit.runtime.engine.pages import PageManager


class CheckedPageManager(PageManager):
    """Runs check_invariants() after every public call."""


for _name in ("match_prefix", "append_slots", "commit", "truncate", "free"):

    def _checked(self, *args, _method=getattr(PageManager, _name), **kwargs):
        out = _method(self, *args, **kwargs)
        self.check_invariants()
        return out

    setattr(CheckedPageManager, _name, _checked)


@pytest.fixture
def make_bm():
    made = []

    def make(num_pages, page_size=4, prefix_caching=True):
        made.append(CheckedPageManager(num_pages, page_size, prefix_caching))
        return made[-1]

    yield make
    for bm in made:  # every test frees everything it allocated
        bm.check_invariants()
        assert bm.tables == {} and bm.num_used_pages == 0 and bm.num_free_pages == bm.num_pages


def slot(bm, seq_id, p):
    table = bm.block_table(seq_id)
    return table[p // bm.page_size] * bm.page_size + p % bm.page_size


def snapshot(bm):
    return (
        {k: list(v) for k, v in bm.tables.items()},
        dict(bm.lens),
        list(bm.ref_count),
        list(bm.free_list),
        list(bm.evictable),
        dict(bm.cache),
        bm.prefix_hits_tokens,
        bm.prefix_queried_tokens,
    )


def test_slots_follow_the_block_table(make_bm):
    bm = make_bm(8)
    assert bm.append_slots("a", 3) == [0, 1, 2]  # page 0
    assert bm.append_slots("b", 5) == [4, 5, 6, 7, 8]  # pages 1, 2
    assert bm.append_slots("a", 3) == [3, 12, 13]  # fills page 0, then page 3
    assert bm.block_table("a") == [0, 3] and bm.seq_len("a") == 6
    assert bm.append_slots("a", 0) == [] and bm.seq_len("a") == 6
    for p in range(6):
        assert slot(bm, "a", p) == [0, 1, 2, 3, 12, 13][p]
    assert bm.num_used_pages == 4 and bm.num_free_pages == 4
    with pytest.raises(ValueError):
        bm.append_slots("a", -1)
    bm.free("a")
    bm.free("b")
    bm.free("never-seen")  # no-op


def test_exhaustion_returns_none_and_changes_nothing(make_bm):
    bm = make_bm(3)
    bm.append_slots("a", 10)  # 3 pages, 2 slots left in the last
    before = snapshot(bm)
    assert bm.append_slots("b", 1) is None  # a new sequence is not even registered
    assert bm.append_slots("a", 3) is None  # would need a 4th page
    assert snapshot(bm) == before and "b" not in bm.tables
    assert bm.append_slots("a", 2) == [slot(bm, "a", 10), slot(bm, "a", 11)]
    bm.free("a")


def test_two_sequences_share_a_system_prompt_and_a_third_hits_after_both_left(make_bm):
    bm = make_bm(16)
    system = list(range(100, 112))  # 12 tokens = 3 full pages
    a, b = system + [1, 2, 3], system + [4, 5]
    assert bm.match_prefix("a", a) == 0
    bm.append_slots("a", len(a))
    bm.commit("a", a)
    assert len(bm.cache) == 3  # the 4th page (3 tokens) is partial: never registered
    assert bm.match_prefix("b", b) == 12
    assert bm.block_table("b") == bm.block_table("a")[:3] and bm.seq_len("b") == 12
    assert [bm.ref_count[p] for p in bm.block_table("a")] == [2, 2, 2, 1]
    bm.append_slots("b", 2)
    assert bm.block_table("b")[3] != bm.block_table("a")[3]
    assert (bm.prefix_hits_tokens, bm.prefix_queried_tokens) == (12, len(a) + len(b))
    shared = bm.block_table("a")[:3]
    bm.free("a")  # shared pages stay with b, a's private page returns to the free list
    assert [bm.ref_count[p] for p in shared] == [1, 1, 1] and bm.num_used_pages == 4
    bm.free("b")
    assert sorted(bm.evictable) == sorted(shared) and bm.num_free_pages == 16 and bm.num_used_pages == 0
    assert bm.match_prefix("c", system + [9]) == 12  # from the evictable cache
    assert bm.block_table("c") == shared and not bm.evictable
    bm.free("c")


def test_the_page_of_the_last_token_is_never_shared(make_bm):
    bm = make_bm(8)
    prompt = list(range(8))  # exactly 2 pages
    bm.match_prefix("a", prompt)
    bm.append_slots("a", 8)
    bm.commit("a", prompt)
    assert len(bm.cache) == 2
    assert bm.match_prefix("b", prompt) == 4  # the 2nd page holds the token whose logits are needed
    assert bm.match_prefix("c", prompt + [8]) == 8
    assert bm.match_prefix("d", prompt[:1]) == 0 and bm.match_prefix("e", []) == 0
    for s in "abcde":
        bm.free(s)


def test_eviction_takes_free_pages_first_then_the_least_recently_released(make_bm):
    bm = make_bm(4)
    a = list(range(12))  # 3 full pages
    bm.match_prefix("a", a)
    bm.append_slots("a", 12)
    bm.commit("a", a)
    pages = bm.block_table("a")
    bm.free("a")  # released last page first: it is evicted first
    assert list(bm.evictable) == pages[::-1] and len(bm.free_list) == 1
    bm.append_slots("x", 8)  # the free page, then evicts a's 3rd page (its cache entry with it)
    assert bm.block_table("x")[1] == pages[2] and len(bm.cache) == 2
    assert bm.match_prefix("a2", a + [0]) == 8  # pages 1 and 2 still cached
    bm.free("a2")
    bm.append_slots("x", 8)  # needs the last two pages: evicts them
    assert not bm.cache and bm.num_free_pages == 0
    assert bm.match_prefix("a3", a + [0]) == 0
    bm.free("a3")
    bm.free("x")


def test_no_false_hit_on_equal_page_tokens_after_a_different_prefix(make_bm):
    bm = make_bm(16)
    a, b = [1, 2, 3, 4, 9, 9, 9, 9, 0], [5, 6, 7, 8, 9, 9, 9, 9, 0]
    for s, ids in (("a", a), ("b", b)):
        assert bm.match_prefix(s, ids) == 0
        bm.append_slots(s, len(ids))
        bm.commit(s, ids)
    assert len(bm.cache) == 4  # page [9, 9, 9, 9] twice, under two parents
    assert bm.match_prefix("c", b[:8] + [1]) == 8
    assert bm.block_table("c") == bm.block_table("b")[:2]
    for s in "abc":
        bm.free(s)


def test_equal_prompts_computed_together_keep_one_cache_entry_and_a_correct_chain(make_bm):
    bm = make_bm(16)
    p = list(range(8)) + [7]
    for s in "ab":  # both admitted before either committed: no sharing, two private copies
        assert bm.match_prefix(s, p) == 0
        bm.append_slots(s, len(p))
    bm.commit("a", p)
    bm.commit("b", p)
    assert len(bm.cache) == 2 and bm.committed_len("b") == 8
    assert set(bm.cache.values()) == set(bm.block_table("a")[:2])
    longer = p + [3, 3, 3]  # b goes on and fills its 3rd page: registered under a's prefix chain
    bm.append_slots("b", 3)
    bm.commit("b", longer)
    assert bm.match_prefix("c", longer + [1]) == 12
    assert bm.block_table("c") == bm.block_table("a")[:2] + bm.block_table("b")[2:3]
    for s in "abc":
        bm.free(s)


def test_commit_is_idempotent_and_registers_only_pages_with_written_slots(make_bm):
    bm = make_bm(8)
    ids = list(range(11))
    bm.append_slots("a", 6)
    bm.commit("a", ids)  # 11 tokens known, 6 slots: only page 0 is full and written
    assert len(bm.cache) == 1 and bm.committed_len("a") == 4
    bm.commit("a", ids)
    assert len(bm.cache) == 1
    bm.append_slots("a", 5)
    bm.commit("a", ids)
    assert len(bm.cache) == 2 and bm.committed_len("a") == 8
    bm.free("a")


def test_truncate_rolls_back_private_pages(make_bm):
    bm = make_bm(8)
    bm.append_slots("a", 10)
    table = bm.block_table("a")
    bm.truncate("a", 5)
    assert bm.block_table("a") == table[:2] and bm.seq_len("a") == 5 and bm.num_used_pages == 2
    assert bm.append_slots("a", 1) == [slot(bm, "a", 5)] == [table[1] * 4 + 1]  # rewritten in place
    with pytest.raises(ValueError):
        bm.truncate("a", 7)  # longer than the sequence
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.num_used_pages == 0
    bm.free("a")


def test_truncate_never_leaves_a_committed_page_partial(make_bm):
    bm = make_bm(8)
    ids = list(range(10))
    bm.append_slots("a", 10)
    bm.commit("a", ids)  # pages 0 and 1 committed (8 tokens)
    table = bm.block_table("a")
    bm.truncate("a", 8)  # only the private 3rd page goes
    before = snapshot(bm)
    with pytest.raises(ValueError, match="partial"):
        bm.truncate("a", 6)
    assert snapshot(bm) == before
    bm.truncate("a", 4)  # a page boundary: the committed page is dropped whole, stays cached
    assert bm.committed_len("a") == 4 and list(bm.evictable) == [table[1]]
    assert bm.match_prefix("b", ids) == 8  # still matchable by others
    bm.append_slots("a", 4)  # a recomputes its 2nd page into a fresh private page
    assert bm.block_table("a")[1] != table[1]
    bm.free("a")
    bm.free("b")


def test_prefix_caching_off_shares_nothing(make_bm):
    bm = make_bm(4, prefix_caching=False)
    ids = list(range(9))
    for s in "ab":
        assert bm.match_prefix(s, ids) == 0
        bm.append_slots(s, 5)
        bm.commit(s, ids)
    assert not bm.cache and bm.committed_len("a") == 0
    bm.truncate("a", 3)  # no committed pages: any length
    bm.free("a")
    bm.free("b")
    assert len(bm.free_list) == 4 and not bm.evictable


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_sequence_reading_its_own_tokens(make_bm, seed):
    """Random admissions, growth, commits, truncations and frees over prompts that share
    prefixes. A simulated pool holds (position, token) per slot; after every operation each live
    sequence must read its own tokens back through its block table, so a shared page overwritten
    or a slot handed to two owners shows up at once."""
    rng = random.Random(seed)
    bm = make_bm(24, page_size=rng.choice([1, 2, 4, 5]))
    pool = [None] * (bm.num_pages * bm.page_size)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    tokens = {}  # seq -> tokens with a slot

    def write(s, new):
        slots = bm.append_slots(s, len(new))
        if slots is None:
            return False
        for sl, tok in zip(slots, new):
            pool[sl] = (len(tokens[s]), tok)
            tokens[s].append(tok)
        return True

    for step in range(400):
        op, live = rng.random(), sorted(tokens)
        if op < 0.25 or not live:
            s = f"s{step}"
            ids = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            hit = bm.match_prefix(s, ids)
            tokens[s] = ids[:hit]
            if not write(s, ids[hit:]):
                bm.free(s)
                del tokens[s]
        elif op < 0.5:
            write(rng.choice(live), [rng.randrange(3) for _ in range(rng.randrange(1, 7))])
        elif op < 0.7:
            s = rng.choice(live)
            bm.commit(s, tokens[s])
        elif op < 0.85:
            s = rng.choice(live)
            cut = rng.randrange(len(tokens[s]) + 1)
            if cut < bm.committed_len(s):
                cut -= cut % bm.page_size
            bm.truncate(s, cut)
            del tokens[s][cut:]
        else:
            s = rng.choice(live)
            bm.free(s)
            del tokens[s]
        for s, toks in tokens.items():
            assert bm.seq_len(s) == len(toks)
            assert [pool[slot(bm, s, p)] for p in range(len(toks))] == list(enumerate(toks))
    assert bm.prefix_hits_tokens > 0
    for s in list(tokens):
        bm.free(s)
