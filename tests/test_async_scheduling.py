"""Async scheduling (EngineCore: step t+1 dispatched before step t's tokens reach the host) gives
exactly the outputs of synchronous stepping: greedy and seeded, stop strings / ids, EOS, max_tokens,
penalties, logprobs, n > 1 and prefix-cache hits (the shared engine has prefix caching on)."""
import pytest

from conftest import random_prompts

from atlas_jax import SamplingParams


def _params():
    return [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5, logprobs=3),
            SamplingParams(max_tokens=20, temperature=0.7, seed=11, presence_penalty=0.5, repetition_penalty=1.2),
            SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, stop_token_ids=[7, 9, 11]),
            SamplingParams(max_tokens=16, temperature=0.0, min_tokens=4, logit_bias={5: 3.0})]


def _run(llm, prompts, on: bool):
    core = llm.engine
    core.async_scheduling = on
    try:
        outs = llm.generate(prompts, _params())
    finally:
        core.async_scheduling = False
    return [[(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in r.outputs] for r in outs]


@pytest.mark.xfail(strict=True, reason="async scheduling is unfinished (issue 38): a seeded row with logprobs "
                   "differs from synchronous stepping; async_scheduling defaults to off until this passes")
def test_async_equals_sync_and_overlaps(default_llm):
    core = default_llm.engine
    prompts = random_prompts(default_llm.cfg.vocab_size, [5, 13, 9, 21, 7], seed=8)
    sync = _run(default_llm, prompts, False)
    before = core.num_overlapped
    events = []
    launch, fetch = core.runner.launch, None
    import atlas_jax.engine.runner as runner_mod
    fetch = runner_mod.Launched.fetch

    def traced_launch(*a, **k):
        events.append("launch")
        return launch(*a, **k)

    def traced_fetch(self):
        events.append("fetch")
        return fetch(self)
    core.runner.launch = traced_launch
    runner_mod.Launched.fetch = traced_fetch
    try:
        asyn = _run(default_llm, prompts, True)
    finally:
        del core.runner.launch
        runner_mod.Launched.fetch = fetch
    assert asyn == sync
    assert core.num_overlapped > before
    assert "launch,launch,fetch" in ",".join(events)       # step t+1 dispatched before step t was read
    assert not core.has_unfinished() and core.inflight is None
