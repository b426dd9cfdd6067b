"""Numerical parity with HF transformers (the oracle): prompt logits, chunked prefill,
greedy generation through the paged cache."""
import numpy as np
import pytest
import torch

import hf_models
from conftest import random_prompts

from atlas_jax import LLM, SamplingParams

# (name, maker, kwargs): GQA ratios 1..4, head dims not a power of two, GDN with more value
# heads than key heads, tied and untied embeddings, attention bias, dense layers inside MoE models.
FAMILIES = [
    ("qwen3_gqa2", hf_models.make_qwen3, dict(heads=4, kv_heads=2, head_dim=16)),
    ("qwen3_mha_tied_bias", hf_models.make_qwen3, dict(heads=3, kv_heads=3, head_dim=24, tie=True, attention_bias=True)),
    ("qwen3_moe", hf_models.make_qwen3_moe, dict(heads=4, kv_heads=1, head_dim=24, mlp_only_layers=(1,))),
    ("qwen3_moe_norenorm", hf_models.make_qwen3_moe, dict(norm_topk_prob=False, top_k=3)),
    ("qwen3_next", hf_models.make_qwen3_next, dict()),
    ("qwen3_next_tied_hv_eq_hk", hf_models.make_qwen3_next, dict(tie=True, k_heads=2, v_heads=2, dk=20, dv=12,
                                                                  head_dim=40, heads=2, kv_heads=1, interval=2)),
    # Qwen3.5: separate GDN projections, multimodal RoPE config; as released: the decoder inside a
    # vision wrapper, sharded files, MoE experts fused in 3-D tensors
    ("qwen3_5", hf_models.make_qwen3_5, dict()),
    ("qwen3_5_vl_tied_sharded", hf_models.make_qwen3_5, dict(vision=True, tie=True, k_heads=2, v_heads=2, dk=20,
                                                              dv=12, head_dim=40, heads=2, kv_heads=1, interval=2,
                                                              shard_size="40KB")),
    ("qwen3_5_moe_vl_fused", hf_models.make_qwen3_5, dict(moe=True, vision=True, fused_experts=True, kv_heads=1)),
    # Nemotron-H: Mamba2 (n_groups 2 and 1), attention without RoPE, relu2 MLP, sigmoid group-limited MoE
    # (correction bias, scaling, shared expert; latent projections and fused 3-D experts in the second)
    ("nemotron_h", hf_models.make_nemotron_h, dict()),
    ("nemotron_h_g1_latent_fused", hf_models.make_nemotron_h, dict(blocks="ME*-M", groups=1, kv_heads=1, latent=24,
                                                                   fused_experts=True, tie=True, n_group=4,
                                                                   topk_group=1)),
]


# Chunked prefill is family-agnostic machinery: the default run checks it on one family of each kind.
# The pure-XLA path (kernels="xla": the GPU fallback and the kernels' reference) on one family of each kind
# by default, every family in the slow run.
SLOW_IDS = tuple(f"test_chunked_prefill_matches_one_shot[{name}-" for name in
                 ("qwen3_mha_tied_bias", "qwen3_moe_norenorm", "qwen3_next_tied_hv_eq_hk", "qwen3_5",
                  "qwen3_5_vl_tied_sharded", "nemotron_h_g1_latent_fused")) + \
    tuple(f"test_pure_xla_path_matches_hf[{name}]" for name in
          ("qwen3_mha_tied_bias", "qwen3_moe_norenorm", "qwen3_next", "qwen3_5", "qwen3_5_vl_tied_sharded",
           "nemotron_h"))


@pytest.fixture(scope="module", params=FAMILIES, ids=[f[0] for f in FAMILIES])
def family_llm(request, ckpt_dir):
    name, maker, kw = request.param
    path, hf = ckpt_dir(name, maker, **kw)
    return LLM(path, dtype="float32", page_size=4, max_num_seqs=4, max_model_len=256, warmup=False), hf


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def test_prompt_logits_match_hf(family_llm):
    llm, hf = family_llm
    ids = random_prompts(llm.cfg.vocab_size, [45], seed=1)[0]
    np.testing.assert_allclose(llm.prompt_logits(ids), hf_logits(hf, ids), atol=2e-5, rtol=1e-4)


# 7 (unaligned, many chunks) and 100 (crosses attention blocks; also checked against HF) for every family;
# 1 (token by token: the decode path, which greedy generation covers) and 64 (page-aligned) in the slow run.
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 7, pytest.param(64, marks=pytest.mark.slow),
                                   100])
def test_chunked_prefill_matches_one_shot(family_llm, chunk):
    llm, hf = family_llm
    ids = random_prompts(llm.cfg.vocab_size, [130], seed=2)[0]
    one_shot = llm.prompt_logits(ids, chunk=256)
    np.testing.assert_allclose(llm.prompt_logits(ids, chunk=chunk), one_shot, atol=2e-5, rtol=1e-4)
    if chunk == 100:   # and both equal the oracle
        np.testing.assert_allclose(one_shot, hf_logits(hf, ids), atol=2e-5, rtol=1e-4)


def test_greedy_generation_matches_hf(family_llm):
    llm, hf = family_llm
    prompts = random_prompts(llm.cfg.vocab_size, [3, 17, 29, 8], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_models.hf_greedy(hf, prompt, 24)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("family", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_pure_xla_path_matches_hf(family, ckpt_dir):
    """The same parity (prompt logits through the paged cache, greedy tokens) with kernels="xla": no
    CPU custom call, no Pallas kernel in the step (the default engine above uses the CPU kernels)."""
    name, maker, kw = family
    path, hf = ckpt_dir(name, maker, **kw)
    llm = LLM(path, dtype="float32", page_size=4, max_num_seqs=4, max_model_len=256, warmup=False, kernels="xla")
    assert llm.kernels.name == "xla" and not llm.kernels.cpu
    ids = random_prompts(llm.cfg.vocab_size, [45], seed=1)[0]
    np.testing.assert_allclose(llm.prompt_logits(ids), hf_logits(hf, ids), atol=2e-5, rtol=1e-4)
    prompts = random_prompts(llm.cfg.vocab_size, [3, 17], seed=3)
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                                         ignore_eos=True))):
        assert out.outputs[0].token_ids == hf_models.hf_greedy(hf, prompt, 16)


def test_qwen3_5_vision_checkpoint_loads_its_language_model(ckpt_dir, caplog):
    """A Qwen3_5ForConditionalGeneration checkpoint: config from text_config (tie from the wrapper),
    decoder tensors under model.language_model., the vision tower skipped with a log line (and only
    it: a stray tensor elsewhere is still an error)."""
    import json
    import os

    from atlas_jax.config import ModelConfig
    from atlas_jax.weights import load_model_params
    from atlas_jax.weights.loader import CheckpointError
    name = "qwen3_5_vl_tied_sharded"
    path, hf = ckpt_dir(name, hf_models.make_qwen3_5, **next(kw for n, _, kw in FAMILIES if n == name))
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.model_type, cfg.weight_prefix, cfg.vision, cfg.tie_word_embeddings) == (
        "qwen3_5_text", "model.language_model.", True, True)
    assert cfg.layer_types == tuple(hf.config.text_config.layer_types)
    with caplog.at_level("INFO", logger="atlas_jax"):
        params, _ = load_model_params(path, cfg, "float32")
    assert any("vision-tower tensors are not loaded" in r.getMessage() for r in caplog.records)
    assert "qkv" in params["layers"][0]["gdn"] and "lm_head" not in params
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        meta = json.load(f)
    meta["weight_map"]["model.language_model.extra.weight"] = next(iter(meta["weight_map"].values()))
    bad = os.path.join(os.path.dirname(path), "qwen3_5_stray")
    import shutil
    shutil.copytree(path, bad)
    with open(os.path.join(bad, "model.safetensors.index.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match="extra.weight"):
        load_model_params(bad, cfg, "float32")


def test_prompt_logprobs_match_hf(ckpt_dir):
    """prompt_logprobs (engine enable_prompt_logprobs): for every prompt token after the first, its
    logprob given the tokens before it and the top-n, equal to HF's log_softmax, over a prompt that takes
    two prefill chunks (the scratch slot carries the GDN state); the scoring buckets are the warm-up's, so
    serving compiles nothing for them; a request asking for it is refused by an engine without it."""
    path, hf = ckpt_dir("qwen3_next", hf_models.make_qwen3_next)
    llm = LLM(path, dtype="float32", page_size=4, max_num_seqs=2, max_model_len=128, max_prefill_chunk=32,
              warmup=False, enable_prompt_logprobs=True)
    ids = random_prompts(llm.cfg.vocab_size, [45], seed=5)[0]
    out = llm.generate(ids, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    ref = torch.log_softmax(torch.tensor(hf_logits(hf, ids)), -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        top = np.argsort(-ref[i - 1])[:3]
        assert set(entry) == {ids[i], *map(int, top)}
        for t, v in entry.items():
            assert abs(v - ref[i - 1, t]) < 1e-4
    assert llm.runner.grid.prefill_token_buckets == [16, 32]         # chunks of 32 and 13 tokens: both buckets used
    compiled = llm.num_compiles
    for tp in llm.runner.grid.prefill_token_buckets:                 # what warm-up compiles for scoring
        llm.runner.exes.compile("score", ((1, tp),), llm.runner.abstract_args)
    assert llm.num_compiles == compiled
    plain = LLM(path, dtype="float32", page_size=4, max_num_seqs=2, max_model_len=128, warmup=False)
    with pytest.raises(ValueError, match="enable_prompt_logprobs"):
        plain.generate(ids, SamplingParams(max_tokens=2, prompt_logprobs=1))
