"""Every Pallas kernel lowers for CUDA, through Triton, at the shapes real checkpoints use.

JAX lowers a program for another platform without its hardware (`jax.export` with
platforms=["cuda"]), which runs the Pallas GPU lowering rules on this CPU-only machine: a kernel
that fails here cannot run on a GPU. Arguments are ShapeDtypeStructs, so GB-sized pools cost
nothing. The table: attention and GDN head shapes from the checkpoints' config.json files, decode
batch buckets, every verify K 2..8, the engine's prefill chunk buckets, bf16 and fp32.
(Triton's own compile — register and shared-memory limits — only a GPU shows: scripts/gpu_check.sh.)
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from atlas_jax.kernels import Kernels
from atlas_jax.layers.moe import MoeSpec, moe
from pallas_kernels import gdn, grouped_matmul, paged_attention
from pallas_kernels.common import BACKEND
from pallas_kernels.cross_lower import TRITON_CALL, lower_for_cuda as lower

SPEC = jax.ShapeDtypeStruct
I32, F32, BF16 = jnp.int32, jnp.float32, jnp.bfloat16

# name: (attention heads, KV heads, head dim), (GDN key heads, value heads, Dk, Dv) or None
MODELS = {
    "Qwen3-0.6B": ((16, 8, 128), None),
    "Qwen3-14B": ((40, 8, 128), None),                       # GQA group of 5
    "Qwen3-32B": ((64, 8, 128), None),
    "Qwen3-30B-A3B": ((32, 4, 128), None),
    "Qwen3-235B-A22B": ((64, 4, 128), None),
    "Qwen3-Next-80B-A3B": ((16, 2, 256), (16, 32, 128, 128)),
    "Qwen3.5-27B": ((24, 4, 256), (16, 48, 128, 128)),       # group of 6, value/key head ratio 3
    "atlas-tiny": ((4, 2, 32), (2, 4, 32, 32)),              # the embedded default model
    "Nemotron-H-8B": ((32, 8, 128), None),
    "Nemotron-3-Nano-30B-A3B": ((32, 2, 128), None),
}
# Mamba2 through the same kernels without the delta rule: (groups, heads, state size, head_dim) as
# (key heads, value heads, Dk, Dv)
MAMBA_MODELS = {
    "Nemotron-H-8B": (8, 128, 128, 64),
    "Nemotron-3-Nano-30B-A3B": (8, 64, 128, 64),
}
DECODE_BATCHES = (1, 128)
VERIFY_K = tuple(range(2, 9))
PREFILL = ((1, 16), (1, 256), (4, 256), (1, 2048))  # (rows, chunk tokens)
PAGE_SIZE, NUM_PAGES, MAX_PAGES = 16, 4096, 256


def _assert_triton(module: str):
    assert BACKEND == "triton"
    assert TRITON_CALL in module
    assert "mosaic" not in module.lower()


def _attention_shapes():
    cases = [(b, 1) for b in DECODE_BATCHES] + [(8, k) for k in VERIFY_K] + list(PREFILL)
    return [(name, b, t) for name in MODELS for b, t in cases]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,b,t", _attention_shapes())
def test_paged_attention_lowers(name, b, t, dtype):
    h, hkv, d = MODELS[name][0]
    pool = SPEC((NUM_PAGES, PAGE_SIZE, hkv, d), dtype)
    fn = lambda q, k, v, table, start, q_len: paged_attention.paged_attention(
        q, k, v, table, start, q_len, scale=d ** -0.5)
    _assert_triton(lower(fn, SPEC((b, t, h, d), dtype), pool, pool, SPEC((b, MAX_PAGES), I32),
                         SPEC((b,), I32), SPEC((b,), I32)))


def test_paged_attention_options_lower():
    """Soft-cap, sliding window and an explicit split count, on the group-of-5 shape."""
    h, hkv, d = MODELS["Qwen3-14B"][0]
    pool = SPEC((NUM_PAGES, 32, hkv, d), BF16)
    for t, opts in itertools.product((1, 4, 128), (dict(soft_cap=30.0), dict(window=512), dict(num_splits=3))):
        fn = lambda q, k, v, table, start, q_len: paged_attention.paged_attention(
            q, k, v, table, start, q_len, scale=0.1, **opts)
        _assert_triton(lower(fn, SPEC((2, t, h, d), BF16), pool, pool, SPEC((2, 64), I32), SPEC((2,), I32),
                             SPEC((2,), I32)))


# (name, (key heads, value heads, Dk, Dv), delta_rule): GDN models, then Mamba2 models
RECURRENT_MODELS = ([(name, g, True) for name, (_, g) in MODELS.items() if g]
                    + [(f"{name} (Mamba2)", m, False) for name, m in MAMBA_MODELS.items()])


@pytest.mark.parametrize("v_dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,shape,delta_rule,b,t", [
    (name, shape, delta, b, t) for name, shape, delta in RECURRENT_MODELS
    for b, t in [(bb, 1) for bb in DECODE_BATCHES] + [(8, k) for k in VERIFY_K]])
def test_gdn_recurrent_lowers(name, shape, delta_rule, b, t, v_dtype):
    hk, hv, dk, dv = shape
    positions = t                                                   # verify keeps the state after each token
    args = (SPEC((b, t, hk, dk), F32), SPEC((b, t, hk, dk), F32), SPEC((b, t, hv, dv), v_dtype),
            SPEC((b, t, hv), F32), SPEC((b, t, hv), F32), SPEC((256, positions, hv, dk, dv), F32),
            SPEC((b,), I32), SPEC((b,), I32), SPEC((b,), I32), SPEC((b,), jnp.bool_))
    _assert_triton(lower(functools.partial(gdn.gdn_recurrent, delta_rule=delta_rule), *args))


@pytest.mark.parametrize("v_dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,shape,delta_rule,rows,chunk", [
    (name, shape, delta, r, c) for name, shape, delta in RECURRENT_MODELS for r, c in PREFILL if c > 16])
def test_gdn_chunked_prefill_lowers(name, shape, delta_rule, rows, chunk, v_dtype):
    hk, hv, dk, dv = shape
    n = rows * chunk
    args = (SPEC((n, hk, dk), F32), SPEC((n, hk, dk), F32), SPEC((n, hv, dv), v_dtype), SPEC((n, hv), F32),
            SPEC((n, hv), F32), SPEC((256, 1, hv, dk, dv), F32), SPEC((rows + 1,), I32), SPEC((rows,), I32),
            SPEC((rows,), I32), SPEC((rows,), jnp.bool_))
    _assert_triton(lower(functools.partial(gdn.gdn_chunked_prefill, delta_rule=delta_rule), *args))


# name: (hidden, expert intermediate, experts, top-k)
MOE_MODELS = {
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "Qwen3-235B-A22B": (4096, 1536, 128, 8),
    "Qwen3-Next-80B-A3B": (2048, 512, 512, 10),
    "atlas-tiny": (128, 64, 8, 2),
}


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,tokens", [(name, n) for name in MOE_MODELS for n in (1, 32, 2048)])
def test_moe_layer_lowers_through_grouped_matmul(name, tokens, dtype):
    """The whole MoE layer with compiled kernels: routing and sorting in XLA, the expert matmuls
    in the Pallas grouped matmul."""
    h, f, e, k = MOE_MODELS[name]
    params = {"router": SPEC((h, e), dtype),
              "experts": {"gate": SPEC((e, h, f), dtype), "up": SPEC((e, h, f), dtype), "down": SPEC((e, f, h), dtype)}}
    module = lower(lambda p, x: moe(p, x, MoeSpec(k), Kernels(pallas=True)), params, SPEC((tokens, h), dtype))
    _assert_triton(module)


def test_unsupported_shapes_are_refused_not_miscompiled():
    """Head dims a Triton dot cannot take are refused by the compiled entry points (the engine's
    layers then stay on XLA)."""
    assert not paged_attention.supported(16, 80) and not paged_attention.supported(8, 128)
    assert not gdn.supported(128, 96)
    assert not grouped_matmul.supported(2048, 24)
    pool = SPEC((64, 16, 2, 80), F32)
    with pytest.raises(ValueError, match="power-of-two"):
        lower(lambda q, k, v, t, s, n: paged_attention.paged_attention(q, k, v, t, s, n, scale=0.1),
              SPEC((1, 1, 4, 80), F32), pool, pool, SPEC((1, 8), I32), SPEC((1,), I32), SPEC((1,), I32))


@pytest.fixture(scope="module")
def compiled_kernel_engine():
    """The shipped default model, atlas-tiny (GDN + attention + MoE + MTP), with compiled-kernel steps;
    nothing is compiled or run here (warmup=False): the steps are only lowered for CUDA."""
    from atlas_jax import LLM
    return LLM(kernels=Kernels(pallas=True), dtype="bfloat16", page_size=16, max_num_seqs=8, max_model_len=256,
               max_prefill_chunk=64, warmup=False, progress=False, compile_cache_dir="",
               speculative={"method": "mtp", "num_drafts": 3})


@pytest.mark.parametrize("kind,shape", [("step", ((8, 1),)), ("step", ((8, 1), (2, 64))), ("verify", ((8, 4),))])
def test_engine_step_lowers_for_cuda(compiled_kernel_engine, kind, shape):
    """A whole serving step (decode, mixed decode + prefill, MTP verify: model, sampler, MTP head) lowers
    for CUDA with every mixer and the MoE in Triton kernels: the XLA parts of the step lower too."""
    runner = compiled_kernel_engine.runner
    spec = lambda tree: jax.tree.map(lambda x: SPEC(x.shape, x.dtype), tree)
    module = lower(runner.exes.jitted[kind], spec(runner.params), spec(runner.state), *runner.abstract_args(kind, shape))
    _assert_triton(module)
