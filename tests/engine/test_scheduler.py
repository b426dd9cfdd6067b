"""Engine invariants under continuous batching, on the embedded default model (GDN + attention
+ MoE): batch invariance across batch mates, chunk sizes, mixed steps and preemption; order
independence and replay; bit-exact swap; no leaks; no compiles after warm-up."""
import dataclasses
import random
import sys

import jax
import numpy as np
import pytest

from conftest import random_prompts

from atlas_jax import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_llm):
    assert default_llm.num_warmup_compiles > 0
    return default_llm


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm):
    assert llm.blocks.num_free == llm.num_pages and llm.slots.num_free == llm.max_num_seqs
    assert not llm.engine.requests and not llm.engine.scheduler.has_work()


@pytest.fixture
def scheduler_config(llm):
    """Lets a test change scheduler knobs (chunk size, preemption mode) on the shared engine."""
    sched = llm.engine.scheduler
    saved = sched.config
    yield lambda **kw: setattr(sched, "config", dataclasses.replace(saved, **kw))
    sched.config = saved


@pytest.fixture
def memory_pressure(llm):
    """Holds all but n KV pages, so the engine must preempt to make progress."""
    held = []

    def hold(free: int):
        held.extend(llm.blocks.allocate(llm.blocks.num_free - free))

    def release():
        llm.blocks.free(held)
        held.clear()
    hold.release = release
    yield hold
    release()


@pytest.fixture
def no_prefix_cache(llm):
    """The shared engine caches prefixes; a test of plain chunking / step mixing turns that off."""
    llm.engine.set_prefix_caching(False)
    yield
    llm.engine.set_prefix_caching(True)


PROMPTS = random_prompts(512, [23, 5, 61, 2, 40, 17, 9, 33], seed=11)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's greedy tokens when it runs by itself."""
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_batch_invariance_across_chunk_sizes_and_mixed_steps(llm, alone, scheduler_config, no_prefix_cache, chunk):
    scheduler_config(max_prefill_chunk=chunk)
    before = dict(llm.runner.step_counts)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == alone
    if chunk > 1:                       # prefill chunks shared steps with decode rows
        assert llm.runner.step_counts["mixed"] > before["mixed"]
    assert_no_leaks(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_batch_invariance_under_preemption(llm, alone, scheduler_config, memory_pressure, mode):
    scheduler_config(preemption_mode=mode)
    memory_pressure(free=14)            # 112 tokens of KV for 8 requests that need ~230
    before = dict(llm.engine.scheduler.num_preemptions)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions[mode] > before[mode]
    assert tokens(outs) == alone
    assert any(o.metrics.num_preemptions for o in outs)


def test_sampled_outputs_survive_preemption(llm, scheduler_config, memory_pressure):
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True,
                             presence_penalty=0.5, repetition_penalty=1.2) for i in range(len(PROMPTS))]
    free_run = tokens(llm.generate(PROMPTS, params))
    for mode in ("swap", "recompute"):
        scheduler_config(preemption_mode=mode)
        memory_pressure(free=14)
        assert tokens(llm.generate(PROMPTS, params)) == free_run
        memory_pressure.release()
    assert_no_leaks(llm)


def test_order_independence_and_replay(llm, alone):
    rng = random.Random(5)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=7 + i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    reference = tokens(llm.generate(PROMPTS, sampled))
    order = list(range(len(PROMPTS)))
    rng.shuffle(order)
    shuffled = tokens(llm.generate([PROMPTS[i] for i in order], [sampled[i] for i in order]))
    assert [shuffled[order.index(i)] for i in range(len(PROMPTS))] == reference
    # one request replayed 12 times between others of random lengths: byte-identical each time
    others = random_prompts(512, [rng.randint(1, 60) for _ in range(12)], seed=12)
    mixed, params = [], []
    for o in others:
        mixed += [o, PROMPTS[2]]
        params += [SamplingParams(max_tokens=rng.randint(1, 20), temperature=1.0, seed=rng.randint(0, 99)), GREEDY]
    outs = tokens(llm.generate(mixed, params))
    assert all(t == alone[2] for t in outs[1::2])
    assert_no_leaks(llm)


@pytest.mark.parametrize("chunk", [None, 2])
def test_swap_round_trip_is_bit_exact(llm, chunk, monkeypatch):
    """Swap moves pages in fixed chunks (one executable per direction); 2-page chunks: a sequence spans several."""
    if chunk:
        monkeypatch.setattr(llm.runner.state_ops, "swap_chunk", chunk)
    eng = llm.engine
    req = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    seq = req.seqs[0]
    while seq.num_cached < 50:
        eng.step()
    used = seq.pages[:llm.blocks.pages_for(seq.num_cached)]
    assert len(used) > 2 * (chunk or 0) + 1
    saved = llm.runner.state_ops.save_sequence_state(used, seq.slot)
    new_pages = llm.blocks.allocate(len(used))
    new_slot = llm.slots.allocate(1)[0]
    try:
        llm.runner.state_ops.restore_sequence_state(new_pages, new_slot, saved)
        state = jax.device_get(llm.runner.state)
        for (k, v) in state.model.kv:
            np.testing.assert_array_equal(k[new_pages], k[used])
            np.testing.assert_array_equal(v[new_pages], v[used])
        for (h, conv) in state.model.ssm:
            np.testing.assert_array_equal(h[new_slot], h[seq.slot])
            np.testing.assert_array_equal(conv[new_slot], conv[seq.slot])
        np.testing.assert_array_equal(state.penalties.out_count[new_slot], state.penalties.out_count[seq.slot])
        np.testing.assert_array_equal(state.penalties.in_prompt[new_slot], state.penalties.in_prompt[seq.slot])
    finally:
        llm.blocks.free(new_pages)
        llm.slots.free([new_slot])
        eng.abort(req.request_id)
    assert_no_leaks(llm)


def test_bad_requests_do_not_disturb_requests_in_flight(llm, alone):
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS[:4]]
    eng.step()
    eng.step()
    for bad_prompt, bad_params in (([1] * 200, GREEDY), ([], GREEDY), ([1, 10**6], GREEDY),
                                   ([1, 2], "not params")):
        with pytest.raises(ValueError):
            eng.add_request(bad_prompt, bad_params)
    for bad in (dict(temperature=-1.0), dict(top_p=1.5), dict(top_p=0.0), dict(max_tokens=0),
                dict(min_p=2.0), dict(presence_penalty=3.0), dict(repetition_penalty=0.0), dict(logprobs=99),
                dict(temperature=float("nan")), dict(stop=[""])):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    while eng.has_unfinished():
        eng.step()
    assert [r.output().outputs[0].token_ids for r in reqs] == alone[:4]
    assert_no_leaks(llm)


def test_request_that_can_never_fit_is_refused(llm):
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.generate([3] * 128, GREEDY)
    small = LLM(dtype="float32", page_size=8, num_pages=4, max_num_seqs=2, max_model_len=128, warmup=False)
    with pytest.raises(ValueError, match="needs 7 KV pages of 8 tokens; the cache has 4"):
        small.generate([3] * 40, SamplingParams(max_tokens=10))
    assert small.num_compiles == 0


def test_warmup_fills_the_persistent_compile_cache(tiny_model_path, tmp_path):
    """In a fresh process with an empty $ATLAS_JAX_HOME: warm-up writes every compiled step to
    $ATLAS_JAX_HOME/xla_cache, and a second process loads them instead of compiling."""
    import json
    import os
    import subprocess
    code = ("import json; from atlas_jax import LLM; from atlas_jax.engine.llm import default_compile_cache_dir as d; "
            "import os; llm = LLM(%r, dtype='float32', page_size=8, max_num_seqs=1, max_model_len=32, "
            "max_prefill_chunk=16, progress=False); "
            "print(json.dumps([llm.num_warmup_compiles, len(os.listdir(d()))]))" % tiny_model_path)
    env = {k: v for k, v in os.environ.items() if k != "ATLAS_JAX_DISABLE_COMPILE_CACHE"}
    env["ATLAS_JAX_HOME"] = str(tmp_path)
    run = lambda: json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                            check=True).stdout.strip().splitlines()[-1])
    compiles, entries = run()
    assert compiles > 0 and entries >= compiles
    assert run()[1] == entries                                   # the second start wrote nothing new


def test_no_compiles_after_warmup_over_random_workload(llm, scheduler_config, memory_pressure):
    rng = np.random.default_rng(3)
    before = llm.num_compiles
    prompts = [list(map(int, rng.integers(0, 512, rng.integers(1, 100)))) for _ in range(50)]
    params = []
    for i in range(50):
        kind = i % 5
        params.append(SamplingParams(
            max_tokens=int(rng.integers(1, 28)), ignore_eos=bool(i % 2), seed=i,
            temperature=0.0 if kind == 0 else 0.9, top_k=20 if kind == 2 else 0, top_p=0.8 if kind == 3 else 1.0,
            min_p=0.05 if kind == 4 else 0.0, frequency_penalty=0.3 if kind == 1 else 0.0,
            logprobs=3 if kind == 2 else None, n=2 if i % 7 == 0 else 1))
    memory_pressure(free=30)              # and some preemption on the way
    outs = llm.generate(prompts, params)
    assert llm.num_compiles == before
    assert all(len(c.token_ids) >= 1 for o in outs for c in o.outputs)
    assert sum(len(o.outputs) for o in outs) == sum(p.n for p in params)


def test_preemption_victim_is_least_progress_even_when_it_asks(llm, memory_pressure):
    """A long decode is running; a newer request's second prefill chunk needs pages and none are free:
    the newcomer (least progress) yields, the decode is not evicted (before: the asking sequence was
    exempt, so the decode with more work done was preempted for it)."""
    eng = llm.engine
    long_prompt, new_prompt = random_prompts(512, [90, 120], seed=12)
    long = eng.add_request(long_prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    while len(long.seqs[0].output_ids) < 2:
        eng.step()
    new = eng.add_request(new_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while new.seqs[0].num_cached == 0:
        eng.step()
    assert 0 < new.seqs[0].num_cached < len(new_prompt) < long.seqs[0].num_cached + 40
    memory_pressure(0)
    eng.step()                                       # new's next chunk needs pages: none are free
    assert new.seqs[0].metrics.num_preemptions == 1 and long.seqs[0].metrics.num_preemptions == 0
    memory_pressure.release()
    while eng.has_unfinished():
        eng.step()
    assert tokens([new.output()]) == tokens(llm.generate(new_prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                                                    ignore_eos=True)))
    assert_no_leaks(llm)


def test_decode_rows_leave_the_prefill_budget_whole(llm, no_prefix_cache):
    """The decode segment runs beside the prefill segment in its own compiled shape, so running decodes
    do not shorten prefill chunks: with 3 rows decoding, two prompts that fill max_num_batched_tokens
    exactly are both prefilled whole in one step (counting the decode rows cut the second one short,
    padded it back to the same shape and cost a step more)."""
    eng = llm.engine
    cfg = eng.scheduler.config
    chunk = cfg.max_num_batched_tokens // 2
    assert chunk <= cfg.max_prefill_chunk and cfg.max_prefill_rows >= 2
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    decoding = [eng.add_request(p, params) for p in random_prompts(512, [5, 6, 7], seed=21)]
    while any(not r.seqs[0].output_ids for r in decoding):
        eng.step()
    fresh = [eng.add_request(p, params) for p in random_prompts(512, [chunk, chunk], seed=22)]
    eng.step()
    assert [r.seqs[0].num_cached for r in fresh] == [chunk, chunk]
    while eng.has_unfinished():
        eng.step()
    assert_no_leaks(llm)


def _steps_until_done(engine, req, limit=400) -> int:
    for n in range(1, limit + 1):
        engine.step()
        if req.finished:
            return n
    raise AssertionError("the canary never finished")


@pytest.mark.parametrize("fair", [True, False])
def test_a_flooding_client_cannot_starve_another(llm, alone, fair):
    """Client A queues 3 x max_num_seqs long sequences, then client B one short request: B is admitted at
    once (a slot preempted from A, by recompute) and finishes within a few steps of its own length,
    while A's sequences still produce exactly their unpreempted tokens. With both under one client
    (fair=False: the same order without fairness) the canary waits for A's sequences to drain."""
    engine = llm.engine
    flood_params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    flood = [engine.add_request(PROMPTS[i % 4], flood_params, f"flood-{i}", client="A")
             for i in range(3 * llm.max_num_seqs)]
    for _ in range(4):
        engine.step()
    canary = engine.add_request(PROMPTS[5], GREEDY, "canary", client="B" if fair else "A")
    before = engine.scheduler.num_preemptions["fairness"]
    try:
        steps = _steps_until_done(engine, canary)
        assert canary.seqs[0].output_ids == alone[5]
        if fair:
            assert steps <= GREEDY.max_tokens + 4, steps
            assert engine.scheduler.num_preemptions["fairness"] == before + 1        # one victim, no thrash
        else:
            assert steps > 2 * flood_params.max_tokens, steps        # it queued behind the flood
        while engine.has_unfinished():
            engine.step()
    finally:
        for rid in list(engine.requests):                           # a failed check leaves the engine clean
            engine.abort(rid)
    full = {i: llm.generate(PROMPTS[i], flood_params)[0].outputs[0].token_ids for i in range(4)}
    for i, req in enumerate(flood):
        assert req.seqs[0].output_ids == full[i % 4], i
    assert_no_leaks(llm)


def test_page_preemption_takes_from_the_client_over_its_share(llm, alone, memory_pressure):
    """KV pages run short while client A runs 6 sequences (over its share of 4) beside client B's canary,
    which has the least progress: the sequences preempted for pages are A's, never the canary's, and
    every output is exact."""
    engine = llm.engine
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    memory_pressure(34)
    try:
        flood = [engine.add_request(PROMPTS[i], params, f"a-{i}", client="A") for i in (0, 2, 4, 6, 7, 1)]
        for _ in range(3):
            engine.step()
        canary = engine.add_request(PROMPTS[5], GREEDY, "canary", client="B")
        while engine.has_unfinished():
            engine.step()
    finally:
        memory_pressure.release()
        for rid in list(engine.requests):
            engine.abort(rid)
    assert sum(r.seqs[0].metrics.num_preemptions for r in flood) > 0       # pages did run short
    assert canary.seqs[0].metrics.num_preemptions == 0
    assert canary.seqs[0].output_ids == alone[5]
    for i, req in zip((0, 2, 4, 6, 7, 1), flood):
        assert req.seqs[0].output_ids == llm.generate(PROMPTS[i], params)[0].outputs[0].token_ids, i
    assert_no_leaks(llm)
