"""Prompt lookup on the device (engine/device_ngram.py) against the host's NgramProposer, the reference:
the same drafts for random contexts over a small alphabet (many matches, of every length), any
(ngram_min, ngram_max, num_drafts), rows on any slot, contexts from one token to the full history."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas_jax.engine.device_ngram import NgramSpec, lookup, record
from atlas_jax.engine.speculative import NgramProposer

SLOTS, WIDTH, ROWS = 7, 48, 5
_lookup = jax.jit(lookup, static_argnums=3)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.integers(1, 7), st.integers(2, 5), st.randoms(use_true_random=False))
def test_lookup_equals_host_proposer(ngram_min, extra, num_drafts, alphabet, rnd):
    spec = NgramSpec(ngram_min, ngram_min + extra, num_drafts)
    rng = np.random.default_rng(rnd.randrange(2 ** 32))
    history = rng.integers(0, alphabet, (SLOTS, WIDTH)).astype(np.int32)
    slots = rng.permutation(SLOTS)[:ROWS]
    lengths = rng.integers(1, WIDTH + 1, ROWS)
    lengths[0] = WIDTH
    got = np.asarray(_lookup(jnp.asarray(history), jnp.asarray(slots), jnp.asarray(lengths), spec))
    host = NgramProposer(spec.ngram_min, spec.ngram_max)
    for row, slot, n in zip(got, slots, lengths):
        want = host.lookup([int(t) for t in history[slot, :n]], num_drafts)
        assert row.tolist() == want + [-1] * (num_drafts - len(want))


def test_record_writes_counted_tokens_on_their_slots():
    history = jnp.zeros((3, 8), jnp.int32)
    tokens = jnp.asarray([[5, 6, 7], [8, 9, 1], [2, 3, 4]], jnp.int32)
    out = record(history, jnp.asarray([2, 0, 3]), jnp.asarray([1, 6, 0]), tokens, jnp.asarray([3, 2, 3]))
    want = np.zeros((3, 8), np.int32)
    want[2, 1:4] = [5, 6, 7]                      # slot 2 from position 1
    want[0, 6:8] = [8, 9]                         # two counted tokens; slot 3 is out of range: dropped
    assert np.asarray(out).tolist() == want.tolist()
