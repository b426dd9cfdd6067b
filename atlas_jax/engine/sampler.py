"""On-device sampling: greedy, temperature, top-k, top-p; one RNG stream per request.

A row's random key is fold_in(PRNGKey(seed), step), where step counts the tokens that
request has sampled so far: its output never depends on what else shares the batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    temperature: jax.Array   # [B] f32; 0 = greedy
    top_k: jax.Array         # [B] i32; 0 = off
    top_p: jax.Array         # [B] f32 in (0, 1]
    seed: jax.Array          # [B] u32
    step: jax.Array          # [B] i32 tokens sampled so far by the row's request


def _sample_row(logits, temperature, top_k, top_p, seed, step):
    v = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(v)
    keep = (top_k <= 0) | (rank < top_k)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits)
    mass_before = jnp.cumsum(probs) - probs
    keep = keep & ((mass_before < top_p) | (rank == 0))
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    choice = jax.random.categorical(key, sorted_logits)
    return jnp.where(temperature > 0, order[choice], jnp.argmax(logits)).astype(jnp.int32)


def sample(logits, s: SamplingBatch):
    """logits [B, V] fp32 -> token ids [B] int32."""
    return jax.vmap(_sample_row)(logits, s.temperature, s.top_k, s.top_p, s.seed, s.step)
