"""Sampling features against independent host references: penalties (vLLM semantics) and
logprobs recomputed in numpy from the engine's own prompt logits of prompt + output, min-p
support, stop strings and incremental detokenisation against the tokenizer, n > 1, metrics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_prompts
from helpers import sampling_batch

from atlas_jax import SamplingParams
from atlas_jax.engine.sampler import sample
from atlas_jax.models.decoder import argmax


@pytest.fixture(scope="module")
def llm(default_llm):
    return default_llm


def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def penalised(logits, prompt, output, rep, pres, freq):
    """vLLM's penalties, written independently in numpy."""
    logits = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, int), minlength=len(logits)) if output else np.zeros(len(logits))
    seen = counts > 0
    seen[list(set(prompt))] = True
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
    return logits - freq * counts - pres * (counts > 0)


# negative / below-one values encourage repeats, so the penalties change this random model's path
@pytest.mark.parametrize("rep,pres,freq", [(1.0, 0.0, 0.0), (0.3, 0.0, 0.0), (1.0, -2.0, 0.0), (1.5, -0.5, -1.0)])
def test_greedy_with_penalties_and_logprobs_match_numpy(llm, rep, pres, freq):
    prompt = random_prompts(llm.cfg.vocab_size, [5], seed=21)[0] * 4        # repetitive: penalties bite
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=rep,
                       presence_penalty=pres, frequency_penalty=freq, logprobs=5)
    out = llm.generate(prompt, p)[0].outputs[0]
    logits = llm.prompt_logits(prompt + out.token_ids)                      # [len, V]
    for i, tok in enumerate(out.token_ids):
        raw = logits[len(prompt) + i - 1]
        assert tok == int(np.argmax(penalised(raw, prompt, out.token_ids[:i], rep, pres, freq)))
        ref = log_softmax(raw.astype(np.float64))
        lp = out.logprobs[i]
        assert lp[tok] == pytest.approx(ref[tok], abs=1e-4)
        top5 = [t for t in lp if t != tok or len(lp) == 5]
        assert set(np.argsort(-ref)[:5].tolist()) <= set(lp) and len(lp) in (5, 6)
        for t in top5:
            assert lp[t] == pytest.approx(ref[t], abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids)))


def test_penalties_change_sampling_and_reset_per_request(llm):
    prompt = random_prompts(llm.cfg.vocab_size, [4], seed=22)[0] * 5
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    strong = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=-2.0, presence_penalty=-2.0)
    a = llm.generate(prompt, plain)[0].outputs[0].token_ids
    b = llm.generate(prompt, strong)[0].outputs[0].token_ids
    c = llm.generate(prompt, plain)[0].outputs[0].token_ids      # slot reuse must not carry history over
    assert a == c and a != b
    assert len(set(b)) < len(set(a))


def test_min_p_support():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
    n = 4000
    s = sampling_batch(temperature=np.ones(n), min_p=np.full(n, 0.4), seed=np.full(n, 3), step=np.arange(n))
    freq = np.bincount(np.asarray(jax.jit(sample)(jnp.tile(logits, (n, 1)), s).tokens), minlength=4) / n
    assert freq[2:].sum() == 0
    np.testing.assert_allclose(freq[:2], [0.625, 0.375], atol=0.03)


def test_incremental_text_equals_full_decode(llm):
    for seed in range(4):
        prompt = random_prompts(llm.cfg.vocab_size, [6], seed=30 + seed)[0]
        out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True))[0]
        c = out.outputs[0]
        assert c.text == llm.tokenizer.decode(c.token_ids)


def test_stop_strings(llm):
    prompt = "def fibonacci(n):"
    free = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].outputs[0]
    text = free.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    cut = text.find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop, "@@never@@"]))[0]
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[:cut], "stop", stop)
    assert c.token_ids == free.token_ids[:len(c.token_ids)] and len(c.token_ids) < len(free.token_ids)
    assert llm.tokenizer.decode(c.token_ids).startswith(text[:cut] + stop)
    incl = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert incl.text == text[:cut] + stop


def test_n_completions_and_metrics(llm):
    out = llm.generate("Hello", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    single = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == out.outputs[1].token_ids       # child i draws with seed + i
    m = out.metrics
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_generated_tokens == 8
    assert 0 < m.time_to_first_token <= m.finished_time - m.arrival_time
    assert m.decode_tokens_per_s > 0


def test_logit_bias(default_llm):
    """+100 forces a token, -100 bans one (the first token is then the argmax of the prompt's last
    logits without it, from the scoring path), and a biased row leaves its batch neighbours alone."""
    llm = default_llm
    prompts = random_prompts(llm.cfg.vocab_size, [9, 14], seed=21)
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**greedy))]
    forced = llm.generate(prompts[0], SamplingParams(logit_bias={7: 100.0}, **greedy))[0].outputs[0].token_ids
    assert forced == [7] * 6
    last = llm.prompt_logits(prompts[0])[-1]
    last[plain[0][0]] = -np.inf
    banned = llm.generate(prompts[0], SamplingParams(logit_bias={plain[0][0]: -100.0}, **greedy))[0].outputs[0]
    assert banned.token_ids[0] == int(np.argmax(last)) != plain[0][0]
    mixed = llm.generate(prompts, [SamplingParams(logit_bias={7: 100.0}, **greedy), SamplingParams(**greedy)])
    assert mixed[0].outputs[0].token_ids == [7] * 6 and mixed[1].outputs[0].token_ids == plain[1]
    sampled = llm.generate(prompts[1], SamplingParams(max_tokens=5, temperature=1.0, seed=3, logit_bias={9: 100.0}))
    assert sampled[0].outputs[0].token_ids == [9] * 5


def test_allowed_token_ids_min_tokens_bad_words_truncate(default_llm):
    """vLLM's extra sampling fields. allowed_token_ids: every sampled token is in the set and greedy takes
    the argmax inside it; min_tokens: EOS and stop tokens are banned until then (a row forced to EOS ends
    right after min_tokens); bad_words: a greedy row never completes the word; truncate_prompt_tokens:
    the same output as the prompt's tail alone."""
    llm = default_llm
    eos = llm.cfg.eos_token_ids[0]
    prompt = random_prompts(llm.cfg.vocab_size, [24], seed=31)[0]
    greedy = dict(temperature=0.0, ignore_eos=True)
    allowed = [3, 50, 77, 120]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5, allowed_token_ids=allowed))
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    last = llm.prompt_logits(prompt)[-1]
    first = llm.generate(prompt, SamplingParams(max_tokens=1, allowed_token_ids=allowed, **greedy))
    assert first[0].outputs[0].token_ids[0] == allowed[int(np.argmax(last[allowed]))]

    to_eos = dict(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    assert len(llm.generate(prompt, SamplingParams(**to_eos))[0].outputs[0].token_ids) == 1
    held = llm.generate(prompt, SamplingParams(min_tokens=4, **to_eos))[0].outputs[0]
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and eos not in held.token_ids[:4]
    assert held.finish_reason == "stop"
    stop7 = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, min_tokens=3,
                                                logit_bias={7: 100.0}, stop_token_ids=[7]))[0].outputs[0]
    assert stop7.token_ids[-1] == 7 and len(stop7.token_ids) == 4 and stop7.stop_reason == 7

    plain = llm.generate(prompt, SamplingParams(max_tokens=8, **greedy))[0].outputs[0].token_ids
    words = [llm.tokenizer.decode(plain[i:i + 2]) for i in range(len(plain) - 1)]
    word = next(w for i, w in enumerate(words) if llm.tokenizer.encode(w) == plain[i:i + 2])   # round-trips
    banned = llm.engine.inputs.bad_word_ids([word])
    out = llm.generate(prompt, SamplingParams(max_tokens=8, bad_words=[word], **greedy))[0].outputs[0].token_ids
    assert out != plain
    for w in banned:
        assert all(tuple(out[i:i + len(w)]) != w for i in range(len(out)))

    tail = llm.generate(prompt[-10:], SamplingParams(max_tokens=6, **greedy))[0]
    cut = llm.generate(prompt, SamplingParams(max_tokens=6, truncate_prompt_tokens=10, **greedy))[0]
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids


def test_stop_token_text_left_out_unless_asked(default_llm):
    """A stop_token_ids hit ends the output without the token's text; include_stop_str_in_output keeps it
    (as vLLM). The token id itself is always in token_ids."""
    llm = default_llm
    prompt = random_prompts(llm.cfg.vocab_size, [12], seed=41)[0]
    tok = next(t for t in range(300, 400) if llm.tokenizer.decode([t]).isalpha())
    args = dict(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias={tok: 100.0}, stop_token_ids=[tok])
    out = llm.generate(prompt, SamplingParams(**args))[0].outputs[0]
    assert out.token_ids == [tok] and out.text == "" and out.stop_reason == tok
    kept = llm.generate(prompt, SamplingParams(include_stop_str_in_output=True, **args))[0].outputs[0]
    assert kept.text == llm.tokenizer.decode([tok])


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.integers(0, 2**31 - 1), st.sampled_from(["ties", "nan", "inf", "plain"]))
def test_argmax_is_jnp_argmax(rows, vocab, seed, kind):
    """decoder.argmax (two plain reductions, the fast form on CPU) == jnp.argmax: first maximum, first NaN."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, (rows, vocab)).astype(np.float32) if kind == "ties" else \
        rng.standard_normal((rows, vocab)).astype(np.float32)
    if kind in ("nan", "inf"):
        mask = rng.random((rows, vocab)) < 0.3
        x[mask] = np.nan if kind == "nan" else rng.choice([np.inf, -np.inf], mask.sum())
    x[0] = -np.inf if kind == "inf" else x[0]                  # a row with every token banned
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_sampling_columns_persist_per_slot(default_llm, monkeypatch):
    """The persistent batch: a slot's sampling parameters reach the device once per sequence, not every step,
    and the next request in the same slot samples with its own (outputs equal to re-sending every step)."""
    llm, batch = default_llm, default_llm.runner.batch
    prompts = random_prompts(llm.cfg.vocab_size, [7, 11], seed=41)
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, logit_bias={7: 3.0}, ignore_eos=True)]
    sent, real = [], batch.updates
    monkeypatch.setattr(batch, "updates", lambda rows, b: (sent.extend(r.slot for r in rows), real(rows, b))[1])
    before = llm.runner.step_counts.copy()
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    steps = sum(llm.runner.step_counts.values()) - sum(before.values())
    assert steps >= 10 and len(sent) == 2 and len(set(sent)) == 2           # one update per sequence
    sent.clear()
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params[::-1])]   # slots swap params
    assert again[::-1] == first and len(sent) == 2
    real_sampling = batch.sampling

    def resend(rows, b):
        batch.forget()
        return real_sampling(rows, b)
    monkeypatch.setattr(batch, "sampling", resend)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first
