"""StepBatch: the host-built metadata of one forward step, as small int32 device arrays.

A step is a tuple of segments, each a padded-dense StepBatch (e.g. the decode rows [Bd, 1]
and the prefill chunks [Bp, Tp] of one mixed step). Their tokens are concatenated on one flat
token axis for every matmul, so one sweep over the weights serves all segments; only the
mixers' sequence-local parts (KV writes, attention, conv, recurrence) run per segment.

Within a segment, row b holds q_len[b] new tokens at positions start[b] .. start[b]+q_len[b]-1;
columns t >= q_len[b] are padding. A row with q_len 0 is a padding row: it writes no KV and no
recurrent state (its slot is out of range, so scatters drop it).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    tokens: jax.Array        # [B, T] int32 new token ids (padding: any valid id, e.g. 0)
    q_len: jax.Array         # [B] int32 new tokens per row, 0 <= q_len <= T
    start: jax.Array         # [B] int32 tokens already in this row's cache (position of column 0)
    block_table: jax.Array   # [B, P] int32 page ids of the row's KV, in order (unused entries: 0)
    slot: jax.Array          # [B] int32 recurrent-state slot; num_slots (out of range) for padding rows
    state_idx: jax.Array     # [B] int32 state position the row's recurrent state is read from (0 unless
                             # speculating: then the position of the last accepted token, see layers/gdn.py)
    adapter: jax.Array | None = None   # [B] int32 LoRA adapter slot per row (0 = base model); None: engine
                                       # without LoRA (layers/lora.py)

    @property
    def positions(self):     # [B, T]
        return self.start[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def valid(self):         # [B, T] bool: column holds a real token
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.q_len[:, None]

    @property
    def num_tokens(self) -> int:   # static: B * T
        return self.tokens.shape[0] * self.tokens.shape[1]


def split_segments(x, segments):
    """x [N, ...] on the flat token axis -> one [B, T, ...] view per segment."""
    out, offset = [], 0
    for seg in segments:
        b, t = seg.tokens.shape
        out.append(x[offset:offset + b * t].reshape(b, t, *x.shape[1:]))
        offset += b * t
    return out


def join_segments(xs):
    """Inverse of split_segments: [B, T, ...] per segment -> [N, ...]."""
    return jnp.concatenate([x.reshape(-1, *x.shape[2:]) for x in xs], axis=0)
