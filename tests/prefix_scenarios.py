"""Prefix-caching scenarios shared by tests/engine/test_prefix_cache.py and tests/engine/test_mtp.py: each runs a
workload on an engine built with enable_prefix_caching and returns its outputs; `on_and_off` runs
one with caching on and then off on the same compiled engine and checks they agree."""
import numpy as np

from atlas_jax import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def seeded(i, n=1):
    return SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, ignore_eos=True, seed=1000 + i, n=n)


def ints(rng, n):
    return [int(t) for t in rng.integers(0, 256, n)]


def on_and_off(llm, scenario, *args):
    """scenario(llm, *args) with caching on, then off; asserts equal outputs and clean accounting.
    Leaves caching as it found it."""
    was_on = llm.engine.scheduler.cache is not None
    llm.engine.set_prefix_caching(True)
    before = dict(llm.prefix_cache_stats())
    try:
        on = scenario(llm, *args)
        check_accounting(llm)
        stats = {k: v - before[k] for k, v in llm.prefix_cache_stats().items() if k in before and k != "hit_rate"}
        llm.engine.set_prefix_caching(False)
        off = scenario(llm, *args)
        check_accounting(llm)
    finally:
        llm.engine.set_prefix_caching(was_on)
    assert on["tokens"] == off["tokens"]
    return on, off, stats


def check_accounting(llm):
    e = llm.engine
    assert e.blocks.num_free == e.num_pages and e.slots.num_free == e.slots.capacity
    assert not any(e.blocks.refcount)
    if e.prefix_cache is not None:
        assert e.prefix_cache.num_snapshots_used <= e.prefix_cache.num_snapshots


def multiturn(llm, sampled: bool):
    """3 conversations x 3 turns on a shared 21-token system prompt (cached by two earlier requests:
    on a hybrid the second finds the branch point and snapshots it); each turn's prompt is the last
    prompt + its answer + a new user message."""
    rng = np.random.default_rng(3)
    params = (lambda i: seeded(i)) if sampled else (lambda i: GREEDY)
    system = ints(rng, 21)
    for i in range(2):
        llm.generate([system + ints(rng, 4)], params(90 + i))
    prompts = [system + ints(rng, n) for n in (2, 7, 12)]
    tokens, cached = [], []
    for turn in range(3):
        outs = llm.generate(prompts, [params(10 * turn + i) for i in range(3)])
        tokens += [o.outputs[0].token_ids for o in outs]
        cached.append([o.num_cached_tokens for o in outs])
        prompts = [p + o.outputs[0].token_ids + ints(rng, 3 + turn) for p, o in zip(prompts, outs)]
    return {"tokens": tokens, "cached": cached, "lens": [len(p) for p in prompts]}
