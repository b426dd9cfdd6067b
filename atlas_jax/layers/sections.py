"""Sectioned axes laid out in tiles, so a contiguous split over T devices gives each its own share of every
section.

A sectioned axis holds several sections end to end (Mamba2's in_proj output z | x | B | C | dt, its conv
channels x | B | C). Split contiguously over T devices it would cut across sections, so under tensor parallel
such params are stored tiled: T blocks, block d = the d-th 1/T of each section in order
(`tile`). A layer reads a tiled axis with `split_tiled`, which views it as [T, block] and takes each section's
columns from every block: the sections come out in their own order, and each device's slice stays its own
(no data moves under the partitioner). T = 1 is the plain layout: `tile` is the identity, `split_tiled` a split.
"""
import itertools

import jax.numpy as jnp


def _bounds(sections, tiles: int) -> list[int]:
    for s in sections:
        if s % tiles:
            raise ValueError(f"section width {s} is not divisible by {tiles} tiles")
    out, at = [], 0
    for s in sections[:-1]:
        at += s // tiles
        out.append(at)
    return out


def tile(a, sections, tiles: int, axis: int = -1):
    """a with `axis` (the sections end to end) in tiled order (module doc)."""
    if tiles == 1:
        return a
    axis = axis % a.ndim
    parts = jnp.split(a, list(itertools.accumulate(sections))[:-1], axis=axis)
    shape = lambda p: p.shape[:axis] + (tiles, p.shape[axis] // tiles) + p.shape[axis + 1:]
    return jnp.concatenate([p.reshape(shape(p)) for p in parts], axis=axis + 1).reshape(a.shape)


def split_tiled(a, sections, tiles: int, axis: int = -1) -> list:
    """The sections of a tiled `axis`, each in its own column order ([..., section width, ...])."""
    if tiles == 1:
        return jnp.split(a, list(itertools.accumulate(sections))[:-1], axis=axis)
    axis = axis % a.ndim
    blocks = a.reshape(a.shape[:axis] + (tiles, a.shape[axis] // tiles) + a.shape[axis + 1:])
    parts = jnp.split(blocks, _bounds(sections, tiles), axis=axis + 1)
    return [p.reshape(a.shape[:axis] + (s,) + a.shape[axis + 1:]) for p, s in zip(parts, sections)]
