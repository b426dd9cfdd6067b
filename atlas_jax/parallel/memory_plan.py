"""Per-device memory of a sharded engine, from a config alone: the param specs (models/layout.py), the state
shapes (state/cache.py) and the same sharding rules the engine places them with (parallel/sharding.py), over
an AbstractMesh — no weights, no devices. scripts/plan_memory.py prints it; tests/engine/test_tensor_parallel.py
checks it against the per-device bytes of real sharded engines.

Activations are an estimate (the widest per-device intermediate of a step of `tokens` tokens, fp32, a few live
at once, plus the logits rows), not a measurement: XLA's buffer assignment decides the real peak.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from ..config import ModelConfig
from ..engine.sampler import slot_sampling_bytes
from ..engine.sampling_params import BIAS_COLUMNS
from ..models import family
from ..models.layout import abstract_params
from ..state.cache import state_shapes
from .sharding import DP, TP, conv_split, kv_shardings, leaf_shardings, model_rules, model_state_shardings, section_tiles

LIVE_INTERMEDIATES = 4          # activations: fp32 [tokens, widest] buffers assumed live at once


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights: int                 # bytes per device
    kv_page: int                 # one KV page (every attention layer's K and V, the MTP head's too)
    sequence_state: int          # one sequence's recurrent slot (h by head, conv windows) and sampling rows
    snapshot: int                # one prefix-cache snapshot slot
    activations: int             # estimate (module doc)
    total_weights: int           # unsharded, for the ratio

    def sequences(self, device_bytes: int, seq_len: int, page_size: int, fraction: float = 0.9) -> int:
        """Sequences of seq_len tokens whose pages and slots fit beside the weights and activations."""
        free = device_bytes * fraction - self.weights - self.activations
        per_seq = math.ceil(seq_len / page_size) * self.kv_page + self.sequence_state
        return max(0, int(free // per_seq))


def _bytes(tree, shardings) -> int:
    """Per-device bytes of the ShapeDtypeStructs in `tree` placed by `shardings` (a matching tree)."""
    return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def state_bytes_per_device(cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int, dtype, mesh,
                           state_positions: int = 1, mtp_layers: int = 0, num_snapshots: int = 0) -> int:
    """Per-device bytes of the model state (KV pools, recurrent pools), the MTP head's KV and the snapshot pool."""
    model = state_shapes(cfg, num_pages, page_size, num_slots, dtype, state_positions)
    split = conv_split(cfg, section_tiles(cfg, mesh.shape[TP]))
    total = _bytes(model, model_state_shardings(model, mesh, split))
    page = jax.ShapeDtypeStruct((num_pages, page_size, cfg.num_kv_heads, cfg.head_dim), dtype)
    draft = tuple((page, page) for _ in range(mtp_layers))
    total += _bytes(draft, kv_shardings(draft, mesh))
    if num_snapshots and cfg.recurrent_layers:
        snaps = state_shapes(cfg, 0, page_size, num_snapshots, dtype, 1)
        snaps = dataclasses.replace(snaps, kv=())
        total += _bytes(snaps, model_state_shardings(snaps, mesh))
    return total


def plan(cfg: ModelConfig, dtype, tp: int = 1, expert_parallel: bool = False, mtp_layers: int = 0,
         page_size: int = 16, num_drafts: int = 0, tokens: int = 512, rows: int = 256, dp: int = 1) -> MemoryPlan:
    """The per-device bytes of serving `cfg` at tensor_parallel_size tp (module doc). num_drafts: MTP drafts per
    step (recurrent slots num_drafts + 1 positions deep, the head's KV pages); tokens / rows: a step's token
    budget and its sampled rows (activations). dp: data_parallel_size (the weights over the ("dp", "tp") mesh;
    pages, slots and activations are one rank's, on its tp devices)."""
    mesh = AbstractMesh((tp,), (TP,))
    specs = family(cfg.model_type).param_specs(cfg, mtp_layers)
    params = abstract_params(specs, dtype)
    rules = model_rules(cfg, tp, expert_parallel, dp)
    weight_mesh = AbstractMesh((dp, tp), (DP, TP)) if dp > 1 else mesh
    weights = _bytes(params, leaf_shardings(params, specs, weight_mesh, rules))
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    head_kv = mtp_layers if num_drafts else 0
    state = lambda pages, slots, snaps=0: state_bytes_per_device(cfg, pages, page_size, slots, dtype, mesh,
                                                                 1 + num_drafts, head_kv, snaps)
    base = state(1, 1)
    # replicated per-slot rows: penalty history (bool + int32 a token), last token, MTP drafts, sampling columns
    columns = 5 * cfg.vocab_size + 4 + 4 * (num_drafts + 1) + slot_sampling_bytes(BIAS_COLUMNS)
    widest = max([s.shape[-1] for s in specs if s.role == "proj" and len(s.shape) == 2] or [cfg.hidden_size])
    activations = LIVE_INTERMEDIATES * tokens * (widest // tp + cfg.hidden_size) * 4 + rows * cfg.vocab_size * 4
    return MemoryPlan(weights=weights, kv_page=state(2, 1) - base, sequence_state=state(1, 2) - base + columns,
                      snapshot=state(1, 1, 1) - base, activations=activations, total_weights=total)
