"""Engine-level behaviour on the embedded default model: sampling reproducibility, batch
invariance, padding inertness, stop conditions, bad input, no leaked pages or slots."""
import collections
import re

import numpy as np
import pytest

from conftest import random_prompts
from helpers import sampling_batch

from atlas_jax import SamplingParams
from atlas_jax.engine.buckets import mixed_decode_buckets, powers_of_two, prefill_token_buckets
from atlas_jax.engine.row import RowInput
from atlas_jax.engine.sampler import sample


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def test_default_model_generates_text(llm):
    out = llm.generate("def add(a, b):", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.prompt_token_ids == llm.tokenizer.encode("def add(a, b):")


def test_seeded_sampling_reproducible_and_batch_invariant(llm):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompts = random_prompts(llm.cfg.vocab_size, [5, 11, 19], seed=4)
    alone = llm.generate(prompts[1], p)[0].outputs[0].token_ids
    again = llm.generate(prompts[1], p)[0].outputs[0].token_ids
    batched = llm.generate(prompts, [SamplingParams(max_tokens=9, temperature=1.0, seed=7), p,
                                     SamplingParams(max_tokens=20, temperature=0.0)])[1].outputs[0].token_ids
    assert alone == again == batched
    other_seed = llm.generate(prompts[1], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50,
                                                         seed=99, ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_temperature_zero_and_top_k_one_are_greedy(llm):
    prompt = random_prompts(llm.cfg.vocab_size, [9], seed=5)[0]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    topk1 = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids


def test_sampler_distribution():
    """top-k / top-p keep exactly the expected support; the sample follows softmax(logits / T)."""
    import jax
    import jax.numpy as jnp
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    def draw(temperature, top_k, top_p):
        s = sampling_batch(temperature=np.full(n, temperature), top_k=np.full(n, top_k), top_p=np.full(n, top_p),
                           seed=np.full(n, 5), step=np.arange(n))
        return np.bincount(np.asarray(jax.jit(sample)(jnp.tile(logits, (n, 1)), s).tokens), minlength=4) / n
    np.testing.assert_allclose(draw(1.0, 0, 1.0), [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert draw(1.0, 2, 1.0)[2:].sum() == 0
    np.testing.assert_allclose(draw(1.0, 2, 1.0)[:2], [0.625, 0.375], atol=0.03)
    top_p = draw(1.0, 0, 0.7)       # 0.5 + 0.3 reaches 0.7: the two most likely survive
    assert top_p[2:].sum() == 0 and top_p[1] > 0.3


def test_padding_rows_and_columns_are_inert(llm):
    """3 rows of 3/1/2 tokens run in a 4x4 bucket (one padding row, padding columns): only the
    real tokens' page positions and the real rows' slots change (every recurrent slot of the real rows; penalty
    histories at most theirs: a fresh engine's rows were already empty)."""
    import jax
    runner = llm.runner
    pools = lambda: jax.tree.leaves((runner.state.model, runner.state.draft_kv))
    penalties = lambda: jax.tree.leaves(runner.state.penalties)
    before_penalties = [np.asarray(x).copy() for x in penalties()]
    before = [np.asarray(x).copy() for x in pools()]
    changed_rows = lambda b, a: set(np.flatnonzero(np.any((b != np.asarray(a)).reshape(len(b), -1), axis=1)).tolist())
    snapshots = [np.asarray(x).copy() for x in jax.tree.leaves(runner.state.snapshots)]
    pages = llm.blocks.allocate(3)
    slots = llm.slots.allocate(3)
    lengths = [3, 1, 2]
    try:
        rows = [RowInput(tokens=[7] * n, start=0, block_table=[pg], slot=sl) for n, pg, sl in zip(lengths, pages, slots)]
        runner.step([rows[1]], [rows[0], rows[2]])
        written = {(pg, pos) for n, pg in zip(lengths, pages) for pos in range(n)}
        for b, a in zip(snapshots, jax.tree.leaves(runner.state.snapshots)):    # prefix cache: untouched
            np.testing.assert_array_equal(b, np.asarray(a))
        for b, a in zip(before, pools()):
            a = np.asarray(a)
            if b.ndim == 4 and b.shape[1] == llm.page_size:       # KV pages [P, S, H, D]
                changed = {tuple(ix) for ix in np.argwhere(np.any(b != a, axis=(2, 3)))}
                assert changed == written
            else:                                                 # recurrent-state slots
                assert changed_rows(b, a) == set(slots)
        for b, a in zip(before_penalties, penalties()):
            assert changed_rows(b, a) <= set(slots)
    finally:
        llm.blocks.free(pages)
        llm.slots.free(slots)


def test_stop_token_and_eos(llm):
    prompt = random_prompts(llm.cfg.vocab_size, [7], seed=6)[0]
    free_run = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    ids = free_run.outputs[0].token_ids
    stop_at = ids[4]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == ids[:ids.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_more_requests_than_seqs_and_no_leaks(llm):
    prompts = random_prompts(llm.cfg.vocab_size, [3, 30, 12, 5, 9, 21, 2, 14, 6, 40, 1], seed=8)
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, p)
    singles = [llm.generate(pr, p)[0].outputs[0].token_ids for pr in prompts[:3]]
    assert [o.outputs[0].token_ids for o in outs[:3]] == singles
    assert llm.blocks.num_free == llm.num_pages and llm.slots.num_free == llm.max_num_seqs


def test_bad_input_is_refused_clearly(llm):
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.generate([1] * 128, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 99999]], SamplingParams(max_tokens=2))
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-3), dict(seed=2**64)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert llm.blocks.num_free == llm.num_pages and llm.slots.num_free == llm.max_num_seqs


def test_sampled_row_independent_of_neighbours_path():
    """A temperature-only row draws the same token whether its neighbour is greedy (no mask
    built) or uses top-k / top-p (mask built for the batch)."""
    import jax
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 300)) * 3
    def batch(t1, k1, p1, step):
        return sampling_batch(temperature=[0.8, t1], top_k=[0, k1], top_p=[1.0, p1], seed=[11, 12], step=[step, 0])
    f = jax.jit(sample)
    for step in range(20):
        a = f(logits, batch(0.0, 0, 1.0, step)).tokens[0]
        b = f(logits, batch(1.0, 5, 0.5, step)).tokens[0]
        assert a == b


def test_request_output_is_a_snapshot_and_deltas_are_explicit(default_llm):
    """Request.output() has no side effects and hands out nothing the engine keeps mutating (token
    ids, logprobs, metrics); take_delta() is the one call that advances what was streamed, and the
    deltas add up to the final output."""
    eng = default_llm.engine
    req = eng.add_request(random_prompts(eng.cfg.vocab_size, [7], seed=4)[0],
                          SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    deltas = []
    while not req.seqs[0].output_ids:
        eng.step()
    deltas.append(req.take_delta())
    snap = req.output()
    frozen = (list(snap.outputs[0].token_ids), len(snap.outputs[0].logprobs), snap.metrics.num_generated_tokens)
    assert req.output().outputs[0].token_ids == frozen[0]                   # output() twice: the same
    while eng.has_unfinished():
        eng.step()
        deltas.append(req.take_delta())
    assert (snap.outputs[0].token_ids, len(snap.outputs[0].logprobs), snap.metrics.num_generated_tokens) == frozen
    final = req.output().outputs[0]
    assert sum((d.outputs[0].token_ids for d in deltas), []) == final.token_ids and len(final.token_ids) == 6
    assert "".join(d.outputs[0].text for d in deltas) == final.text


def test_mixed_steps_pad_decode_rows_less_than_twice():
    """A compute-bound mixed step pays for every padding row: from its smallest bucket (16, or a quarter of
    the slots) up, the decode segment is less than twice the decoding rows (a 64-slot engine used to pad
    4 rows to 64), with at most three buckets (compiles: |these| x |prefill shapes|); small engines keep one."""
    assert mixed_decode_buckets(powers_of_two(8)) == [8]
    assert mixed_decode_buckets(powers_of_two(16)) == [16]
    assert mixed_decode_buckets(powers_of_two(64)) == [16, 32, 64]
    assert mixed_decode_buckets(powers_of_two(256)) == [64, 128, 256]
    for cap in (32, 64, 128, 512):
        buckets = mixed_decode_buckets(powers_of_two(cap))
        assert len(buckets) <= 3 and buckets[-1] == cap and buckets[0] == max(16, cap // 4)
        for n in range(buckets[0], cap + 1):
            assert n <= next(b for b in buckets if b >= n) < 2 * n


def test_prefill_buckets_pad_chunks_of_64_tokens_and_more_less_than_twice():
    assert prefill_token_buckets(32) == [16, 32]
    assert prefill_token_buckets(256) == [16, 64, 128, 256]
    assert prefill_token_buckets(300) == [16, 64, 128, 256, 300]
    for cap in (64, 100, 256, 2048):
        buckets = prefill_token_buckets(cap)
        for n in range(64, cap + 1):
            assert n <= next(b for b in buckets if b >= n) < 2 * n


def test_mixed_steps_at_each_decode_bucket_equal_solo_runs(tiny_model_path):
    """A 32-slot engine admits one prompt chunk a step, so its mixed steps carry 1 .. ~20 decoding rows: padded to
    16, then to 32 (runner.mixed_decode_buckets). Greedy tokens equal each prompt run alone; nothing
    compiles after warm-up."""
    from atlas_jax import LLM
    llm = LLM(tiny_model_path, dtype="float32", page_size=8, max_num_seqs=32, max_model_len=80, max_prefill_chunk=16,
              max_prefill_rows=1, warmup=True, progress=False)
    assert llm.runner.grid.mixed_decode_buckets == [16, 32]
    used = collections.Counter()
    executable = llm.runner.exes.get

    def recording(kind, args):
        used[tuple(seg.tokens.shape for seg in args[0])] += kind == "step"
        return executable(kind, args)
    llm.runner.exes.get = recording
    compiles = llm.num_compiles
    prompts = random_prompts(512, [20 + i % 9 for i in range(20)], seed=5)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert used[((16, 1), (1, 16))] and used[((32, 1), (1, 16))]
    assert together == [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert llm.num_compiles == compiles


def test_no_compiled_step_copies_a_state_pool(default_llm):
    """Every serving step updates the KV and recurrent-state pools in place. A mixed step used to copy each KV
    pool twice (a segment's KV write after another segment's attention had read the pool)."""
    import jax
    r = default_llm.runner
    pools = {",".join(map(str, a.shape)) for a in jax.tree.leaves(r.state.model)}
    copy = re.compile(r"= f32\[(" + "|".join(pools) + r")\]\S* copy\(")
    for kind, shape in [("step", s) for s in r.grid.step_shapes()] + [("verify", s) for s in r.grid.verify_shapes()]:
        text = r.exes.get(kind, r.abstract_args(kind, shape)).as_text()
        assert not [line for line in text.splitlines() if copy.search(line)], (kind, shape)
