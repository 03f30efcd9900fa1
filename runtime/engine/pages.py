"""Which KV page holds which token: free list, ref counts, block tables and the prefix cache.

Pure Python, no torch: the pool's tensors live in runtime/engine/kv_cache.py; this module only hands out
page numbers 0..num_pages-1. A token at position p of a sequence lives in pool slot
`table[p // page_size] * page_size + p % page_size` (page_size 16: position 37 of a sequence whose
table is [5, 9, 2] is slot 2 * 16 + 5 = 37 of page 2's 16).

Every page is in exactly one of three states (`check_invariants` asserts they cover the pool):
- free: no owner and no content worth keeping (`self.free_list`);
- used: ref_count > 0, held in the block tables of exactly ref_count sequences;
- cached: ref_count 0 but registered in the prefix cache; kept until a page is needed, then
  evicted least recently released first (`self.evictable`). `num_free_pages` counts free + cached.

Prefix caching. A FULL page whose KV is final is registered under the key
(key id of the page before it, its page_size token ids). Key ids come from a counter and are never
reused, so a key names the whole token prefix up to the end of its page exactly: no hash, no false
hit on equal page tokens after a different earlier prefix, and O(page_size) work per page instead of
rehashing the prefix. Sharing needs no copy-on-write because of two rules:
- only full pages whose content is final are registered (`commit`); a sequence's partial last page
  is never registered and never shared, so a shared page is never written again;
- `truncate` never leaves a registered page partial; it may only drop such pages whole.
"""

from __future__ import annotations

from collections import OrderedDict, deque

_ROOT = 0  # key id of the empty prefix: the parent of every sequence's first page


class PageManager:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_pages  # [num_pages] block tables holding each page
        self.free_list: deque[int] = deque(range(num_pages))  # unregistered pages with ref_count 0
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, ref_count 0; oldest first
        self.cache: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent key id, page tokens) -> page
        self.page_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_pages  # [num_pages]
        self.page_key_id: list[int] = [_ROOT] * num_pages  # [num_pages] _ROOT when unregistered
        self._next_key_id = _ROOT + 1
        self.tables: dict[str, list[int]] = {}  # seq -> [ceil(len / page_size)] pages in order
        self.lens: dict[str, int] = {}  # seq -> tokens with a slot (written or being written)
        self.chains: dict[str, list[int]] = {}  # seq -> key ids of its committed full pages
        self.prefix_hits_tokens = 0
        self.prefix_queried_tokens = 0

    # -- capacity ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages obtainable now: free ones plus cached ones nobody holds (evicted on demand)."""
        return len(self.free_list) + len(self.evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    # -- a sequence's life, in call order ---------------------------------------------------

    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """At a sequence's start, attach the longest run of cached full pages equal to the prefix
        of token_ids; returns the number of tokens covered (a multiple of page_size).

        The last token is never covered (cap ((len - 1) // page_size) pages): its logits are what
        the step must produce, so it has to be computed, and the page it lands in must be private.
        A 33-token prompt with page_size 16 can reuse at most 2 pages = 32 tokens; a 32-token one
        only 1 page."""
        if self.tables.get(seq_id):
            raise ValueError(f"match_prefix: sequence {seq_id!r} already holds pages")
        table, chain = self.tables.setdefault(seq_id, []), self.chains.setdefault(seq_id, [])
        self.lens[seq_id] = 0
        self.prefix_queried_tokens += len(token_ids)
        if not self.prefix_caching:
            return 0
        ps, parent = self.page_size, _ROOT
        for i in range((len(token_ids) - 1) // ps):
            page = self.cache.get((parent, tuple(token_ids[i * ps : (i + 1) * ps])))
            if page is None:
                break
            if self.ref_count[page] == 0:
                del self.evictable[page]  # cached → used again
            self.ref_count[page] += 1
            parent = self.page_key_id[page]
            table.append(page)
            chain.append(parent)
        self.lens[seq_id] = len(table) * ps
        self.prefix_hits_tokens += self.lens[seq_id]
        return self.lens[seq_id]

    def can_append(self, seq_id: str, n: int) -> bool:
        """Whether append_slots(seq_id, n) would find its pages without evicting anyone's."""
        ps, length = self.page_size, self.lens.get(seq_id, 0)
        return -(-(length + n) // ps) - len(self.tables.get(seq_id, [])) <= self.num_free_pages

    def append_slots(self, seq_id: str, n: int) -> list[int] | None:
        """Slots for the sequence's next n token positions, growing its block table as needed.
        None, with nothing changed, when the pool cannot supply the pages."""
        if n < 0:
            raise ValueError(f"append_slots: n must be >= 0, got {n}")
        ps = self.page_size
        table, length = self.tables.get(seq_id, []), self.lens.get(seq_id, 0)
        need = -(-(length + n) // ps) - len(table)  # the table always holds ceil(length / ps)
        if need > self.num_free_pages:
            return None
        if seq_id not in self.tables:
            self.tables[seq_id], self.chains[seq_id] = table, []
        table.extend(self._take_page() for _ in range(need))
        self.lens[seq_id] = length + n
        return [table[p // ps] * ps + p % ps for p in range(length, length + n)]

    def commit(self, seq_id: str, token_ids: list[int]) -> None:
        """Register the sequence's newly full pages in the prefix cache. token_ids: its tokens whose
        KV is written and final (never rolled back afterwards). Idempotent; partial pages never.

        When another page already holds the same key (two equal prompts computed in the same step),
        that entry wins and this sequence's page stays private; its key id still extends the chain,
        so the sequence's later pages are registered under the right prefix."""
        if not self.prefix_caching:
            return
        ps, table, chain = self.page_size, self.tables[seq_id], self.chains[seq_id]
        for i in range(len(chain), min(len(token_ids), self.lens[seq_id]) // ps):
            key = (chain[-1] if chain else _ROOT, tuple(token_ids[i * ps : (i + 1) * ps]))
            page = self.cache.get(key)
            if page is None:
                page = table[i]  # past the chain, so allocated by append_slots: private, unregistered
                self.cache[key], self.page_key[page] = page, key
                self.page_key_id[page], self._next_key_id = self._next_key_id, self._next_key_id + 1
            chain.append(self.page_key_id[page])

    def committed_len(self, seq_id: str) -> int:
        """Tokens in the sequence's committed full pages (matched or registered): never rewritten,
        so `truncate` may cut below this only at a page boundary."""
        return len(self.chains.get(seq_id, ())) * self.page_size

    def truncate(self, seq_id: str, new_len: int) -> None:
        """Roll back to new_len tokens (speculative decoding rejects drafts whose KV was written).

        Rule: new_len >= committed_len, or a multiple of page_size. The page holding position
        new_len is then either private (it will be overwritten, nobody else reads it) or dropped
        whole; a page other sequences may share is never left partial and rewritten. A caller that
        must go below the committed length rounds down to a page boundary and recomputes the rest."""
        length = self.lens[seq_id]
        if not 0 <= new_len <= length:
            raise ValueError(f"truncate: new_len {new_len} outside [0, {length}] for {seq_id!r}")
        ps, chain, table = self.page_size, self.chains[seq_id], self.tables[seq_id]
        if new_len < len(chain) * ps:
            if new_len % ps:
                raise ValueError(
                    f"truncate {seq_id!r} to {new_len}: would leave committed page {new_len // ps} "
                    f"partial (committed {len(chain) * ps} tokens); truncate to a multiple of {ps}"
                )
            del chain[new_len // ps :]
        keep = -(-new_len // ps)
        for page in reversed(table[keep:]):
            self._release(page)
        del table[keep:]
        self.lens[seq_id] = new_len

    def free(self, seq_id: str) -> None:
        """Release all the sequence's pages (finished, aborted or preempted). Unknown ids: no-op.
        Released last page first, so a sequence's deepest pages are evicted before the shared
        prefix they hang from."""
        for page in reversed(self.tables.pop(seq_id, [])):
            self._release(page)
        self.lens.pop(seq_id, None)
        self.chains.pop(seq_id, None)

    # -- queries ----------------------------------------------------------------------------

    def block_table(self, seq_id: str) -> list[int]:
        return list(self.tables.get(seq_id, ()))

    def seq_len(self, seq_id: str) -> int:
        return self.lens.get(seq_id, 0)

    # -- pages ------------------------------------------------------------------------------

    def _take_page(self) -> int:
        """A page for a new owner: the free list first, then the least recently released cached
        page, whose cache entry goes with it (its content is about to be overwritten)."""
        if self.free_list:
            page = self.free_list.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            del self.cache[self.page_key[page]]
            self.page_key[page], self.page_key_id[page] = None, _ROOT
        self.ref_count[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.ref_count[page] -= 1
        if self.ref_count[page] == 0:
            if self.page_key[page] is None:
                self.free_list.append(page)
            else:
                self.evictable[page] = None  # newest entry: evicted last

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (tests call it after every operation)."""
        ps, pages = self.page_size, range(self.num_pages)
        holders = [0] * self.num_pages
        for seq_id, table in self.tables.items():
            length = self.lens[seq_id]
            assert len(table) == -(-length // ps), f"{seq_id!r}: {len(table)} pages for {length} tokens"
            assert len(set(table)) == len(table), f"{seq_id!r}: a page twice in its table {table}"
            assert len(self.chains[seq_id]) <= length // ps, f"{seq_id!r}: committed a partial page"
            for page in table:
                holders[page] += 1
        assert set(self.lens) == set(self.tables) == set(self.chains), "per-sequence maps disagree"
        assert holders == self.ref_count, f"ref counts {self.ref_count} != holders {holders}"
        free, cached = set(self.free_list), set(self.evictable)
        used = {p for p in pages if self.ref_count[p] > 0}
        assert len(free) == len(self.free_list), "a page twice in the free list"
        assert not (free & cached or free & used or cached & used), "page states overlap"
        assert free | cached | used == set(pages), "a page is in no state"
        registered = {p for p in pages if self.page_key[p] is not None}
        assert len(self.cache) == len(registered), "cache entries and registered pages differ"
        for key, page in self.cache.items():
            assert self.page_key[page] == key, f"page {page} registered under another key"
        assert cached <= registered and not (free & registered), "free/cached vs registered"
