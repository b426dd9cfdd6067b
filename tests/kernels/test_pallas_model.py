"""The whole model through the Pallas kernels (interpret mode on CPU) against the XLA layers:
greedy tokens must be equal for a tiny Qwen3-Next (GDN recurrent + chunked kernels, attention),
a tiny Nemotron-H (the same kernels without the delta rule for Mamba2) and a tiny Qwen3 (attention only), over prompts that take the decode, short-chunk and
multi-chunk prefill paths, alone and batched (mixed decode + prefill steps). (Checked to fail
when the chunked kernel drops the carried state.)"""
import pytest

import hf_models
from conftest import random_prompts

from atlas_jax import LLM, SamplingParams

ENGINE = dict(dtype="float32", page_size=16, max_num_seqs=4, max_model_len=160, max_prefill_chunk=64,
              max_num_batched_tokens=128, warmup=False, compile_cache_dir="")
GDN_DIMS = dict(dk=16, dv=32)       # shapes the compiled kernels take (powers of two >= 16), for GPU runs
MAMBA_DIMS = dict(state=16, mamba_head_dim=32)
LENGTHS = [5, 20, 70]               # recurrent (T <= 16) chunks, one chunk, chunks carrying state


def _checkpoint(ckpt_dir, family):
    maker = {"qwen3_next": hf_models.make_qwen3_next, "nemotron_h": hf_models.make_nemotron_h,
             "qwen3": hf_models.make_qwen3}[family]
    dims = {"qwen3_next": GDN_DIMS, "nemotron_h": MAMBA_DIMS}.get(family, {})
    # init 0.2 (not HF's 0.02, whose logits are nearly uniform) so that a wrong state carry changes tokens
    path, _ = ckpt_dir(f"{family}_pallas", maker, vocab=256, init_std=0.2, **dims)
    return path


@pytest.fixture(scope="module")
def xla_engines(ckpt_dir):
    """family -> the XLA engine on its checkpoint (the reference; compiled once for the module)."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = LLM(_checkpoint(ckpt_dir, family), kernels="xla", **ENGINE)
        return made[family]
    return get


# the hybrids have attention too; Nemotron-H's Mamba2 runs the same GDN kernels (delta_rule=False: test_pallas_gdn)
@pytest.mark.parametrize("family", ["qwen3_next", pytest.param("nemotron_h", marks=pytest.mark.slow),
                                    pytest.param("qwen3", marks=pytest.mark.slow)])
def test_pallas_tokens_equal_xla(ckpt_dir, xla_engines, family):
    path = _checkpoint(ckpt_dir, family)
    prompts = random_prompts(256, LENGTHS, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    xla = xla_engines(family)
    pallas = LLM(path, kernels="pallas", **ENGINE)
    assert pallas.kernels.name == "pallas-interpret"
    batched = [o.outputs[0].token_ids for o in pallas.generate(prompts, params)]
    assert batched == [o.outputs[0].token_ids for o in xla.generate(prompts, params)]
    assert pallas.runner.step_counts["mixed"] > 0
    alone = [pallas.generate(p, params)[0].outputs[0].token_ids for p in prompts[:2]]
    assert alone == batched[:2]


@pytest.mark.slow      # the kernels' verify intermediates and rollback reads: test_pallas_gdn (interpret mode)
def test_pallas_speculative_verify_equals_xla(ckpt_dir, xla_engines):
    """The GDN kernels with R = 4 state positions: verify writes per-token states, the next step reads
    the accepted one (drafts: first right, the rest wrong)."""
    path = _checkpoint(ckpt_dir, "qwen3_next")
    prompts = random_prompts(256, LENGTHS[:2], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in xla_engines("qwen3_next").generate(prompts, params)]
    truth = {tuple(p): r for p, r in zip(prompts, ref)}

    def half_right(seq, k):
        right = truth[tuple(seq.prompt_ids)][len(seq.output_ids):len(seq.output_ids) + k]
        return right[:1] + [(t + 1) % 256 for t in right[1:]]
    spec = LLM(path, kernels="pallas", speculative={"method": "scripted", "num_drafts": 3, "propose": half_right},
               **ENGINE)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
    assert 0 < spec.spec_stats()["accepted"] < spec.spec_stats()["drafted"]
