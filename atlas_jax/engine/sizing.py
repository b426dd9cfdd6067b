"""Defaults sized from memory: how many sequences run at once (max_num_seqs) and how many KV pages a GiB
budget holds. Called once by LLM, after the weights are loaded (so free memory excludes them)."""
from __future__ import annotations

import logging
import os

import jax

from ..config import ModelConfig
from ..state.cache import state_bytes
from .sampler import slot_sampling_bytes
from .sampling_params import BIAS_COLUMNS

log = logging.getLogger("atlas_jax.engine")

SEQ_CAP = {"cpu": 32}        # XLA:CPU decode is compute-bound: more rows stop paying; accelerators: vLLM's 256
ACCELERATOR_SEQ_CAP = 256
MEMORY_FRACTION = {"cpu": 0.5}   # of the free memory the pools may take (accelerators: 0.9, vLLM's utilization)


def pages_for_memory(cfg: ModelConfig, dtype, page_size: int, gib: float) -> int:
    """KV pages of `page_size` tokens that fit in `gib` GiB for this model (at least one)."""
    if not gib > 0:
        raise ValueError(f"kv_cache_memory must be a positive number of GiB, got {gib!r}")
    return max(1, int(gib * 2**30 // max(page_bytes(cfg, dtype, page_size), 1)))


def page_bytes(cfg: ModelConfig, dtype, page_size: int) -> int:
    """Device bytes of one KV page (every attention layer's K and V)."""
    return state_bytes(cfg, 2, page_size, 1, dtype) - state_bytes(cfg, 1, page_size, 1, dtype)


def free_memory_bytes(device=None) -> int:
    """Bytes the engine's pools may still take on `device` (default: this process's first): the allocator's limit less
    what is in use on an accelerator, the available RAM on CPU."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_max_num_seqs(cfg: ModelConfig, dtype, page_size: int, max_model_len: int, num_pages: int | None,
                         state_positions: int = 1, free_bytes: int | None = None, platform: str | None = None) -> int:
    """As many running sequences as their state fits in a fraction of free memory, capped (SEQ_CAP): each
    takes a recurrent-state slot (state_positions deep), a penalty-history row, its last sampled token, its
    sampling columns and, when the KV pool is sized from max_num_seqs (num_pages None), max_model_len tokens of
    KV pages; with a given pool, at most one sequence per page."""
    platform = platform or jax.default_backend()
    cap = SEQ_CAP.get(platform, ACCELERATOR_SEQ_CAP)
    free = free_memory_bytes() if free_bytes is None else free_bytes
    budget = free * MEMORY_FRACTION.get(platform, 0.9)
    pages = 0 if num_pages is not None else -(-max_model_len // page_size)
    slot = state_bytes(cfg, 1, page_size, 2, dtype, state_positions) - state_bytes(cfg, 1, page_size, 1, dtype,
                                                                                    state_positions)
    per_seq = (slot + 5 * cfg.vocab_size + 4 + slot_sampling_bytes(BIAS_COLUMNS)
               + pages * page_bytes(cfg, dtype, page_size))
    n = max(1, min(cap, int(budget // max(per_seq, 1)), num_pages or cap))
    log.info("max_num_seqs %d (%.1f MiB a sequence, %.1f GiB free, cap %d on %s)", n, per_seq / 2**20,
             free / 2**30, cap, platform)
    return n
