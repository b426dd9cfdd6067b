"""Speculative decoding: greedy output identity with every drafter and draft pattern (all right,
all wrong, right-then-wrong, ragged counts per row), across chunked prefill and preemption;
rollback exactness of KV and GDN h / conv state against a fresh sequence fed exactly the accepted
tokens; stop tokens inside an accepted run; the sampled distribution against the exact target
distribution (chi-square); no compiles after warm-up. Tiny checkpoints use init 0.2 and a slow
GDN decay so that a wrong state changes tokens."""
import math
import zlib

import jax
import numpy as np
import pytest

import hf_models
from conftest import SPEC_ENGINE, random_prompts

from atlas_jax import LLM, SamplingParams
from atlas_jax.engine.speculative import NgramProposer, ScriptedProposer, SelfProposer

ENGINE = SPEC_ENGINE
NUM_DRAFTS = 3
LENGTHS = [5, 20, 70]               # decode-sized, one chunk, chunks carrying state (chunk 64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class Script:
    """Drafts from the baseline's greedy outputs (the truth), spoilt per `mode`."""

    def __init__(self, vocab):
        self.vocab, self.truth, self.mode = vocab, {}, "right"

    def __call__(self, seq, k):
        truth = self.truth[tuple(seq.prompt_ids)]
        right = truth[len(seq.output_ids):len(seq.output_ids) + k]
        wrong = [(t + 1) % self.vocab for t in right]
        if self.mode == "right":
            return right
        if self.mode == "wrong":
            return wrong
        if self.mode == "right_then_wrong":
            return right[:1] + wrong[1:]
        n = zlib.crc32(bytes(seq.output_ids)) % (k + 1)          # "ragged": 0..k drafts, right
        return right[:n]


@pytest.fixture(scope="module", params=["qwen3_next", "nemotron_h", "qwen3"])
def engines(request, spec_pair):
    """(family, base, spec, script, prompts): the session's engine pair (conftest.spec_pair; tests set
    spec's drafter), a Script of the base's greedy outputs."""
    base, spec = spec_pair(request.param)
    script = Script(256)
    prompts = random_prompts(256, LENGTHS, seed=5)
    for p, o in zip(prompts, base.generate(prompts, GREEDY)):
        script.truth[tuple(p)] = o.outputs[0].token_ids
    return request.param, base, spec, script, prompts


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _stats_delta(spec, fn):
    before = dict(spec.engine.spec_stats.__dict__)
    out = fn()
    after = spec.engine.spec_stats
    return out, {k: getattr(after, k) - before[k] for k in ("rows", "drafted", "accepted")}


@pytest.mark.parametrize("mode", ["right", "wrong", "right_then_wrong", "ragged"])
def test_greedy_identity_with_scripted_drafts(engines, mode):
    _, _, spec, script, prompts = engines
    script.mode = mode
    spec.engine.proposer = ScriptedProposer(script)
    truth = [script.truth[tuple(p)] for p in prompts]
    mixed = spec.runner.step_counts["verify_mixed"]
    out, d = _stats_delta(spec, lambda: _tokens(spec.generate(prompts, GREEDY)))
    assert out == truth
    assert spec.runner.step_counts["verify_mixed"] > mixed          # drafts verified beside prefill chunks
    alone = _tokens(spec.generate(prompts[1], GREEDY))
    assert alone == truth[1:2]
    assert d["drafted"] > 0
    if mode == "right":
        assert d["accepted"] == d["drafted"]
    elif mode == "wrong":
        assert d["accepted"] == 0
    elif mode == "right_then_wrong":
        assert d["accepted"] == d["rows"]            # exactly the one right draft of each row
    assert spec.engine.blocks.num_free == spec.num_pages and spec.engine.slots.num_free == spec.max_num_seqs


def test_seeded_sampling_identity(engines):
    """Sampled with a seed, speculation changes nothing: each verify position draws the token plain
    decoding draws there (same key) and accepts the draft iff it equals it."""
    _, base, spec, script, prompts = engines
    script.mode = "right"
    spec.engine.proposer = ScriptedProposer(script)
    params = [SamplingParams(temperature=0.25, top_p=0.9, max_tokens=12, ignore_eos=True, seed=s) for s in (1, 2, 3)]
    out, d = _stats_delta(spec, lambda: _tokens(spec.generate(prompts, params)))
    assert out == _tokens(base.generate(prompts, params))
    assert 0 < d["accepted"] < d["drafted"]


def test_ngram_identity(engines):
    _, base, spec, _, _ = engines
    rng = np.random.default_rng(1)
    pattern = [int(t) for t in rng.integers(0, 256, 6)]
    prompts = [pattern * 5, [3, 4] + pattern * 3, random_prompts(256, [40], seed=9)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec.engine.proposer = NgramProposer(1, 4)
    out, d = _stats_delta(spec, lambda: _tokens(spec.generate(prompts, params)))
    assert out == _tokens(base.generate(prompts, params))
    assert d["drafted"] > 0


def test_ngram_lookup():
    ngram = NgramProposer(1, 3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]        # longest suffix, most recent match
    assert ngram.lookup([5, 1, 7, 1], 3) == [7, 1]
    assert ngram.lookup([1, 2, 3], 2) == []


def test_stop_token_inside_accepted_run(engines):
    """All drafts right, and the stop id sits mid-run: output ends exactly where plain decoding ends."""
    _, base, spec, script, prompts = engines
    script.mode = "right"
    spec.engine.proposer = ScriptedProposer(script)
    truth = script.truth[tuple(prompts[2])]
    stop = truth[5]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    ref = base.generate(prompts[2], params)[0].outputs[0]
    out = spec.generate(prompts[2], params)[0].outputs[0]
    assert out.token_ids == ref.token_ids == truth[:truth.index(stop) + 1]
    assert out.finish_reason == ref.finish_reason == "stop"
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)     # max_tokens cuts a run
    assert _tokens(spec.generate(prompts[2], short)) == [truth[:6]]


def test_preemption_with_speculation(engines):
    """Hold most pages so that sequences are preempted (swap) while verifying."""
    _, _, spec, script, prompts = engines
    script.mode = "right_then_wrong"
    spec.engine.proposer = ScriptedProposer(script)
    held = spec.engine.blocks.allocate(spec.num_pages - 15)   # 15 free: all admitted (12), growing to ~19
    try:
        out = _tokens(spec.generate(prompts, GREEDY))
    finally:
        spec.engine.blocks.free(held)
    assert out == [script.truth[tuple(p)] for p in prompts]
    assert sum(spec.engine.stats()["num_preemptions"].values()) > 0


def _cached_state(llm, seq):
    """(KV of the cached positions per attention layer, (h, conv) at the read position per GDN layer)."""
    state = jax.device_get(llm.runner.state.model)
    ps = llm.page_size
    pos = np.arange(seq.num_cached)
    pages = np.asarray(seq.pages)[pos // ps]
    kv = [(k[pages, pos % ps], v[pages, pos % ps]) for k, v in state.kv]
    ssm = [(h[seq.slot, seq.state_idx], c[seq.slot, seq.state_idx]) for h, c in state.ssm]
    return kv, ssm


def test_rollback_state_equals_fresh_sequence(engines):
    """After verify steps with all / none / some drafts accepted, the KV of the cached tokens and the
    GDN / Mamba2 state equal those of a fresh sequence prefilled with exactly the accepted tokens."""
    family, base, spec, script, prompts = engines
    for mode in ("right", "wrong", "right_then_wrong"):
        script.mode = mode
        spec.engine.proposer = ScriptedProposer(script)
        req = spec.engine.add_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        seq = req.seqs[0]
        while spec.engine.spec_stats.verify_steps == 0 or len(seq.output_ids) < 9:
            spec.engine.step()
        kv, ssm = _cached_state(spec, seq)
        fed = (seq.prompt_ids + seq.output_ids)[:seq.num_cached]
        fresh = base.engine.add_request(fed, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while fresh.seqs[0].num_cached < len(fed):
            base.engine.step()
        kv_ref, ssm_ref = _cached_state(base, fresh.seqs[0])
        for (k, v), (k_ref, v_ref) in zip(kv, kv_ref):
            np.testing.assert_allclose(k, k_ref, atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(v, v_ref, atol=2e-5, rtol=1e-4)
        for (h, c), (h_ref, c_ref) in zip(ssm, ssm_ref):
            np.testing.assert_allclose(h, h_ref, atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(c, c_ref, atol=2e-5, rtol=1e-4)
        assert (family == "qwen3") == (not ssm)
        spec.engine.abort(req.request_id)
        base.engine.abort(fresh.request_id)


def test_no_compiles_after_warmup_with_speculation(engines):
    """Nemotron-H (Mamba2 + attention + MoE; Qwen3-Next's engine is warmed up in conftest.default_llm)."""
    family, _, spec, script, prompts = engines
    if family != "nemotron_h":
        pytest.skip("one family suffices (warm-up compiles every bucket)")
    spec.engine.warmup(progress=False)
    before = spec.num_compiles
    script.mode = "ragged"
    spec.engine.proposer = ScriptedProposer(script)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, repetition_penalty=1.2)]
    for i in range(3):
        spec.generate(prompts[i:i + 3], params[:len(prompts[i:i + 3])])
    assert spec.num_compiles == before


def _chi2_critical(df, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_speculative_sampling_matches_target_distribution(ckpt_dir):
    """Tokens sampled at temperature 1 with fixed-guess drafts (x1 from the prefill, x2 accepted or drawn
    from the residual, x3 the bonus or cut): the empirical joint distribution of (x1, x2) fits the
    target's exact p(x1) p(x2 | x1) (chi-square, p = 0.001)."""
    vocab = 6
    path, _ = ckpt_dir("qwen3_tiny_vocab", hf_models.make_qwen3, vocab=vocab, init_std=0.3, seed=2)
    prompt = [1, 4, 2]

    def drafts(seq, k):      # a fixed guess per context: a wrong residual would over-weight it
        last = (seq.prompt_ids + seq.output_ids)[-1]
        return [(last + 1 + i) % vocab for i in range(k)]
    spec = LLM(path, speculative={"method": "scripted", "num_drafts": 2, "propose": drafts}, **ENGINE)
    p1 = jax.nn.softmax(spec.prompt_logits(prompt)[-1])
    exact = np.array([np.asarray(p1[a]) * np.asarray(jax.nn.softmax(spec.prompt_logits(prompt + [a])[-1]))
                      for a in range(vocab)]).reshape(-1)
    n = 800
    outs = spec.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
                                        for s in range(n)])
    counts = np.zeros(vocab * vocab)
    for o in outs:
        a, b, _ = o.outputs[0].token_ids
        counts[a * vocab + b] += 1
    assert spec.spec_stats()["accepted"] > 50 and spec.spec_stats()["drafted"] > spec.spec_stats()["accepted"]
    expected = exact * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    stat = float(np.sum((obs - exp) ** 2 / exp))
    assert stat < _chi2_critical(len(obs) - 1), (stat, obs, exp)


def test_self_speculative_identity(engines, ckpt_dir):
    """Drafts from the model without its GDN / Mamba2 layers (one compiled draft step), verified by the full model."""
    family, base, spec, _, prompts = engines
    if family == "qwen3":
        qwen3, _ = ckpt_dir("qwen3_spec", hf_models.make_qwen3, vocab=256, init_std=0.2)
        with pytest.raises(ValueError, match="no recurrent layers"):
            LLM(qwen3, speculative={"method": "self"}, **ENGINE)
        return
    spec.engine.proposer = SelfProposer(spec.engine)
    drafts = spec.runner.step_counts["draft"]
    out, d = _stats_delta(spec, lambda: _tokens(spec.generate(prompts, GREEDY)))
    assert out == _tokens(base.generate(prompts, GREEDY))
    assert spec.runner.step_counts["draft"] > drafts and d["drafted"] > 0


@pytest.mark.slow
def test_every_k_up_to_8(engines):
    """num_drafts 7, rows drafting 1 .. 7 right tokens: verify steps of every K in 2..8 (one compiled
    step per (batch, K)), output identical."""
    family, base, _, script, prompts = engines
    if family != "qwen3_next":
        pytest.skip("the hybrid model is the one with state to roll back")
    count = {"n": 1}
    spec = LLM(base.model_path, speculative={"method": "scripted", "num_drafts": 7,
                                             "propose": lambda seq, k: script.truth[tuple(seq.prompt_ids)][
                                                 len(seq.output_ids):len(seq.output_ids) + min(k, count["n"])]},
               **ENGINE)
    for n in range(1, 8):
        count["n"] = n
        assert _tokens(spec.generate(prompts[1:2], GREEDY)) == [script.truth[tuple(prompts[1])]]
    ks = {key[1][0][1] for key in spec.runner.exes._cache if key[0] == "verify"}
    assert ks == set(range(2, 9)), ks


def test_speculative_config_parsing():
    from atlas_jax.engine.speculative import SpeculativeConfig
    assert SpeculativeConfig.from_cli("ngram:3") == SpeculativeConfig(method="ngram", num_drafts=3)
    assert SpeculativeConfig.from_cli('{"method": "mtp", "num_drafts": 2}').method == "mtp"
    assert SpeculativeConfig.from_cli("") is None
    for bad, msg in [("bogus", "method must be one of"), ("ngram:x", "integer"), ("ngram:9", "1..7"),
                     ("{bad json", "JSON"), ("scripted", "programmatic")]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.from_cli(bad)
    with pytest.raises(ValueError, match="unknown speculative option"):
        SpeculativeConfig.parse({"method": "ngram", "k": 2})


def test_streamed_deltas_with_speculation(engines):
    """Several tokens per step: AsyncLLM's deltas still add up to the offline result, stop strings hold."""
    import asyncio

    from atlas_jax.engine.async_llm import AsyncLLM
    family, _, spec, script, prompts = engines
    if family != "qwen3":
        pytest.skip("one family suffices")
    script.mode = "right"
    spec.engine.proposer = ScriptedProposer(script)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind="delta")
    allm = AsyncLLM.from_llm(spec, warmup=False)
    try:
        async def go():
            return [o async for o in allm.generate(prompts[1], params)]
        chunks = asyncio.run(go())
    finally:
        allm.shutdown()
    assert sum((c.outputs[0].token_ids for c in chunks), []) == script.truth[tuple(prompts[1])]
    assert any(len(c.outputs[0].token_ids) > 1 for c in chunks)        # a verify step emitted several
    assert chunks[-1].finished


def test_spec_stats_acceptance_by_position():
    """Per-position acceptance (vLLM's per-position counts): position j's rate is over rows that drafted j."""
    from atlas_jax.engine.speculative import SpecStats
    stats = SpecStats()
    for drafted, accepted in ((3, 1), (2, 2), (3, 0), (1, 1)):
        stats.record(drafted, accepted)
    summary = stats.summary()
    assert summary["acceptance_by_position"] == [0.75, round(1 / 3, 4), 0.0]
    assert summary["acceptance_rate"] == 4 / 9
