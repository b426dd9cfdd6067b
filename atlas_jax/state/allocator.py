"""Host-side allocators for KV pages and recurrent-state slots. Pure Python, no jax.

`allocate` returns None when the pool cannot satisfy the request (the caller decides whether
to wait, preempt or refuse); freeing an id that is not allocated is a bug and raises.

KV pages are reference counted: a page may sit in several sequences' block tables (a shared
prefix). When its count drops to zero it goes back to the free list, unless the prefix cache
(`BlockAllocator.cache`) keeps it: then it stays *idle* — content kept, evictable — and counts
as free, because `allocate` evicts idle pages (least recently used first) when the free list
runs short. So `num_free` is exactly what `allocate` can hand out.
"""
from __future__ import annotations


class _IdPool:
    def __init__(self, capacity: int, what: str):
        if capacity <= 0:
            raise ValueError(f"{what} pool needs a positive capacity, got {capacity}")
        self.capacity = capacity
        self._what = what
        self._free = list(range(capacity - 1, -1, -1))   # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self._what} {i} freed but not allocated")
            self._used.remove(i)
            self._free.append(i)


class BlockAllocator:
    """KV pages of `page_size` tokens each, reference counted.

    cache: None, or an object with `keeps(page) -> bool` (the page is registered: keep it idle
    at refcount 0), `idle(page)`, `revive(page)` (an idle page is referenced again),
    `num_idle` and `evict(n) -> list[int]` (detach >= n idle pages, least recently used first,
    and return them: they are free)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0:
            raise ValueError(f"page pool needs a positive capacity, got {num_pages}")
        self.capacity = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.refcount = [0] * num_pages
        self.cache = None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and idle cached ones (evicted on demand)."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    @property
    def num_unused(self) -> int:
        """Pages on the free list (neither referenced nor cached)."""
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int] | None:
        if n > self.num_free:
            return None
        if n > len(self._free):
            self._free.extend(reversed(self.cache.evict(n - len(self._free))))
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self.refcount[i] = 1
        return ids

    def take_back(self, ids) -> None:
        """Pages the cache dropped on its own (refcount 0): back on the free list."""
        self._free.extend(ids)

    def retain(self, ids) -> None:
        """One more reference to each page (a sequence shares it); idle cached pages are revived."""
        for i in ids:
            if self.refcount[i] == 0:
                if self.cache is None or not self.cache.keeps(i):
                    raise ValueError(f"page {i} retained but neither allocated nor cached")
                self.cache.revive(i)
            self.refcount[i] += 1

    def free(self, ids) -> None:
        """Drop one reference to each page; at zero it is idle (cached) or free."""
        for i in ids:
            if self.refcount[i] <= 0:
                raise ValueError(f"page {i} freed but not allocated")
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                if self.cache is not None and self.cache.keeps(i):
                    self.cache.idle(i)
                else:
                    self._free.append(i)


class SlotAllocator(_IdPool):
    """Recurrent-state slots, one per live sequence of a hybrid model."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, "slot")
