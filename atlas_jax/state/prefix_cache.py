"""Prefix cache: KV pages keyed by token content and shared by reference count, plus snapshots of
the recurrent (GDN) state at reusable positions. Host only, no jax: the device copies are the
runner's (`take_snapshot`, `load_prefix`).

The cache is a tree of pages (one tree per cache key: 0 = base model; a LoRA adapter's
generation later). A node is one physical page whose first `len(tokens)` positions hold final KV
for `tokens`, after the parent's tokens. Full nodes (page_size tokens) are found by exact key;
partial nodes (fewer tokens) only by longest common prefix, and a hit that ends inside a page
copies it (copy-on-write), so a hit can end at any token.

Lookahead (engines with an MTP head): the head's KV at position p depends on the token at p + 1,
so a node also records its writer's token after its last one (`next_token`), and it is part of
the key: a hit may use a position only when the token after it matches too.

Recurrent state cannot be rebuilt from pages, so on a hybrid model a hit ends at a snapshot: the
state after exactly L tokens, attached to the node holding position L - 1 (at offset L - start).
A snapshot is reachable only through its node, so its KV path is always cached; detaching a node
frees its snapshots. A hit always leaves at least one token to feed (`limit` = tokens - 1): the
step needs the last token's forward pass for logits.

Eviction: idle pages (refcount 0) in least-recently-used order; evicting a node detaches its
whole subtree (pages still held by a sequence simply stop being cached). Snapshots: Marconi's
utility — normalized recency plus normalized compute saved per byte (all snapshots of a model
have the same size, so: the tokens it saves).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict

from .allocator import BlockAllocator


@dataclasses.dataclass(eq=False)
class Node:
    page: int | None                 # None for a root
    parent: "Node | None"
    tokens: tuple                    # tokens whose KV in `page` is final (1..page_size)
    next_token: int | None           # the writer's token after tokens[-1]
    start: int                       # position of tokens[0]
    full: dict = dataclasses.field(default_factory=dict)        # full children by key
    by_first: dict = dataclasses.field(default_factory=dict)    # every child by its first token
    snapshots: dict = dataclasses.field(default_factory=dict)   # offset (1..len(tokens)) -> snapshot id
    alive: bool = True

    def key(self, lookahead: int) -> tuple:
        return self.tokens + ((self.next_token,) if lookahead else ())


@dataclasses.dataclass
class Hit:
    length: int = 0                  # L: tokens served from the cache (the sequence starts at L)
    nodes: list = dataclasses.field(default_factory=list)   # full nodes of the shared pages [0, L // ps)
    cow_page: int | None = None      # page holding [L // ps * ps, L) to copy into the sequence's own page
    snapshot: int | None = None      # recurrent state after L tokens (hybrid models)
    matched: int = 0                 # tokens whose KV is cached (>= L: a branch point when larger)

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]


@dataclasses.dataclass
class _Snapshot:
    node: Node
    offset: int
    last_used: int


class PrefixCache:
    def __init__(self, blocks: BlockAllocator, *, lookahead: bool = False, num_snapshots: int = 0,
                 recurrent: bool = False, snapshot_interval: int = 1024):
        """recurrent: the model has recurrent layers (a hit needs a snapshot); num_snapshots: device
        snapshot slots; snapshot_interval: also snapshot a sequence every this many tokens."""
        if recurrent and num_snapshots < 1:
            raise ValueError("prefix caching on a model with recurrent layers needs at least one snapshot slot")
        self.blocks = blocks
        blocks.cache = self
        self.ps = blocks.page_size
        self.la = int(lookahead)
        self.recurrent = recurrent
        self.snapshot_interval = snapshot_interval
        self.num_snapshots = num_snapshots if recurrent else 0
        self._roots: dict[int, Node] = {}
        self._by_page: dict[int, Node] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()     # idle registered pages, least recent first
        self._snaps: dict[int, _Snapshot] = {}
        self._free_snaps = list(range(self.num_snapshots - 1, -1, -1))
        self._tick = itertools.count(1)
        self.stats = {"query_tokens": 0, "hit_tokens": 0, "evicted_pages": 0, "snapshots_taken": 0,
                      "evicted_snapshots": 0}

    # ---- the allocator's view (state/allocator.py) ---------------------------------------------
    def keeps(self, page: int) -> bool:
        return page in self._by_page

    def idle(self, page: int) -> None:
        self._idle[page] = None

    def revive(self, page: int) -> None:
        del self._idle[page]

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def evict(self, n: int) -> list[int]:
        """Detach least recently used idle nodes (with their subtrees) until >= n pages are free."""
        out = []
        while len(out) < n and self._idle:
            page = next(iter(self._idle))
            out += self._detach(self._by_page[page])
        self.stats["evicted_pages"] += len(out)
        return out

    def _detach(self, node: Node) -> list[int]:
        parent = node.parent
        if parent.full.get(node.key(self.la)) is node:
            del parent.full[node.key(self.la)]
        siblings = parent.by_first[node.tokens[0]]
        siblings.remove(node)
        if not siblings:
            del parent.by_first[node.tokens[0]]
        freed, stack = [], [node]
        while stack:
            x = stack.pop()
            x.alive = False
            stack += [c for cs in x.by_first.values() for c in cs]
            for sid in list(x.snapshots.values()):
                self._drop_snapshot(sid)
            del self._by_page[x.page]
            if x.page in self._idle:              # refcount 0: free now; held pages stay with their holders
                del self._idle[x.page]
                freed.append(x.page)
        return freed

    def reset(self) -> int:
        """Drop every idle page and every snapshot (held pages stay with their holders, uncached).
        Returns the pages freed."""
        freed = []
        for root in self._roots.values():
            for cs in list(root.by_first.values()):
                for c in list(cs):
                    freed += self._detach(c)
        self._roots.clear()
        return freed

    # ---- lookup -------------------------------------------------------------------------------
    def _root(self, key: int) -> Node:
        if key not in self._roots:
            self._roots[key] = Node(page=None, parent=None, tokens=(), next_token=None, start=0)
        return self._roots[key]

    def match(self, tokens, limit: int, key: int = 0) -> Hit:
        """The longest usable cached prefix of `tokens`, at most `limit` tokens (touches what it uses)."""
        ps, la = self.ps, self.la
        node, pos, path = self._root(key), 0, []
        while pos + ps <= limit:
            child = node.full.get(tuple(tokens[pos:pos + ps + la]))
            if child is None:
                break
            path.append((child, ps))
            node, pos = child, pos + ps
        best, best_n = None, 0
        if pos < limit:
            for c in node.by_first.get(tokens[pos], ()):
                n = min(_common_prefix(c.key(la), tokens, pos) - la, len(c.tokens), limit - pos)
                if n > best_n:
                    best, best_n = c, n
        if best is not None:
            path.append((best, best_n))
        hit = Hit(matched=pos + best_n)
        if not self.recurrent:
            hit.length = hit.matched
        else:
            for n_node, usable in path:
                for off, sid in n_node.snapshots.items():
                    if off <= usable and n_node.start + off > hit.length:
                        hit.length, hit.snapshot = n_node.start + off, sid
        if hit.length == 0:
            return Hit(matched=hit.matched)
        tick = next(self._tick)
        for n_node, _ in path:
            if n_node.page in self._idle:
                self._idle.move_to_end(n_node.page)
        if hit.snapshot is not None:
            self._snaps[hit.snapshot].last_used = tick
        full, part = divmod(hit.length, ps)
        hit.nodes = [n_node for n_node, _ in path[:full]]
        if part:
            hit.cow_page = path[full][0].page
        return hit

    def record(self, num_tokens: int, hit: Hit) -> None:
        """Count an admitted sequence's lookup: num_tokens asked, hit.length served."""
        self.stats["query_tokens"] += num_tokens
        self.stats["hit_tokens"] += hit.length

    # ---- registration -------------------------------------------------------------------------
    def commit(self, seq) -> None:
        """Register seq's full pages up to its num_cached (its KV there is final). seq: a Sequence
        (pages, nodes, num_cached, token_at, tokens_between, cache_key)."""
        ps, la = self.ps, self.la
        while (len(seq.nodes) + 1) * ps <= _known(seq, la):
            k = len(seq.nodes)
            parent = seq.nodes[-1] if seq.nodes else self._root(seq.cache_key)
            if not parent.alive:
                return                              # its chain was evicted: nothing further can hang off it
            toks = tuple(seq.tokens_between(k * ps, (k + 1) * ps))
            nt = seq.token_at((k + 1) * ps)
            node = parent.full.get(toks + ((nt,) if la else ()))
            if node is None:
                own = self._by_page.get(seq.pages[k])
                if own is not None:                 # seq's partial node of this page (a snapshot point): promote
                    if own.parent is not parent or toks[:len(own.tokens)] != own.tokens:
                        return
                    own.tokens, own.next_token = toks, nt
                    node = own
                else:
                    node = self._link(Node(page=seq.pages[k], parent=parent, tokens=toks, next_token=nt, start=k * ps))
                parent.full[node.key(la)] = node
                self._absorb(node)
            seq.nodes.append(node)

    def _link(self, node: Node) -> Node:
        node.parent.by_first.setdefault(node.tokens[0], []).append(node)
        self._by_page[node.page] = node
        return node

    def _absorb(self, node: Node) -> None:
        """Partial siblings whose tokens `node` covers are redundant: their snapshots move to
        `node` (so a lookup walking `node` finds them) and idle ones give their page back."""
        key = node.key(self.la)
        for y in list(node.parent.by_first.get(node.tokens[0], ())):
            if y is node or len(y.tokens) == self.ps or _common_prefix(y.key(self.la), key, 0) < len(y.key(self.la)):
                continue
            for off, sid in list(y.snapshots.items()):
                if off in node.snapshots:
                    self._drop_snapshot(sid)
                else:
                    del y.snapshots[off]
                    node.snapshots[off] = sid
                    self._snaps[sid].node = node
            if y.page in self._idle:
                self.blocks.take_back(self._detach(y))

    def cover(self, seq) -> tuple[Node, int] | None:
        """(node, offset): where the KV of seq's first num_cached tokens ends, registering seq's
        partly filled page if no node holds those tokens yet. None if its chain is not cached."""
        self.commit(seq)
        ps, la, pos = self.ps, self.la, _known(seq, self.la)
        k, m = divmod(pos, ps)
        if len(seq.nodes) < k or pos == 0:
            return None
        if m == 0:
            return (seq.nodes[k - 1], ps) if seq.nodes[k - 1].alive else None
        parent = seq.nodes[k - 1] if k else self._root(seq.cache_key)
        if not parent.alive:
            return None
        toks = tuple(seq.tokens_between(k * ps, pos))
        key = toks + ((seq.token_at(pos),) if la else ())
        for c in parent.by_first.get(toks[0], ()):
            if _common_prefix(c.key(la), key, 0) >= len(key):
                return c, m
        own = self._by_page.get(seq.pages[k])
        if own is not None:                         # seq's own partial node from an earlier point: extend it
            if own.parent is not parent or toks[:len(own.tokens)] != own.tokens:
                return None
            own.tokens, own.next_token = toks, seq.token_at(pos)
        else:
            own = self._link(Node(page=seq.pages[k], parent=parent, tokens=toks, next_token=seq.token_at(pos),
                                  start=k * ps))
        self._absorb(own)
        return own, m

    # ---- snapshots ----------------------------------------------------------------------------
    def new_snapshot(self, seq) -> int | None:
        """A snapshot slot for seq's recurrent state after its num_cached tokens (the caller copies
        the state into it), or None: nothing to do (no recurrent layers, the chain is not cached, or
        the snapshot exists)."""
        if not self.recurrent or seq.num_cached != _known(seq, self.la):
            return None
        cov = self.cover(seq)
        if cov is None:
            return None
        node, off = cov
        tick = next(self._tick)
        if off in node.snapshots:
            self._snaps[node.snapshots[off]].last_used = tick
            return None
        if not self._free_snaps:
            self._drop_snapshot(self._snapshot_victim())
            self.stats["evicted_snapshots"] += 1
        sid = self._free_snaps.pop()
        node.snapshots[off] = sid
        self._snaps[sid] = _Snapshot(node, off, tick)
        self.stats["snapshots_taken"] += 1
        return sid

    def _snapshot_victim(self) -> int:
        """Least useful snapshot: normalized recency + normalized tokens saved (Marconi's utility)."""
        snaps = self._snaps
        used = [s.last_used for s in snaps.values()]
        saved = [s.node.start + s.offset for s in snaps.values()]
        span_u, span_s = max(max(used) - min(used), 1), max(max(saved) - min(saved), 1)
        return min(snaps, key=lambda i: (snaps[i].last_used - min(used)) / span_u
                   + (snaps[i].node.start + snaps[i].offset - min(saved)) / span_s)

    def _drop_snapshot(self, sid: int) -> None:
        s = self._snaps.pop(sid)
        del s.node.snapshots[s.offset]
        self._free_snaps.append(sid)

    @property
    def num_snapshots_used(self) -> int:
        return len(self._snaps)

    def num_nodes(self) -> int:
        return len(self._by_page)


def _known(seq, lookahead: bool) -> int:
    """How many of seq's cached tokens the cache can describe: those whose ids the host has read (async
    scheduling: a sampled token may still be on the device), one fewer with lookahead keys (they need the
    token after); a stop inside an accepted run of drafts leaves state for tokens the output does not
    keep (num_cached > num_tokens)."""
    known = getattr(seq, "num_known", seq.num_tokens)
    return min(seq.num_cached, known - lookahead)


def _common_prefix(a: tuple, b, offset: int) -> int:
    """Length of the common prefix of a and b[offset:]."""
    n = min(len(a), len(b) - offset)
    i = 0
    while i < n and a[i] == b[offset + i]:
        i += 1
    return i
