"""Device state of the model: the KV page pool and the recurrent-state slot pool.

Built once with fixed capacity and donated to every step, so updates are in place.
  kv[i]  = (k, v), each [num_pages, page_size, num_kv_heads, head_dim] in the model dtype,
           for the i-th full-attention layer.
  ssm[i] = (h [num_slots, R, Hv, Dk, Dv] fp32, conv [num_slots, R, conv_dim, K] model dtype: the last K
           mixer inputs), for the i-th recurrent layer (GDN; or Mamba2 with Hv = heads, Dk = state size,
           Dv = head_dim: cfg.recurrent_shapes). R state positions per slot: 1 without
           speculative decoding; K under K-token verify, which leaves the state after each verified token
           (rollback = read another position; layers/gdn.py states the contract).
Which page / slot a sequence owns is host metadata (state/allocator.py, batch.StepBatch).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelState:
    kv: tuple     # per attention layer: (k_pages, v_pages)
    ssm: tuple    # per recurrent (GDN / Mamba2) layer: (h, conv)


def state_shapes(cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype,
                 state_positions: int = 1) -> ModelState:
    kv_page = jax.ShapeDtypeStruct((num_pages, page_size, cfg.num_kv_heads, cfg.head_dim), dtype)
    lead = (num_slots, state_positions)
    ssm = tuple((jax.ShapeDtypeStruct(lead + h, jnp.float32), jax.ShapeDtypeStruct(lead + conv, dtype))
                for h, conv in map(cfg.recurrent_shapes, cfg.recurrent_layers))
    return ModelState(kv=tuple((kv_page, kv_page) for _ in cfg.attention_layers), ssm=ssm)


def init_state(cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype,
               state_positions: int = 1) -> ModelState:
    shapes = state_shapes(cfg, num_pages, page_size, num_slots, dtype, state_positions)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def init_snapshots(cfg: ModelConfig, num_snapshots: int, dtype) -> tuple:
    """The prefix cache's snapshot pool: per recurrent layer (h [N, ...] fp32, conv [N, C, K])."""
    if not num_snapshots:
        return ()
    return tuple((jnp.zeros((num_snapshots,) + h, jnp.float32), jnp.zeros((num_snapshots,) + conv, dtype))
                 for h, conv in map(cfg.recurrent_shapes, cfg.recurrent_layers))          # distinct buffers


def snapshot_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of one snapshot (every recurrent layer's h and conv state); 0 for a model without any."""
    size = lambda shape: int(np.prod(shape))
    return sum(size(h) * 4 + size(conv) * jnp.dtype(dtype).itemsize
               for h, conv in map(cfg.recurrent_shapes, cfg.recurrent_layers))


def state_bytes(cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype,
                state_positions: int = 1) -> int:
    shapes = state_shapes(cfg, num_pages, page_size, num_slots, dtype, state_positions)
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


def snapshot_slots(cfg: ModelConfig, dtype, enabled: bool, budget: int | None, max_num_seqs: int) -> int:
    """Prefix-cache snapshot slots in `budget` bytes (default: 4 per running sequence, at least 16, within
    2 GiB); 0 when prefix caching is off or the model has no recurrent state."""
    size = snapshot_bytes(cfg, dtype)
    if not enabled or not size:
        return 0
    if budget is None:
        return max(1, min(max(16, 4 * max_num_seqs), (2 << 30) // size))
    if budget < size:
        raise ValueError(f"prefix_snapshot_bytes ({budget}) is below one snapshot of this model's recurrent "
                         f"state ({size} bytes)")
    return budget // size
