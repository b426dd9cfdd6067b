"""Host-side allocators for KV pages and recurrent-state slots. Pure Python, no jax.

`allocate` returns None when the pool cannot satisfy the request (the caller decides whether
to wait, preempt or refuse); freeing an id that is not allocated is a bug and raises.
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


class BlockAllocator(_IdPool):
    """KV pages of `page_size` tokens each."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, "page")
        self.page_size = page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class SlotAllocator(_IdPool):
    """Recurrent-state slots, one per live sequence of a hybrid model."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, "slot")
