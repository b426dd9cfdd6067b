"""Prompt-lookup (ngram) drafting on the device, so that ngram verify steps overlap like MTP's.

Each slot's tokens live in `EngineState.history` [S, L] (position p of the sequence at column p), written by
every step from the tokens it feeds and emits. At a step's end each sampling row looks its context up exactly
as the host's NgramProposer does (speculative.py, the reference): the longest suffix of n in
[ngram_min, ngram_max] tokens with an earlier occurrence, its most recent one, and up to k tokens after it.
Missing drafts are -1; steps.chase caps a verify row at its leading valid drafts.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class NgramSpec:
    ngram_min: int
    ngram_max: int
    num_drafts: int


def record(history, slot, start, tokens, count):
    """history with tokens[b, j] at (slot[b], start[b] + j) for j < count[b] (out-of-range slots: dropped)."""
    s, length = history.shape
    col = jnp.arange(tokens.shape[1])[None, :]
    rows = jnp.where(col < count[:, None], slot[:, None], s)
    return history.at[rows, start[:, None] + col].set(tokens, mode="drop")


def lookup(history, slot, length, spec: NgramSpec):
    """Drafts [B, num_drafts] i32 for the contexts history[slot[b], :length[b]] (-1 where none)."""
    h = jnp.take(history, slot, axis=0, mode="clip")                     # [B, L]
    b, width = h.shape
    pos = jnp.arange(width)[None, :]
    n_max = spec.ngram_max
    back = jnp.clip(length[:, None] - 1 - jnp.arange(n_max)[None, :], 0)   # the suffix, last token first
    suffix = jnp.take_along_axis(h, back, axis=1)
    run = jnp.ones((b, width), bool)
    matched = jnp.zeros((b, width), jnp.int32)   # [b, e]: the suffix's tokens matched ending at e (<= n_max)
    for i in range(n_max):
        earlier = jnp.pad(h, ((0, 0), (i, 0)), constant_values=-1)[:, :width]       # h[b, e - i]
        run &= (earlier == suffix[:, i:i + 1]) & (pos >= i) & (i < length[:, None] - 1)
        matched += run
    matched = jnp.where(pos < length[:, None] - 1, matched, 0)           # an occurrence before the suffix's end
    n = jnp.max(matched, axis=1)
    end = jnp.max(jnp.where(matched >= n[:, None], pos, -1), axis=1)     # its most recent occurrence
    at = end[:, None] + 1 + jnp.arange(spec.num_drafts)[None, :]
    drafts = jnp.take_along_axis(h, jnp.clip(at, 0, width - 1), axis=1)
    return jnp.where((n[:, None] >= spec.ngram_min) & (at < length[:, None]), drafts, -1).astype(jnp.int32)


def advance(history, segments, emitted, emitted_at, emitted_count, spec: NgramSpec):
    """A step's end: history with every segment's fed tokens, then each sampling row's emitted tokens
    [sum B, E] at emitted_at [sum B] (emitted_count of them), and each row's drafts from its new context."""
    for seg in segments:
        history = record(history, seg.slot, seg.start, seg.tokens, seg.q_len)
    slot = jnp.concatenate([seg.slot for seg in segments])
    history = record(history, slot, emitted_at, emitted, emitted_count)
    return history, lookup(history, slot, emitted_at + emitted_count, spec)
