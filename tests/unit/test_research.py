"""The state research API (atlas_jax.research.StateLab): intermediates of a verify-sized feed equal
token-by-token states; rollback + new tokens equal a fresh sequence; checkpoint / restore and the
snapshot ring return to exactly the saved state (logits of the next token compared)."""
import numpy as np
import pytest

import hf_models
from conftest import random_prompts

from atlas_jax import LLM
from atlas_jax.research import StateLab

ENGINE = dict(dtype="float32", page_size=8, max_num_seqs=4, max_model_len=160, max_prefill_chunk=64,
              max_num_batched_tokens=128, warmup=False, compile_cache_dir="", progress=False)
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h"])
def lab(request, ckpt_dir):
    """A StateLab over GDN state (Qwen3-Next) and Mamba2 state (Nemotron-H)."""
    maker = hf_models.make_qwen3_next if request.param == "qwen3_next" else hf_models.make_nemotron_h
    path, _ = ckpt_dir(f"{request.param}_spec", maker, vocab=256, init_std=0.2)
    return StateLab(LLM(path, speculative={"method": "ngram", "num_drafts": 3}, **ENGINE), ring_size=2)


def test_intermediates_equal_one_token_at_a_time(lab):
    prompt, extra = random_prompts(256, [21, 4], seed=2)
    a, _ = lab.start(prompt)
    lab.feed(a, extra)
    inter = lab.intermediates(a)
    b, _ = lab.start(prompt)
    for t, tok in enumerate(extra):
        lab.feed(b, [tok])
        for (h, c), (h1, c1) in zip(inter, lab.state(b)):
            np.testing.assert_allclose(h[t], h1, **TOL)
            np.testing.assert_allclose(c[t], c1, **TOL)
    lab.release(a)
    lab.release(b)


def test_rollback_then_new_tokens_equal_fresh_sequence(lab):
    prompt, extra, other = random_prompts(256, [30, 4, 3], seed=3)
    a, _ = lab.start(prompt)
    lab.feed(a, extra)
    lab.rollback(a, 2)                                        # keep extra[:2]
    got = lab.feed(a, other)
    b, _ = lab.start(prompt + extra[:2])
    np.testing.assert_allclose(got, lab.feed(b, other), **TOL)
    with pytest.raises(ValueError):
        lab.rollback(a, 3)                                    # more than the last feed holds
    lab.release(a)
    lab.release(b)


def test_checkpoint_restore_and_ring(lab):
    prompt, more = random_prompts(256, [17, 9], seed=4)
    a, _ = lab.start(prompt)
    snap = lab.checkpoint(a)
    lab.push_snapshot(a)                                      # ring: [after prompt]
    expect = lab.feed(a, [5])
    lab.push_snapshot(a)                                      # ring: [after prompt, after 5]
    for tok in more:
        lab.feed(a, [tok])
    lab.push_snapshot(a)                                      # ring_size 2: the first drops out
    lab.restore(a, snap)
    np.testing.assert_allclose(lab.feed(a, [5]), expect, **TOL)
    for tok in more:
        lab.feed(a, [tok])
    lab.restore_snapshot(a, 1)                                # "after 5"
    b, _ = lab.start(prompt + [5])
    np.testing.assert_allclose(lab.feed(a, more[:1]), lab.feed(b, more[:1]), **TOL)
    with pytest.raises(ValueError):
        lab.restore_snapshot(a, 2)
    lab.release(a)
    lab.release(b)
