"""Async scheduling (EngineCore: step t+1 dispatched before step t's tokens reach the host) gives
exactly the outputs of synchronous stepping: greedy and seeded, stop strings / ids, EOS, max_tokens,
min_tokens, penalties, logit_bias, logprobs, n > 1, prefix-cache hits, aborts while a step is in flight
and preemption (swap and recompute) with tokens still pending.

Token ids, text, finish and stop reasons must be equal; logprobs equal to 1e-5 (the shared engine
caches prefixes: a later run hits what an earlier one cached and feeds a prompt's tail in another
chunking, which moves a logprob by an ulp — also between two synchronous runs)."""
import contextlib
import dataclasses

import pytest

from conftest import random_prompts
from helpers import verify_overlap

from atlas_jax import SamplingParams
from atlas_jax.engine.speculative import DeviceProposer, NgramProposer, SelfProposer
import atlas_jax.engine.runner as runner_mod

PROMPTS = random_prompts(512, [5, 13, 9, 21, 7, 30], seed=8)


def _params():
    return [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5, logprobs=3),
            SamplingParams(max_tokens=20, temperature=0.7, seed=11, presence_penalty=0.5, repetition_penalty=1.2),
            SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, stop_token_ids=[291, 32]),
            SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4, logit_bias={5: 3.0}, stop_token_ids=[5]),
            SamplingParams(max_tokens=20, temperature=0.8, seed=1, stop=["Sta", "ox"])]  # stop strings, EOS


def _outputs(results):
    return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in r.outputs]
            for r in results]


def assert_same(a, b):
    """Outputs equal: everything exactly but logprobs, which agree to 1e-5."""
    assert [[o[:4] for o in r] for r in a] == [[o[:4] for o in r] for r in b]
    lps = [(o[4], p[4]) for r, s in zip(a, b) for o, p in zip(r, s)]
    for la, lb in lps:
        assert (la is None) == (lb is None)
        for x, y in zip(la or [], lb or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)


@contextlib.contextmanager
def _pages_short(core, mode: str, free: int):
    """The engine with only `free` KV pages left and preemption_mode `mode`; yields its scheduler."""
    sched = core.scheduler
    saved = sched.config
    sched.config = dataclasses.replace(saved, preemption_mode=mode)
    held = core.blocks.allocate(core.blocks.num_free - free)
    try:
        yield sched
    finally:
        core.blocks.free(held)
        sched.config = saved


def _draft_stats(core, fn):
    """(fn(), the rows with drafts, drafts fed and drafts accepted meanwhile)."""
    before = dict(core.spec_stats.__dict__)
    out = fn()
    return out, {k: getattr(core.spec_stats, k) - before[k] for k in ("rows", "drafted", "accepted")}


def _generate(llm, on: bool, prompts=PROMPTS, params=None):
    core = llm.engine
    core.async_scheduling = on
    try:
        return _outputs(llm.generate(prompts, params or _params()))
    finally:
        core.async_scheduling = True


@pytest.fixture
def engine(default_llm):
    assert default_llm.engine.async_scheduling          # the default
    yield default_llm
    default_llm.engine.async_scheduling = True
    assert default_llm.engine.inflight is None and not default_llm.engine.has_unfinished()


def test_async_equals_sync_and_overlaps(engine):
    core = engine.engine
    sync = _generate(engine, False)
    reasons = {(o[2], type(o[3]).__name__) for r in sync for o in r}
    assert ("stop", "str") in reasons and ("stop", "int") in reasons and ("length", "NoneType") in reasons
    events, launch, fetch = [], core.runner.launch, runner_mod.Launched.fetch
    core.runner.launch = lambda *a, **k: (events.append("launch"), launch(*a, **k))[1]
    runner_mod.Launched.fetch = lambda self: (events.append("fetch"), fetch(self))[1]
    before = core.num_overlapped
    try:
        asyn = _generate(engine, True)
    finally:
        del core.runner.launch
        runner_mod.Launched.fetch = fetch
    assert_same(asyn, sync)
    assert core.num_overlapped > before
    assert "launch,launch,fetch" in ",".join(events)       # step t+1 dispatched before step t was read


def _stepped(engine, on: bool, abort_at: dict[int, str]) -> dict[str, list[int]]:
    """Drive the core by hand; abort_at {step: request id}: aborted after that many steps (with a step
    in flight under async scheduling). Returns every request's tokens."""
    core = engine.engine
    core.async_scheduling = on
    reqs = [core.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in
            enumerate(zip(PROMPTS, [SamplingParams(max_tokens=12, temperature=0.8, seed=40 + i, ignore_eos=True)
                                    for i in range(len(PROMPTS))]))]
    steps = 0
    try:
        while core.has_unfinished():
            core.step()
            steps += 1
            if steps in abort_at:
                if on:
                    assert core.inflight is not None
                core.abort(abort_at[steps])
    finally:
        core.async_scheduling = True
    return {r.request_id: (r.seqs[0].output_ids, r.seqs[0].finish_reason) for r in reqs}


def test_abort_while_a_step_is_in_flight(engine):
    abort_at = {2: "r1", 5: "r4", 6: "r0"}
    sync = _stepped(engine, False, abort_at)
    asyn = _stepped(engine, True, abort_at)
    for rid in abort_at.values():                  # aborted: both runs' tokens are prefixes of one stream
        assert asyn[rid][1] == sync[rid][1] == "abort"
        short, long = sorted((asyn[rid][0], sync[rid][0]), key=len)
        assert short == long[:len(short)]
    assert {k: v for k, v in asyn.items() if k not in abort_at.values()} == \
        {k: v for k, v in sync.items() if k not in abort_at.values()}
    assert engine.blocks.num_free == engine.num_pages
    assert engine.slots.num_free == engine.max_num_seqs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_pending_tokens(engine, mode):
    with _pages_short(engine.engine, mode, 14) as sched:          # 112 tokens of KV for ~400 needed
        params = [dataclasses.replace(p, max_tokens=24) for p in _params()]
        sync = _generate(engine, False, params=params)
        before = sched.num_preemptions[mode]
        asyn = _generate(engine, True, params=params)
        assert sched.num_preemptions[mode] > before
    assert_same(asyn, sync)


# ---- MTP: verify steps overlapped (chase rows resolved on the device) ----------------------------------

@pytest.fixture(scope="module")
def mtp_llm():
    """The shipped atlas-tiny (trained: its MTP head's drafts get accepted on code) with 3 MTP drafts."""
    from atlas_jax import LLM
    return LLM(speculative={"method": "mtp", "num_drafts": 3}, dtype="float32", page_size=8, max_num_seqs=4,
               max_model_len=192, max_prefill_chunk=64, warmup=False, progress=False, compile_cache_dir="")


def _code_prompts():
    import inspect
    import json.decoder
    import textwrap
    src = inspect.getsource(json.decoder) + inspect.getsource(textwrap)
    return [src[i:i + n] for i, n in ((900, 120), (5200, 60), (12000, 200), (20400, 90), (2600, 150))]


def _mtp_params():
    return [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=33, temperature=0.8, seed=7, stop=["\n\n"]),
            SamplingParams(max_tokens=25, temperature=0.0, logprobs=2),                 # no drafts: logprobs
            SamplingParams(max_tokens=37, temperature=1.0, top_k=20, seed=3, n=2),
            SamplingParams(max_tokens=30, temperature=0.6, seed=9, presence_penalty=0.4)]   # no drafts: penalty


def test_mtp_async_equals_sync_and_overlaps_verify(mtp_llm):
    """MTP with async scheduling: the verify row after one in flight is dispatched before its acceptance is
    read (a chase row); outputs equal synchronous stepping's, drafts are accepted, nothing leaks."""
    core, prompts = mtp_llm.engine, _code_prompts()
    assert core._overlaps()
    sync = _generate(mtp_llm, False, prompts, _mtp_params())
    stats_sync = mtp_llm.spec_stats()
    assert stats_sync["accepted"] > 20
    before = core.num_overlapped
    asyn, verified, ahead = verify_overlap(core, lambda: _generate(mtp_llm, True, prompts, _mtp_params()))
    assert_same(asyn, sync)
    assert core.num_overlapped > before
    assert ahead > verified // 2                  # verify t+1 dispatched before verify t was read
    assert mtp_llm.spec_stats()["accepted"] > 2 * stats_sync["accepted"] - 5   # (cumulative: both runs accept)
    assert core.blocks.num_free == core.num_pages and core.slots.num_free == core.config.max_num_seqs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_mtp_async_under_preemption_and_aborts(mtp_llm, mode):
    """Pages short (preemption while verify rows are in flight: never of a sequence with slack) and an abort
    with a chase row in flight: the other requests' outputs equal synchronous stepping's."""
    core = mtp_llm.engine
    with _pages_short(core, mode, 24) as sched:
        sync = _generate(mtp_llm, False, _code_prompts(), _mtp_params())
        before = sched.num_preemptions[mode]
        asyn = _generate(mtp_llm, True, _code_prompts(), _mtp_params())
        assert sched.num_preemptions[mode] > before
    assert_same(asyn, sync)
    prompts = _code_prompts()
    core.async_scheduling = True
    reqs = [core.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), request_id=f"m{i}")
            for i, p in enumerate(prompts[:3])]
    steps, aborted = 0, False
    while core.has_unfinished():
        core.step()
        steps += 1
        victim = reqs[1].seqs[0]
        if not aborted and victim.slack and core.inflight is not None:
            core.abort("m1")
            aborted = True
    assert aborted
    ref = _generate(mtp_llm, False, [prompts[0], prompts[2]], [SamplingParams(max_tokens=30, temperature=0.0,
                                                                              ignore_eos=True)] * 2)
    assert [r.seqs[0].output_ids for r in (reqs[0], reqs[2])] == [o[0][0] for o in ref]
    assert core.blocks.num_free == core.num_pages and core.slots.num_free == core.config.max_num_seqs


# ---- ngram: drafted on the device (engine/device_ngram.py), verify steps overlapped --------------------------

@pytest.fixture(scope="module")
def ngram_llm():
    """atlas-tiny with 3 ngram drafts and no prefix cache: the drafts are made on the device."""
    from atlas_jax import LLM
    llm = LLM(speculative={"method": "ngram", "num_drafts": 3}, dtype="float32", page_size=8, max_num_seqs=4,
              max_model_len=192, max_prefill_chunk=64, warmup=False, progress=False, compile_cache_dir="")
    assert llm.engine.config.ngram_on_device and isinstance(llm.engine.proposer, DeviceProposer)
    return llm


def test_self_drafts_stay_on_the_device_and_overlap(ngram_llm):
    """The self drafter on the same engine: its draft step of t+1 is dispatched before verify t is read (a chase
    row's draft starts where that verify's acceptance left it: else it would overwrite accepted KV); outputs and
    drafts equal synchronous stepping's."""
    core, runs = ngram_llm.engine, {}
    saved, core.proposer = core.proposer, SelfProposer(core)
    try:
        for on in (False, True):
            (out, stats), verified, ahead = verify_overlap(core, lambda: _draft_stats(
                core, lambda: _generate(ngram_llm, on, _code_prompts(), _mtp_params())))
            runs[on] = (out, verified, ahead, stats)
    finally:
        core.proposer = saved
    (sync, _, _, sync_stats), (asyn, verified, ahead, async_stats) = runs[False], runs[True]
    assert_same(asyn, sync)
    assert async_stats == sync_stats and sync_stats["accepted"] > 5
    assert ahead > verified // 3


def _against_host_ngram(llm, on: bool):
    """(outputs, draft stats) with the device's drafts (async `on`), then with the host's NgramProposer
    (synchronous): the reference, whose drafts the device must reproduce exactly."""
    core, results = llm.engine, []
    for proposer, asyn in ((core.proposer, on), (NgramProposer(1, 4), False)):
        saved, core.proposer = core.proposer, proposer
        try:
            results.append(_draft_stats(core, lambda: _generate(llm, asyn, _code_prompts(), _mtp_params())))
        finally:
            core.proposer = saved
    return results


def test_ngram_on_device_overlaps_and_drafts_as_the_host_does(ngram_llm):
    """The same outputs and the same drafts (rows with drafts, drafted, accepted) as the host's proposer run
    synchronously; verify t+1 is dispatched before verify t is read; nothing leaks."""
    core = ngram_llm.engine
    assert core._overlaps()
    before = core.num_overlapped
    ((device, dstats), (host, hstats)), verified, ahead = verify_overlap(
        core, lambda: _against_host_ngram(ngram_llm, True))
    assert_same(device, host)
    assert dstats == hstats and dstats["accepted"] > 10
    assert core.num_overlapped > before and ahead > verified // 3
    assert core.blocks.num_free == core.num_pages and core.slots.num_free == core.config.max_num_seqs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_ngram_on_device_under_preemption(ngram_llm, mode):
    """Pages short: preempted sequences keep their token history (swap moves it, recompute rewrites it).
    Stepped synchronously (the same schedule as the host proposer's) the drafts equal the host's; async
    (other preemption points, and drafts capped by the pages free then) the outputs still do."""
    with _pages_short(ngram_llm.engine, mode, 24) as sched:
        before = sched.num_preemptions[mode]
        (device, dstats), (host, hstats) = _against_host_ngram(ngram_llm, False)
        assert sched.num_preemptions[mode] > before
        before = sched.num_preemptions[mode]
        asyn = _generate(ngram_llm, True, _code_prompts(), _mtp_params())
        assert sched.num_preemptions[mode] > before
    assert dstats == hstats
    assert_same(device, host)
    assert_same(asyn, host)
