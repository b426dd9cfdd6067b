"""Tiled sectioned axes (layers/sections.py): a tiled axis read with split_tiled gives each section back in its
own order, and block d of the tiled axis (what a contiguous split over T devices gives device d) holds exactly
the d-th 1/T of every section."""
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.layers.sections import split_tiled, tile


@settings(max_examples=40, deadline=None)
@given(tiles=st.sampled_from([1, 2, 4]), units=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       axis=st.sampled_from([0, 1, -1]), seed=st.integers(0, 999))
def test_tile_round_trip_and_blocks(tiles, units, axis, seed):
    sections = [u * tiles for u in units]
    shape = [3, 2]
    shape[axis] = sum(sections)
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    tiled = np.asarray(tile(jnp.asarray(a), sections, tiles, axis))
    bounds = np.cumsum(sections)[:-1]
    for got, want in zip(split_tiled(jnp.asarray(tiled), sections, tiles, axis), np.split(a, bounds, axis=axis)):
        np.testing.assert_array_equal(got, want)
    for d, block in enumerate(np.split(tiled, tiles, axis=axis)):
        own = [np.split(s, tiles, axis=axis)[d] for s in np.split(a, bounds, axis=axis)]
        np.testing.assert_array_equal(block, np.concatenate(own, axis=axis))
