"""Helpers shared by test modules (test modules never import each other): random GDN kernel inputs, a
SamplingBatch with defaults, the hypothesis request bodies the HTTP fuzz tests send, a worker script run in
a child process (a fixed virtual device count), and a probe of verify steps overlapping."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from atlas_jax.engine.sampler import SamplingBatch
from atlas_jax.engine.sampling_params import BIAS_COLUMNS, NO_BIAS
from atlas_jax.layers.norms import l2_normalize


# ---- GDN recurrence inputs (test_pallas_gdn, test_cpu_kernels) ----------------------------------------------
def gdn_inputs(rng, b, t, hk, hv, dk, dv, num_slots, positions):
    """Random GDN recurrence inputs: (q, k [B, T, Hk, Dk] l2-normalised, v [B, T, Hv, Dv], g, beta [B, T, Hv],
    state pool [num_slots, positions, Hv, Dk, Dv])."""
    n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q = l2_normalize(n(b, t, hk, dk)) * dk ** -0.5
    k = l2_normalize(n(b, t, hk, dk))
    g = -jax.nn.softplus(n(b, t, hv))
    beta = jax.nn.sigmoid(n(b, t, hv))
    return q, k, n(b, t, hv, dv), g, beta, n(num_slots, positions, hv, dk, dv)


def gdn_rows(rng, b, t, num_slots, positions):
    """Random row metadata: (slot [B] (padding rows, q_len 0: out of range), read_idx [B], q_len [B], fresh [B])."""
    q_len = rng.integers(0, t + 1, b).astype(np.int32)
    slot = rng.permutation(num_slots)[:b].astype(np.int32)
    slot[q_len == 0] = num_slots                                   # padding rows: out-of-range slot
    read_idx = rng.integers(0, positions, b).astype(np.int32)
    fresh = rng.random(b) < 0.3
    return jnp.asarray(slot), jnp.asarray(read_idx), jnp.asarray(q_len), jnp.asarray(fresh)


# ---- sampling (test_engine, test_sampling) --------------------------------------------------------------
def sampling_batch(**cols):
    """A SamplingBatch with every field defaulted to 'off' except the given columns."""
    n = len(next(iter(cols.values())))
    defaults = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0, num_logprobs=-1, seed=0, step=0, slot=0,
                    bias_ids=[NO_BIAS] * BIAS_COLUMNS, bias=[0.0] * BIAS_COLUMNS, bias_only=False)
    dtypes = dict(top_k=jnp.int32, num_logprobs=jnp.int32, seed=jnp.uint32, step=jnp.int32, slot=jnp.int32,
                  bias_ids=jnp.int32, bias_only=jnp.bool_)
    return SamplingBatch(**{k: jnp.asarray(np.asarray(cols.get(k, [d] * n)), dtypes.get(k, jnp.float32))
                            for k, d in defaults.items()})


# ---- fuzz: hypothesis request bodies for the HTTP API (test_robustness in-process, test_server on a process) ----
_weird_text = st.one_of(st.text(max_size=40), st.sampled_from(["", "\udc00", "a\ud800b", "\x00", "🦀" * 20, "x" * 3000]))
_extreme = st.one_of(st.integers(min_value=-2**80, max_value=2**80), st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30]),
                     st.floats(allow_nan=False), st.booleans(), st.none(), _weird_text,
                     st.lists(st.integers(-5, 2**40), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                   max_size=2))
_small_tokens = st.one_of(st.integers(1, 4), _extreme)
_sampling_fields = {
    "temperature": st.one_of(st.floats(0, 2), _extreme), "top_p": _extreme,
    "top_k": _extreme, "n": st.one_of(st.integers(1, 3), _extreme), "seed": _extreme, "stop": st.one_of(
        _weird_text, st.lists(_weird_text, max_size=20), _extreme), "stop_token_ids": _extreme, "logprobs": _extreme,
    "min_p": _extreme, "presence_penalty": _extreme, "repetition_penalty": _extreme, "stream": _extreme,
    "ignore_eos": _extreme, "model": st.one_of(st.just("tiny"), _extreme), "logit_bias": _extreme,
    "stream_options": st.one_of(st.just({"include_usage": True}), _extreme),
}
_message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _extreme),
                                  "content": st.one_of(_weird_text, st.lists(st.fixed_dictionaries(
                                      {"type": st.sampled_from(["text", "image_url", 5]), "text": _weird_text}),
                                      max_size=3), _extreme)})
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(_weird_text, st.lists(st.integers(-3, 600), max_size=8), st.lists(_weird_text, max_size=3),
                         st.lists(st.lists(st.integers(0, 600), max_size=4), max_size=3), _extreme),
     "max_tokens": _small_tokens},
    optional=_sampling_fields)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(_message, max_size=3), _extreme), "max_tokens": _small_tokens},
    optional={**_sampling_fields, "logprobs": _extreme, "top_logprobs": _extreme, "max_completion_tokens": _extreme})
bodies = st.one_of(st.tuples(st.just("/v1/completions"), completion_bodies),
                   st.tuples(st.just("/v1/chat/completions"), chat_bodies),
                   st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={"prompt": _extreme,
                                                                                      "messages": _extreme})),
                   st.tuples(st.just("/detokenize"), st.fixed_dictionaries({"tokens": st.one_of(
                       st.lists(st.integers(-2**40, 2**40), max_size=5), _extreme)})))


def fuzz(post, max_examples: int) -> None:
    """post(path, raw body) -> response, for `max_examples` hypothesis bodies (fixed seed)."""
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def run(case):
        fuzz_check(post, *case)
    run()


def fuzz_check(post, path, body):
    raw = json.dumps(body, allow_nan=True).encode()
    r = post(path, raw)
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]


# ---- a worker script in a child process (tests/engine/test_tensor_parallel.py, test_data_parallel.py) --------
def run_worker(script: str, workdir, timeout: int = 2400) -> dict:
    """Run `script` (python -c, argv[1] = workdir; TESTS_DIR on the environment for `import hf_models`) on CPU and
    return the JSON of its "RESULT " line (its stderr's tail in the failure when there is none)."""
    env = {**os.environ, "TESTS_DIR": os.path.dirname(__file__), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script, str(workdir)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


# ---- async verify steps (test_async_scheduling, test_speculative) ------------------------------------------
def verify_overlap(core, fn):
    """(fn(), verify steps launched meanwhile, those dispatched before the verify step before them was read)."""
    import atlas_jax.engine.runner as runner_mod
    events, launch, fetch = [], core.runner.launch_verify, runner_mod.Launched.fetch

    def launch_verify(*a, **k):
        launched = launch(*a, **k)
        events.append(("verify", id(launched)))
        return launched
    core.runner.launch_verify = launch_verify
    runner_mod.Launched.fetch = lambda self: (events.append(("fetch", id(self))), fetch(self))[1]
    try:
        out = fn()
    finally:
        del core.runner.launch_verify
        runner_mod.Launched.fetch = fetch
    verified = [i for i, (kind, _) in enumerate(events) if kind == "verify"]
    read = {key: i for i, (kind, key) in enumerate(events) if kind == "fetch"}
    return out, len(verified), sum(read[events[i][1]] > j for i, j in zip(verified, verified[1:]))
