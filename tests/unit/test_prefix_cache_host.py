"""The prefix cache's host side (state/prefix_cache.py, state/allocator.py) without a model: sharing by
content, copy-on-write hits at any token, the MTP lookahead, snapshot choice, LRU eviction that never
touches a held page, and page accounting under random operation sequences (hypothesis)."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.state.allocator import BlockAllocator
from atlas_jax.state.prefix_cache import PrefixCache

PS = 4


@dataclasses.dataclass(eq=False)
class Seq:
    """The part of engine.Sequence the cache reads."""
    tokens: list
    num_cached: int = 0
    pages: list = dataclasses.field(default_factory=list)
    nodes: list = dataclasses.field(default_factory=list)
    cache_key: int = 0

    @property
    def num_tokens(self):
        return len(self.tokens)

    def token_at(self, i):
        return self.tokens[i]

    def tokens_between(self, lo, hi):
        return self.tokens[lo:hi]


def make(num_pages=32, **kw):
    blocks = BlockAllocator(num_pages, PS)
    return blocks, PrefixCache(blocks, **kw)


def admit(blocks, cache, tokens, key=0):
    """What the scheduler does: look up, share, copy the partial page (here: nothing to copy), own the rest."""
    seq = Seq(list(tokens), cache_key=key)
    hit = cache.match(seq.tokens, len(seq.tokens) - 1, key)
    blocks.retain(hit.pages)
    seq.pages = hit.pages + blocks.allocate(blocks.pages_for(len(tokens)) - len(hit.pages))
    seq.nodes, seq.num_cached = list(hit.nodes), hit.length
    return seq, hit


def run_to(cache, seq, n, snapshot=False):
    """The sequence's KV is final up to n tokens; register it (and snapshot at n)."""
    seq.num_cached = n
    cache.commit(seq)
    return cache.new_snapshot(seq) if snapshot else cache.cover(seq)


def release(blocks, cache, seq, snapshot=False):
    if snapshot:
        cache.new_snapshot(seq)
    else:
        cache.cover(seq)
    blocks.free(seq.pages)
    seq.pages, seq.nodes = [], []


def test_full_pages_shared_and_partial_copied():
    blocks, cache = make()
    a, hit = admit(blocks, cache, range(11))
    assert hit.length == 0
    run_to(cache, a, 10)
    pages = list(a.pages)
    release(blocks, cache, a)
    assert blocks.num_free == 32 and cache.num_idle == 3          # 2 full pages + the partial third
    b, hit = admit(blocks, cache, list(range(10)) + [99, 98])
    assert hit.length == 10 and hit.pages == pages[:2]
    assert hit.cow_page == pages[2]                                 # positions 8, 9 copied, not shared
    assert blocks.refcount[hit.nodes[0].page] == 1                  # b holds the shared pages
    c, hit_c = admit(blocks, cache, range(6))                       # shorter than its cached prefix
    assert hit_c.length == 5 and len(hit_c.nodes) == 1              # limit: one token is always fed
    assert hit_c.cow_page == hit.nodes[1].page


def test_hit_at_any_token_and_exact_repeat_feeds_last_token():
    blocks, cache = make()
    a, _ = admit(blocks, cache, range(3))                           # shorter than a page
    run_to(cache, a, 2)
    release(blocks, cache, a)
    _, hit = admit(blocks, cache, range(3))
    assert hit.length == 2 and hit.nodes == [] and hit.cow_page is not None


def test_lookahead_needs_the_next_token():
    """MTP head KV at the last cached position depends on the token after it."""
    blocks, cache = make(lookahead=True)
    a, _ = admit(blocks, cache, [1, 2, 3, 4, 5, 6])
    run_to(cache, a, 5)
    release(blocks, cache, a)
    assert admit(blocks, cache, [1, 2, 3, 4, 5, 6, 7])[1].length == 5
    assert admit(blocks, cache, [1, 2, 3, 4, 5, 9, 7])[1].length == 4      # token 5 differs: stop before it
    _, hit = admit(blocks, cache, [1, 2, 3, 4, 7, 7])
    assert hit.length == 3 and hit.nodes == []                             # the full page's next token differs


def test_snapshot_bounds_a_recurrent_hit():
    blocks, cache = make(recurrent=True, num_snapshots=4)
    a, _ = admit(blocks, cache, range(20))
    s1 = run_to(cache, a, 6, snapshot=True)
    s2 = run_to(cache, a, 13, snapshot=True)
    assert {s1, s2} <= set(range(4)) and s1 != s2
    run_to(cache, a, 19)
    _, hit = admit(blocks, cache, list(range(15)) + [50, 51])
    assert (hit.length, hit.snapshot, hit.matched) == (13, s2, 15)      # the KV goes further: a branch point
    _, hit = admit(blocks, cache, list(range(10)) + [50])
    assert (hit.length, hit.snapshot) == (6, s1)
    _, hit = admit(blocks, cache, [7, 7])
    assert hit.length == 0 and hit.snapshot is None


def test_snapshot_moves_to_the_page_that_covers_it():
    """A partial page's snapshot stays reachable when a later sequence fills the same page fully."""
    blocks, cache = make(recurrent=True, num_snapshots=4)
    a, _ = admit(blocks, cache, range(7))
    run_to(cache, a, 6)
    release(blocks, cache, a, snapshot=True)                         # snapshot at 6, partial page [4, 6)
    b, hit = admit(blocks, cache, range(12))
    assert hit.length == 6
    run_to(cache, b, 11)                                             # b's own copy of page 1 is full now
    release(blocks, cache, b)
    assert cache.num_nodes() == cache.num_idle == 3                  # a's redundant partial page went back
    _, hit = admit(blocks, cache, range(12))
    assert hit.length == 6 and len(hit.nodes) == 1


def test_lru_eviction_spares_held_pages_and_detaches_subtrees():
    blocks, cache = make(num_pages=8, recurrent=True, num_snapshots=2)
    a, _ = admit(blocks, cache, range(9))
    run_to(cache, a, 8, snapshot=True)
    release(blocks, cache, a)
    b, _ = admit(blocks, cache, list(range(100, 108)) + [5])       # holds 3 pages
    run_to(cache, b, 8)
    assert blocks.num_free == 5 and cache.num_idle == 2
    got = blocks.allocate(5)                                        # evicts a's chain (idle), never b's pages
    assert got is not None and not set(got) & set(b.pages)
    assert cache.num_snapshots_used == 0 and cache.stats["evicted_pages"] == 2
    assert blocks.allocate(1) is None
    blocks.free(got)
    release(blocks, cache, b)
    assert blocks.num_free == 8


def test_double_free_and_unknown_retain_raise():
    blocks, cache = make()
    (p,) = blocks.allocate(1)
    blocks.free([p])
    with pytest.raises(ValueError):
        blocks.free([p])
    with pytest.raises(ValueError):
        blocks.retain([p])


def test_reset_frees_idle_pages_only():
    blocks, cache = make(recurrent=True, num_snapshots=2)
    a, _ = admit(blocks, cache, range(10))
    run_to(cache, a, 9, snapshot=True)
    b, _ = admit(blocks, cache, range(50, 60))
    run_to(cache, b, 9)
    release(blocks, cache, b)
    blocks.take_back(cache.reset())
    assert cache.num_nodes() == 0 and cache.num_snapshots_used == 0
    assert blocks.num_unused == 32 - len(a.pages)
    release(blocks, cache, a)
    assert blocks.num_unused == 32


NP = 7
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 0, 0, 1, 1], [5, 5, 5, 5, 1, 2, 3, 4, 5])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "release", "alloc"]), st.integers(0, 2**16)),
                min_size=1, max_size=60),
       st.booleans(), st.booleans())
def test_random_operations_keep_accounting(ops, lookahead, recurrent):
    """Pages are either free, idle-cached or held; held pages are never handed out; every lookup
    hit is backed by pages holding exactly its tokens."""
    blocks, cache = make(num_pages=NP, lookahead=lookahead, recurrent=recurrent, num_snapshots=3)
    content = {}                          # page -> tokens written there (by position in page)
    live, loose = [], []
    for op, r in ops:
        if op == "admit" and len(live) < 3:
            base = PREFIXES[r % 3][:1 + (r >> 2) % 9]
            tokens = base + [(r >> 6) % 3] * (1 + (r >> 8) % 6)
            if blocks.pages_for(len(tokens)) > blocks.num_free:
                continue
            seq, hit = admit(blocks, cache, tokens)
            for i, node in enumerate(hit.nodes):                 # shared pages hold what we ask for
                assert content[node.page] == tokens[i * PS:(i + 1) * PS]
            if hit.cow_page is not None:
                part = hit.length % PS
                dst = seq.pages[hit.length // PS]
                content[dst] = content[hit.cow_page][:part]
            for p in seq.pages[len(hit.nodes):]:
                assert blocks.refcount[p] == 1
            live.append(seq)
        elif op == "grow" and live:
            seq = live[r % len(live)]
            n = min(len(seq.tokens) - 1, seq.num_cached + 1 + r % 6)
            for pos in range(seq.num_cached, n):
                page = seq.pages[pos // PS]
                assert blocks.refcount[page] == 1 or pos % PS >= len(content.get(page, []))
                content.setdefault(page, [])[pos % PS:] = [seq.tokens[pos]]
            run_to(cache, seq, n, snapshot=bool(r & 1))
        elif op == "release" and live:
            release(blocks, cache, live.pop(r % len(live)), snapshot=bool(r & 1))
        elif op == "alloc":
            if r % 4 == 0 and loose:
                blocks.free([loose.pop()])
            else:
                got = blocks.allocate(1)
                if got:
                    for p in got:
                        assert all(p not in s.pages for s in live)
                        content.pop(p, None)
                    loose += got
        held = {p for s in live for p in s.pages} | set(loose)
        assert blocks.num_free == NP - len(held)
        assert all(blocks.refcount[p] > 0 for p in held)
        assert cache.num_snapshots_used <= 3
    for s in live:
        release(blocks, cache, s)
    blocks.free(loose)
    assert blocks.num_free == NP and all(c == 0 for c in blocks.refcount)
