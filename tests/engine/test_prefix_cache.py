"""Prefix caching is exact: on a tiny Qwen3-Next (GDN + attention: hits end at recurrent-state
snapshots), a tiny Nemotron-H (Mamba2 state snapshots) and a tiny Qwen3 (attention only: hits end at any token), every output with caching on
equals the output with it off — greedy and seeded sampling — for multi-turn conversations with a
shared system prompt, prompts shorter than a page, hits ending mid-page and a few tokens past a page
boundary, exact repeats, n > 1 (forked), swap and recompute preemption, after evictions, and with
the ngram and self-speculative drafters (MTP: tests/engine/test_mtp.py). Off is the same compiled engine
with caching switched off (`set_prefix_caching`), so both runs share every executable. After each
run every page and slot is back (idle cached pages count as free) and no reference is left."""
import dataclasses

import numpy as np
import pytest

from prefix_scenarios import GREEDY, ints, multiturn, on_and_off, seeded

from atlas_jax import SamplingParams
from atlas_jax.engine.speculative import NgramProposer, ScriptedProposer, SelfProposer

# The default run: every drafter on Qwen3-Next, greedy; seeded sampling with no drafter; each other family
# with no drafter and its own drafter, greedy. The rest of the matrix runs with -m slow.
SLOW_IDS = ("test_multiturn_exact[qwen3_next-ngram-seeded", "test_multiturn_exact[qwen3_next-self-seeded",
            "test_multiturn_exact[nemotron_h-ngram-", "test_multiturn_exact[nemotron_h-none-seeded",
            "test_multiturn_exact[nemotron_h-self-seeded", "test_multiturn_exact[qwen3-none-seeded",
            "test_multiturn_exact[qwen3-ngram-seeded")


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h", "qwen3"])
def model(request, spec_pair):
    """(family, llm): the session's speculative engine of the family (conftest.spec_pair), drafter set per test."""
    return request.param, spec_pair(request.param)[1]


def drafter(llm, name):
    return {"none": None, "ngram": NgramProposer(1, 4), "self": SelfProposer(llm.engine)}[name]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", ["none", "ngram", "self"])
def test_multiturn_exact(model, name, sampled):
    arch, llm = model
    if name == "self" and arch == "qwen3":
        pytest.skip("self-speculative drafting skips recurrent layers; Qwen3 has none")
    llm.engine.proposer = drafter(llm, name)
    on, _, stats = on_and_off(llm, multiturn, sampled)
    assert all(c >= 21 for c in on["cached"][0])                  # the shared system prompt (cached once)
    for turn in (1, 2):                                            # the whole previous turn but its last token
        assert all(c > 21 + 10 for c in on["cached"][turn]), on["cached"]
    assert stats["hit_tokens"] > 0.5 * stats["query_tokens"]


def edges(llm):
    """Prompts shorter than a page, exact repeats, hits mid-page and 3 tokens past a page boundary."""
    rng = np.random.default_rng(4)
    short, p19 = ints(rng, 3), ints(rng, 19)
    runs = [short, short + ints(rng, 2), short, short,
            p19 + ints(rng, 9), p19 + ints(rng, 5), p19 + ints(rng, 7), p19 + ints(rng, 6)]
    outs = [llm.generate(p, GREEDY)[0] for p in runs]
    return {"tokens": [o.outputs[0].token_ids for o in outs], "cached": [o.num_cached_tokens for o in outs]}


def test_edges_exact(model):
    arch, llm = model
    llm.engine.proposer = None
    on, _, _ = on_and_off(llm, edges)
    c = on["cached"]
    assert c[1] == 3 and c[6] == 19 and c[7] == 19               # shorter than a page; 3 past a boundary
    assert c[3] == 2                                               # an exact repeat re-runs its last token
    if arch == "qwen3":
        assert c[2] == 2 and c[5] == 19                            # attention alone: a hit at any token
    else:
        assert c[5] == 0                                           # ... a hybrid needs a snapshot: a branch point


def forked(llm):
    rng = np.random.default_rng(5)
    prompt = ints(rng, 29)
    outs = llm.generate([prompt, ints(rng, 11)], [seeded(1, n=3), seeded(2, n=2)])
    return {"tokens": [[c.token_ids for c in o.outputs] for o in outs]}


@pytest.mark.parametrize("name", ["none", "ngram"])
def test_n_forks_the_prompt(model, name):
    _, llm = model
    llm.engine.proposer = drafter(llm, name)
    on, _, stats = on_and_off(llm, forked)
    assert stats["hit_tokens"] >= 2 * 28 + 10                      # siblings start at the last prompt token
    assert len({tuple(t) for t in on["tokens"][0]}) > 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_exact(model, mode):
    """Few free pages: conversations preempt each other while drafting (ngram) and hitting."""
    _, llm = model
    sched = llm.engine.scheduler
    config = sched.config
    sched.config = dataclasses.replace(config, preemption_mode=mode)
    llm.engine.proposer = drafter(llm, "ngram")
    before = sum(sched.num_preemptions.values())

    def pressed(llm):
        held = llm.blocks.allocate(llm.num_pages - 20)
        try:
            return multiturn(llm, True)
        finally:
            llm.blocks.free(held)
    try:
        on_and_off(llm, pressed)
    finally:
        sched.config = config
    assert sched.num_preemptions[mode] > 0 and sum(sched.num_preemptions.values()) > before


def test_after_evictions(model):
    """A cache filled by earlier turns, then most pages taken: LRU eviction, and still exact."""
    _, llm = model
    llm.engine.proposer = None

    def evicted(llm):
        first = multiturn(llm, False)
        held = llm.blocks.allocate(llm.num_pages - 24)          # evicts idle cached pages
        try:
            return {"tokens": first["tokens"] + multiturn(llm, False)["tokens"]}
        finally:
            llm.blocks.free(held)
    _, _, stats = on_and_off(llm, evicted)
    assert stats["evicted_pages"] > 0 and stats["hit_tokens"] > 0


def interleaved(llm):
    """Hits and misses together on reused slots: 12 requests, 4 slots, half of them repeat a prefix."""
    rng = np.random.default_rng(6)
    bases = [ints(rng, n) for n in (14, 27)]
    prompts = []
    for i in range(12):
        prompts.append(bases[i % 2][:10 + i] + ints(rng, 3) if i % 3 else ints(rng, 5 + 2 * i))
    outs = llm.generate(prompts, [seeded(i) if i % 2 else GREEDY for i in range(12)])
    return {"tokens": [o.outputs[0].token_ids for o in outs]}


def test_isolation_hits_and_misses(model):
    _, llm = model
    llm.engine.proposer = None
    on_and_off(llm, interleaved)


def test_reset_and_stats(model):
    _, llm = model
    llm.engine.proposer = None
    llm.engine.set_prefix_caching(True)
    try:
        llm.generate([list(range(40))], GREEDY)
        st = llm.prefix_cache_stats()
        assert st["cached_pages"] > 0 and st["idle_pages"] == st["cached_pages"]
        llm.reset_prefix_cache()
        st = llm.prefix_cache_stats()
        assert st["cached_pages"] == st["snapshots"] == 0 and llm.blocks.num_unused == llm.num_pages
    finally:
        llm.engine.set_prefix_caching(False)


def test_interval_snapshots_during_decode(model):
    """Every snapshot_interval tokens (16 here) a sequence snapshots, decode included: a later prompt
    that extends the answer part-way hits at the last interval snapshot within it."""
    arch, llm = model
    llm.engine.proposer = drafter(llm, "ngram")
    cache = llm.engine.prefix_cache
    rng = np.random.default_rng(8)
    prompt, extra = ints(rng, 40), ints(rng, 3)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def extended(llm):
        first = llm.generate(prompt, params)[0].outputs[0].token_ids
        second = llm.generate(prompt + first[:20] + extra, GREEDY)[0]
        return {"tokens": [first, second.outputs[0].token_ids], "cached": second.num_cached_tokens}
    saved, cache.snapshot_interval = cache.snapshot_interval, 16
    try:
        on, _, stats = on_and_off(llm, extended)
    finally:
        cache.snapshot_interval = saved
    if arch != "qwen3":
        assert 40 < on["cached"] < 60 and stats["snapshots_taken"] >= 3
    else:
        assert on["cached"] == 60


def test_stop_inside_accepted_drafts(model):
    """A stop token in the middle of an accepted run ends the output early while the cache holds
    the state after every accepted draft: the sequence caches only what its tokens describe."""
    _, llm = model
    prompt = ints(np.random.default_rng(7), 21)
    truth = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    llm.engine.proposer = ScriptedProposer(lambda seq, k: truth[len(seq.output_ids):len(seq.output_ids) + k])
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[truth[4]])

    def stopped(llm):
        outs = [llm.generate(prompt + extra, params)[0] for extra in ([], [], [5])]
        assert all(o.error is None for o in outs) and outs[0].outputs[0].finish_reason == "stop"
        return {"tokens": [o.outputs[0].token_ids for o in outs]}
    on, _, _ = on_and_off(llm, stopped)
    assert on["tokens"][0] == truth[:truth.index(truth[4]) + 1]
