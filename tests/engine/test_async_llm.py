"""AsyncLLM: streaming outputs, abort, concurrency, refusal of bad input, engine failure."""
import asyncio
import logging

import pytest

from conftest import random_prompts

from atlas_jax import SamplingParams
from atlas_jax.engine.async_llm import AsyncLLM, EngineDeadError


PROMPTS = random_prompts(512, [5, 30, 12, 44, 7], seed=40)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(default_llm):
    """Reference outputs from LLM.generate, computed before any AsyncLLM thread owns the engine."""
    return {"stream": default_llm.generate("The quick brown fox", SamplingParams(max_tokens=20, temperature=0.0,
                                                                                ignore_eos=True))[0].outputs[0],
            "batch": [o.outputs[0].token_ids for o in default_llm.generate(PROMPTS, GREEDY)]}


@pytest.fixture
def allm(default_llm, offline):
    a = AsyncLLM.from_llm(default_llm)        # the engine thread owns the engine until shutdown
    yield a
    a.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_stream_deltas_add_up_to_the_offline_result(allm, offline):
    offline = offline["stream"]
    p = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, output_kind="delta")

    async def go():
        return [o async for o in allm.generate("The quick brown fox", p)]
    chunks = run(go())
    assert len(chunks) > 1 and chunks[-1].finished and not chunks[0].finished
    assert "".join(c.outputs[0].text for c in chunks) == offline.text
    assert sum((c.outputs[0].token_ids for c in chunks), []) == offline.token_ids
    assert chunks[-1].outputs[0].finish_reason == "length"


def test_concurrent_streams_and_abort_frees_pages(allm, default_llm, offline):
    async def one(prompt, rid):
        last = None
        async for out in allm.generate(prompt, GREEDY, request_id=rid):
            last = out
        return last.outputs[0].token_ids

    async def aborted():
        agen = allm.generate([1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), "victim")
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 2:
                break                             # client goes away mid-stream
        await agen.aclose()

    async def go():
        return await asyncio.gather(*(one(pr, f"r{i}") for i, pr in enumerate(PROMPTS)), aborted())
    results = run(go())
    assert results[:-1] == offline["batch"]
    for _ in range(100):                          # the abort lands on the engine thread
        if not default_llm.engine.requests:
            break
        run(asyncio.sleep(0.02))
    assert default_llm.blocks.num_free == default_llm.num_pages
    assert default_llm.slots.num_free == default_llm.max_num_seqs


def test_bad_input_raises_before_queueing(allm):
    async def go():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in allm.generate([1] * 500, SamplingParams(max_tokens=2)):
                pass
        out = [o async for o in allm.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0))]
        return out
    assert run(go())[-1].finished


def test_engine_failure_fails_requests_and_refuses_new_ones(default_llm, offline, caplog):
    caplog.set_level(logging.CRITICAL, logger="atlas_jax.engine")
    a = AsyncLLM.from_llm(default_llm)
    real_step = default_llm.engine.step

    def broken():
        raise RuntimeError("device on fire")
    default_llm.engine.step = broken
    try:
        async def go():
            with pytest.raises(EngineDeadError, match="device on fire"):
                async for _ in a.generate("Hi", SamplingParams(max_tokens=3)):
                    pass
            with pytest.raises(EngineDeadError):
                a.add_request("Hi", SamplingParams(max_tokens=3))
            # A request validated before the engine died and registered after its fan-out of failures
            # (the window between add_request_async's check and its registration) is refused, not
            # left waiting on a stream nobody will end.
            late = default_llm.engine.make_request("Hi", SamplingParams(max_tokens=3))
            with pytest.raises(EngineDeadError):
                a._enqueue(late)
            assert a.num_in_flight == 0
        run(go())
        assert not a.is_running
        died = [r for r in caplog.records if "the engine died" in r.getMessage()]      # logged, with the traceback
        assert died and died[0].exc_info is not None and "device on fire" in caplog.text
    finally:
        default_llm.engine.step = real_step
        a.shutdown()
    assert not default_llm.engine.requests and not default_llm.engine.scheduler.has_work()
    assert default_llm.blocks.num_free == default_llm.num_pages
