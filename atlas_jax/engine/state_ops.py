"""The plan's state operations (plan.py) on the runner's device state: swap a sequence's pages, slot and
penalty history out to host memory and back, snapshot a slot's recurrent state, start a slot on a cached
prefix, fill an adapter slot. Each is one compiled executable call on the donated state (no step
recompiles); `abstract` gives their arguments' shapes for warm-up.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..layers.sections import tile
from ..parallel.multihost import host_args

from . import steps
from .plan import LoadAdapter, LoadPrefix, Snapshot, StateOp, SwapIn, SwapOut

SWAP_CHUNK_PAGES = 32        # swap moves a sequence's pages in calls of this many (one executable per direction)
KINDS = ("save_pages", "save_slot", "restore_pages", "restore_slot", "snapshot", "prefix", "adapter")
RANK_OPS = ("snapshot", "prefix")   # what a data-parallel engine runs, on one rank (parallel/data_parallel.py)

_i32 = lambda x: jnp.asarray(x, jnp.int32)


class StateOps:
    def __init__(self, runner, swap_chunk: int):
        self.runner = runner                    # its state, geometry and `_run(kind, *args)`
        self.swap_chunk = swap_chunk            # pages per swap executable call

    def apply(self, op: StateOp) -> None:
        if isinstance(op, SwapOut):
            op.seq.swapped_state = self.save_sequence_state(list(op.pages), op.slot)
        elif isinstance(op, SwapIn):
            self.restore_sequence_state(list(op.pages), op.slot, op.seq.swapped_state)
            op.seq.swapped_state = None
        elif isinstance(op, Snapshot):
            r = self.runner
            r._run("snapshot", *self._on_rank(op.rank, (op.slot, op.state_idx, op.snap), (0, 0, r.num_snapshots)))
        elif isinstance(op, LoadPrefix):
            self.load_prefix(op.slot, op.snap, op.cow, list(op.tokens), op.prompt_len, op.rank)
        elif isinstance(op, LoadAdapter):
            self.load_adapter(op.slot, op.weights)
        else:
            raise TypeError(f"unknown state operation {op!r}")

    # ---- swap (preemption) ------------------------------------------------------------------
    def saved_shapes(self):
        """Abstract host copies of swap_chunk pages (kv per pool) and of one slot (ssm, penalties)."""
        state, i32 = self.runner.state, jax.ShapeDtypeStruct
        return (jax.eval_shape(steps.save_pages, None, state, i32((self.swap_chunk,), jnp.int32))[0],
                jax.eval_shape(steps.save_slot, None, state, i32((), jnp.int32))[0])

    def swap_bytes(self) -> tuple[int, int]:
        """(host bytes of one swapped-out page, of one swapped-out slot): the scheduler's swap-space accounting."""
        size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        pages, slot = self.saved_shapes()
        return size(pages) // self.swap_chunk, size(slot)

    def _swap_chunks(self, pages: list[int], pad: int) -> list[jax.Array]:
        """`pages` as [swap_chunk] id columns, the last padded with `pad` (at least one column)."""
        c = self.swap_chunk
        return [jnp.asarray(np.array(list(pages[i:i + c]) + [pad] * (c - len(pages[i:i + c])), np.int32))
                for i in range(0, max(len(pages), 1), c)]

    def save_sequence_state(self, pages: list[int], slot: int):
        """Host copy (numpy pytree) of a sequence's KV pages, recurrent slot and penalty history:
        (kv per pool (k [n, ...], v [n, ...]), ssm per layer, in_prompt, out_count)."""
        run = self.runner._run
        chunks = [run("save_pages", ids) for ids in self._swap_chunks(pages, 0)]
        chunks, slot_state = host_args((chunks, run("save_slot", _i32(slot))))
        kv = tuple(tuple(np.concatenate([ch[pool][j] for ch in chunks])[:len(pages)] for j in (0, 1))
                   for pool in range(len(chunks[0])))
        return (kv,) + tuple(slot_state)

    def restore_sequence_state(self, pages: list[int], slot: int, saved) -> None:
        """Write a `save_sequence_state` copy into `pages` (same count) and `slot`, bit-exactly."""
        kv_host = saved[0]
        if kv_host and len(kv_host[0][0]) != len(pages):
            raise ValueError(f"saved state has {len(kv_host[0][0])} pages; {len(pages)} given")
        c = self.swap_chunk
        for i, ids in enumerate(self._swap_chunks(pages, self.runner.num_pages)):
            part = tuple(tuple(_pad_rows(x[i * c:(i + 1) * c], c) for x in kv) for kv in kv_host)
            self.runner._run("restore_pages", ids, part)
        self.runner._run("restore_slot", _i32(slot), tuple(saved[1:]))

    # ---- prefix cache (state/prefix_cache.py) -------------------------------------------------
    def load_prefix(self, slot: int, snap: int | None, cow: tuple[int, int] | None, tokens: list[int],
                    prompt_len: int, rank: int = 0) -> None:
        """Start `slot` on the cached prefix `tokens`: recurrent state from snapshot `snap`, page
        cow[1] := page cow[0] (copy-on-write), penalty history rebuilt (steps.load_prefix)."""
        r = self.runner
        col = np.zeros((r.max_pages_per_seq * r.page_size,), np.int32)
        col[:len(tokens)] = tokens
        src, dst = cow if cow is not None else (0, r.num_pages)
        args = (slot, 0 if snap is None else snap, src, dst, col, prompt_len, len(tokens))
        r._run("prefix", *self._on_rank(rank, args, (r.num_slots, 0, 0, r.num_pages, np.zeros_like(col), 0, 0)))

    def _on_rank(self, rank: int, args: tuple, inert: tuple) -> tuple:
        """A state operation's arguments: as they are on one rank; under data parallel a leading [D] axis with
        `inert` (out-of-range targets: dropped) for the other ranks (parallel/data_parallel.per_rank)."""
        if self.runner.dp == 1:
            return tuple(jnp.asarray(a, jnp.int32) for a in args)
        return tuple(np.stack([np.asarray(a if d == rank else z, np.int32) for d in range(self.runner.dp)])
                     for a, z in zip(args, inert))

    # ---- LoRA (engine/lora.py) ----------------------------------------------------------------
    def load_adapter(self, slot: int, weights: dict) -> None:
        """Pool slot `slot` := an adapter's weights {param key: (A [in, R], B [R, out])}; projections the
        adapter leaves alone get zeros. A data update of the donated state: nothing recompiles."""
        pool = self.runner.state.lora
        unknown = set(weights) - set(pool)
        if unknown:
            raise ValueError(f"adapter weights for {sorted(unknown)[:3]}, which this model's pool lacks")
        full = {key: tuple(jnp.asarray(w, jnp.float32) for w in weights[key]) if key in weights else
                (jnp.zeros((a.shape[0], a.shape[2]), jnp.float32), jnp.zeros(b.shape[1:], jnp.float32))
                for key, (a, b) in pool.items()}
        for key, sections in self.runner.tiled_sections.items():       # outputs in the projection's tiled order
            if key in full:
                full[key] = (full[key][0], tile(full[key][1], sections, self.runner.section_tiles))
        self.runner._run("adapter", _i32(slot), full)

    # ---- abstract form (warm-up) -----------------------------------------------------------------
    def abstract(self, kind: str) -> tuple:
        """ShapeDtypeStructs of a state operation's arguments after (params, state)."""
        r = self.runner
        ranks = (r.dp,) if r.dp > 1 and kind in RANK_OPS else ()
        i32 = lambda *s: jax.ShapeDtypeStruct(ranks + s, jnp.int32)
        if kind == "snapshot":
            return i32(), i32(), i32()
        if kind == "prefix":
            return i32(), i32(), i32(), i32(), i32(r.max_pages_per_seq * r.page_size), i32(), i32()
        if kind == "adapter":
            return i32(), {key: (jax.ShapeDtypeStruct((a.shape[0], a.shape[2]), jnp.float32),
                                 jax.ShapeDtypeStruct(b.shape[1:], jnp.float32)) for key, (a, b) in r.state.lora.items()}
        pages, slot = self.saved_shapes()
        if kind in ("save_pages", "restore_pages"):
            return (i32(self.swap_chunk),) + ((pages,) if kind == "restore_pages" else ())
        return (i32(),) + ((slot,) if kind == "restore_slot" else ())


def _pad_rows(x: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)]) if len(x) < n else x
