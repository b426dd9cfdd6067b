"""On-device sampling: greedy, temperature, top-k, top-p; one RNG stream per request.

A row's random key is fold_in(PRNGKey(seed), step), where step counts the tokens that
request has sampled so far, and the draw is always taken over the row's logits in vocabulary
order: a request's output never depends on what else shares the batch, nor on which of the
paths below the batch took.
Cost: an all-greedy batch computes only argmax; top-k / top-p masks (a sort over the
vocabulary, slow on CPU) are built only when some sampling row asks for them.
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
    top_p: jax.Array         # [B] f32 in (0, 1]; 1 = off
    seed: jax.Array          # [B] u32
    step: jax.Array          # [B] i32 tokens sampled so far by the row's request


def _top_k_top_p_mask(scaled, top_k, top_p):
    """scaled [V] -> the same logits with tokens outside top-k / the top-p nucleus at -inf."""
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(scaled.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    keep = keep & ((jnp.cumsum(probs) - probs < top_p) | (rank == 0))
    keep_vocab = jnp.zeros_like(keep).at[order].set(keep)
    return jnp.where(keep_vocab, scaled, -jnp.inf)


def _draw(logits, s: SamplingBatch):
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    filtered = jnp.any((s.temperature > 0) & ((s.top_k > 0) | (s.top_p < 1.0)))
    scaled = jax.lax.cond(filtered, jax.vmap(_top_k_top_p_mask), lambda x, k, p: x, scaled, s.top_k, s.top_p)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.PRNGKey(seed), step))(s.seed, s.step)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def sample(logits, s: SamplingBatch):
    """logits [B, V] fp32 -> token ids [B] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(s.temperature > 0), _draw, lambda l, s: greedy, logits, s)
    return jnp.where(s.temperature > 0, drawn, greedy)
