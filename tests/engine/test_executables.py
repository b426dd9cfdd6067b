"""Compiled-step management (engine/executables.py, engine/buckets.py): warm-up order, serving while a
background warm-up compiles (batches of shapes still queued run padded to compiled covering shapes, with
the same outputs), and the memory-mapping budget (vm.max_map_count) — a configuration whose necessary
executables cannot fit is refused with a clear error; optional ones are left uncompiled, not fatal."""
import threading

import jax
import jax.numpy as jnp
import pytest

from atlas_jax.engine import executables
from atlas_jax.engine.buckets import covers, maximal
from atlas_jax.host_memory import memory_maps


def test_memory_maps_reads_this_process():
    held, limit = memory_maps()
    assert 0 < held < limit


def _fake_maps(monkeypatch, held: int, limit: int = 65530):
    monkeypatch.setattr(executables, "memory_maps", lambda: (held, limit))


def test_core_budget_extrapolates_the_executables_compiled_so_far(monkeypatch):
    before = (1000, 65530)
    _fake_maps(monkeypatch, 1000 + 10 * 400)                  # 10 executables of ~400 mappings each
    executables._check_core_budget(before, 10, 100)           # ~41000 projected: fits
    with pytest.raises(executables.MapBudgetError, match="vm.max_map_count"):
        executables._check_core_budget(before, 10, 200)       # ~81000 projected
    executables._check_core_budget(before, 1, 10_000)         # too few executables to extrapolate from
    executables._check_core_budget(None, 10, 10_000)          # no /proc: nothing to check


def test_budget_counts_mappings_held_before_warmup(monkeypatch):
    _fake_maps(monkeypatch, 60000 + 10 * 100)                 # other engines hold most of the budget
    with pytest.raises(executables.MapBudgetError):
        executables._check_core_budget((60000, 65530), 10, 40)
    assert not executables._room_for_one((60000, 65530), 10)  # 61100 > 0.85 x 65530
    _fake_maps(monkeypatch, 1000 + 10 * 400)
    assert executables._room_for_one((1000, 65530), 10)


def test_covers_and_maximal():
    shapes = [((1, 1),), ((8, 1),), ((1, 64),), ((2, 16),), ((2, 64),), ((8, 1), (2, 64)), ((4, 1), (1, 16))]
    assert maximal(shapes) == [((8, 1),), ((2, 64),), ((8, 1), (2, 64))]
    assert covers(((2, 64),), ((1, 16),)) and not covers(((2, 16),), ((1, 64),))
    assert not covers(((8, 1), (2, 64)), ((8, 1),))           # a different segment structure never covers


def _toy(shapes_seen):
    """Executables over a toy step: sum of a [B, T] int array (records what it ran)."""
    def step(params, state, x):
        return state + x.sum() * params
    jitted = {"step": jax.jit(step)}
    args = lambda kind, shape: (jax.ShapeDtypeStruct(shape[0], jnp.int32),)
    return executables.Executables(jitted, jnp.int32(1), jnp.int32(0)), args


def test_background_warmup_serves_covering_shapes_until_each_is_compiled(monkeypatch):
    jobs = [("step", ((b, t),)) for b in (1, 2, 4) for t in (1, 16)]
    exes, args = _toy([])
    gate = threading.Event()
    compile_one = exes.compile

    def gated(kind, shape, abstract_args):
        if shape != ((4, 16),):                               # the maximal shape compiles at once
            gate.wait(60)
        compile_one(kind, shape, abstract_args)
    monkeypatch.setattr(exes, "compile", gated)
    assert exes.warmup(jobs, args, background=True) == 1      # only the maximal shape before it returns
    assert exes.pending == 5
    assert exes.choose("step", ((1, 1),)) == ((4, 16),)       # queued: run padded to the compiled one
    gate.set()
    assert exes.wait(60)
    assert exes.pending == 0 and exes.num_compiles == 6
    assert exes.choose("step", ((1, 1),)) == ((1, 1),)
    assert exes.choose("step", ((2, 1),)) == ((2, 1),)


def test_background_warmup_leaves_shapes_for_the_budget_and_they_stay_covered(monkeypatch):
    jobs = [("step", ((b, 1),)) for b in (1, 2, 4, 8)]
    exes, args = _toy([])
    monkeypatch.setattr(executables, "_room_for_one", lambda before, done: done < 2)
    exes.warmup(jobs, args, background=True)
    assert exes.wait(60)
    assert exes.num_compiles == 2 and exes.pending == 2       # ((8,1),) then the cheapest, ((1,1),)
    assert exes.choose("step", ((1, 1),)) == ((1, 1),)
    assert exes.choose("step", ((2, 1),)) == ((8, 1),)        # the cheapest compiled covering shape


@pytest.fixture(scope="module")
def cold_llm(tiny_model_path):
    """default_llm's configuration, not warmed up (its compiles come from the run's compile cache)."""
    from atlas_jax import LLM
    llm = LLM(tiny_model_path, dtype="float32", page_size=8, max_num_seqs=8, max_model_len=128,
              max_prefill_chunk=64, max_num_batched_tokens=128, warmup=False, progress=False,
              enable_prefix_caching=True)
    yield llm
    llm.engine.runner.exes.close()


def test_engine_serves_during_a_background_warmup_with_the_same_outputs(cold_llm, default_llm, monkeypatch):
    """Before the background thread compiles anything but the maximal shapes, every batch (decode 1..8
    rows, prefills of 5..60 tokens, mixed steps) runs padded on them; greedy outputs match the fully
    warmed engine's, nothing else compiles meanwhile, and after the warm-up the grid is complete."""
    from atlas_jax import SamplingParams
    from conftest import random_prompts
    exes = cold_llm.engine.runner.exes
    gate = threading.Event()
    rest = exes._compile_rest
    monkeypatch.setattr(exes, "_compile_rest", lambda *a: (gate.wait(300), rest(*a)))
    core = cold_llm.engine.warmup(progress=False, background=True)
    try:
        assert 0 < core < exes.pending
        prompts = random_prompts(512, [5, 60, 17, 33, 9, 41, 3], seed=3)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in cold_llm.generate(prompts, params)]
        assert cold_llm.num_compiles == core                  # padded to the maximal shapes, nothing compiled
        want = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
        assert got == want
    finally:
        gate.set()
    assert exes.wait(300) and exes.pending == 0
    compiled = cold_llm.num_compiles                           # every warm-up job once (default_llm is shared:
    assert compiled == len(cold_llm.runner.warmup_jobs(swap=True, prefix=True))   # other tests compile on it)
    again = [o.outputs[0].token_ids for o in cold_llm.generate(prompts, params)]
    assert again == want and cold_llm.num_compiles == compiled
