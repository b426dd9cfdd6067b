"""The MTP drafter (Qwen3-Next, Qwen3.5): head parity against HF transformers' own modules, and
greedy output identity with MTP speculation (single, batched, chunked prefill, under preemption).

The tiny checkpoints' MTP layer reuses the weights of the HF model's full-attention layer 3 (same
tensor layout), so HF's decoder layer instance *is* the reference layer; fc and the three norms
are random."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
from conftest import SPEC_ENGINE, random_prompts
from prefix_scenarios import multiturn, on_and_off

from atlas_jax import LLM, SamplingParams
from atlas_jax.batch import StepBatch
from atlas_jax.config import ModelConfig
from atlas_jax.models import mtp
from atlas_jax.weights import load_model_params

ENGINE = dict(dtype="float32", page_size=8, max_num_seqs=4, max_model_len=160, max_prefill_chunk=64,
              max_num_batched_tokens=128, warmup=False, compile_cache_dir="", progress=False)


def _add_mtp_head(src, dst, hf, layer_prefix):
    """Copy checkpoint src to dst with an MTP head: layer 3's tensors as mtp.layers.0, random fc and norms."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(dst / "model.safetensors"))
    h = hf.config.get_text_config().hidden_size
    g = torch.Generator().manual_seed(0)
    for name, t in list(tensors.items()):
        if name.startswith(layer_prefix):
            tensors["mtp.layers.0." + name[len(layer_prefix):]] = t.clone()
    tensors["mtp.fc.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = 0.3 * torch.randn(h, generator=g)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def mtp_ckpt(ckpt_dir, tmp_path_factory):
    # the speculative tests' checkpoint (conftest.spec_pair), so their plain engine is this test's reference
    src, hf = ckpt_dir("qwen3_next_spec", hf_models.make_qwen3_next, vocab=256, init_std=0.2)
    path = tmp_path_factory.mktemp("qwen3_next_mtp")
    return str(path), hf, _add_mtp_head(src, path, hf, "model.layers.3.")


@pytest.fixture(scope="module")
def qwen3_5_mtp_ckpt(ckpt_dir, tmp_path_factory):
    """A released-style Qwen3.5-MoE (vision wrapper, fused experts) with an MTP head (its experts fused too)."""
    src, hf = ckpt_dir("qwen3_5_moe_spec", hf_models.make_qwen3_5, vocab=256, init_std=0.2, moe=True, vision=True,
                       fused_experts=True)
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    return str(path), hf, _add_mtp_head(src, path, hf, "model.language_model.layers.3.")


@pytest.fixture(scope="module")
def nemotron_mtp_ckpt(ckpt_dir, tmp_path_factory):
    """Nemotron-H ("M-*E-M") with an MTP head in vLLM's NemotronH-MTP layout: mtp.layers.0 = fusion
    (enorm, hnorm, eh_proj) + a copy of the attention block 2, mtp.layers.1 = a copy of the MoE block 3
    + final_layernorm."""
    import json
    src, hf = ckpt_dir("nemotron_h_spec", hf_models.make_nemotron_h, vocab=256, init_std=0.2)
    path = tmp_path_factory.mktemp("nemotron_h_mtp")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tensors = load_file(str(path / "model.safetensors"))
    h = hf.config.hidden_size
    g = torch.Generator().manual_seed(0)
    for name, t in list(tensors.items()):
        for block, dst in (("backbone.layers.2.", "mtp.layers.0."), ("backbone.layers.3.", "mtp.layers.1.")):
            if name.startswith(block):
                tensors[dst + name[len(block):]] = t.clone()
    tensors["mtp.layers.0.eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    for norm in ("mtp.layers.0.enorm", "mtp.layers.0.hnorm", "mtp.layers.1.final_layernorm"):
        tensors[f"{norm}.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json") as f:
        config = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1, "mtp_layers_block_type": ["attention", "moe"]}, f)
    return str(path), hf, tensors


def _norms(cls, names, tensors, hidden, eps):
    """HF norm modules carrying the checkpoint's `{name}.weight` tensors."""
    norms = {}
    for name in names:
        norms[name] = cls(hidden, eps=eps)
        norms[name].weight.data = tensors[f"{name}.weight"]
    return norms


def _hf_nemotron_mtp_logits(hf, tensors, ids, next_ids):
    """HF modules: eh_proj([enorm(embed(next)) | hnorm(final hidden)]) -> block 2 -> block 3 -> norm -> lm_head."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
    cfg = hf.config
    norms = _norms(NemotronHRMSNorm, ("mtp.layers.0.enorm", "mtp.layers.0.hnorm", "mtp.layers.1.final_layernorm"),
                   tensors, cfg.hidden_size, cfg.layer_norm_epsilon)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state
        emb = hf.model.embeddings(torch.tensor([next_ids]))
        x = torch.cat([norms["mtp.layers.0.enorm"](emb), norms["mtp.layers.0.hnorm"](hidden)], -1)
        x = x @ tensors["mtp.layers.0.eh_proj.weight"].T
        t = len(ids)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        hf.model.layers[2].mixer.config._attn_implementation = "eager"
        x = hf.model.layers[2](x, attention_mask=mask, position_ids=torch.arange(t)[None])
        x = hf.model.layers[3](x)
        return hf.lm_head(norms["mtp.layers.1.final_layernorm"](x))[0].numpy(), hidden[0].numpy()


def _hf_mtp_logits(hf, tensors, ids, next_ids):
    """HF modules: fc([norm_e(embed(next)) | norm_h(final hidden)]) -> layer 3 -> norm -> lm_head."""
    if hf.config.model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm as Norm
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding as Rotary
        decoder = hf.model
    else:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as Norm
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding as Rotary
        decoder = hf.model.language_model
    cfg = decoder.config
    norms = _norms(Norm, ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"), tensors,
                   cfg.hidden_size, cfg.rms_norm_eps)
    with torch.no_grad():
        hidden = decoder(torch.tensor([ids])).last_hidden_state
        emb = decoder.embed_tokens(torch.tensor([next_ids]))
        x = torch.cat([norms["mtp.pre_fc_norm_embedding"](emb), norms["mtp.pre_fc_norm_hidden"](hidden)], -1)
        x = x @ tensors["mtp.fc.weight"].T
        pos = torch.arange(len(ids))[None]
        t = len(ids)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        layer = decoder.layers[3]
        layer.self_attn.config._attn_implementation = "eager"
        y = layer(x, position_embeddings=Rotary(cfg)(x, pos), attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(norms["mtp.norm"](y))[0].numpy(), hidden[0].numpy()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "nemotron_h"])
def test_mtp_head_matches_hf(family, request):
    fixture = {"qwen3_next": "mtp_ckpt", "qwen3_5": "qwen3_5_mtp_ckpt", "nemotron_h": "nemotron_mtp_ckpt"}[family]
    path, hf, tensors = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_pretrained(path)
    params, n_mtp = load_model_params(path, cfg, jnp.float32)
    assert n_mtp >= 1 and len(params["mtp"]["layers"]) == 1
    ids = random_prompts(256, [13], seed=4)[0]
    next_ids = ids[1:] + [7]
    reference = _hf_nemotron_mtp_logits if family == "nemotron_h" else _hf_mtp_logits
    ref, hidden = reference(hf, tensors, ids, next_ids)
    page_size, t = 4, len(ids)
    pages = -(-t // page_size)
    kv = mtp.init_mtp_kv(cfg, 1, pages + 1, page_size, jnp.float32)
    seg = StepBatch(tokens=jnp.asarray([next_ids]), q_len=jnp.array([t]), start=jnp.array([0]),
                    block_table=jnp.asarray([list(range(pages))]), slot=jnp.array([0]), state_idx=jnp.array([0]))
    out, _ = mtp.mtp_forward(params, kv, (seg,), jnp.asarray(next_ids), jnp.asarray(hidden), cfg)
    logits = np.asarray(out @ params["lm_head"])
    np.testing.assert_allclose(logits, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", [pytest.param("qwen3_5", marks=pytest.mark.slow), "nemotron_h"])
def test_mtp_greedy_matches_hf(family, request):
    """Qwen3.5-MoE / Nemotron-H with MTP speculation (2 drafts): ragged prompts, one of them prefilled in
    chunks, give HF's greedy tokens; drafts were verified (and rolled back when rejected)."""
    path, hf, _ = request.getfixturevalue("qwen3_5_mtp_ckpt" if family == "qwen3_5" else "nemotron_mtp_ckpt")
    spec = LLM(path, speculative={"method": "mtp", "num_drafts": 2}, **ENGINE)
    prompts = random_prompts(256, [5, 20, 70], seed=8)
    outs = spec.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_models.hf_greedy(hf, prompt, 12)
    stats = spec.spec_stats()
    assert stats["drafted"] > 0 and stats["verify_steps"] > 0


@pytest.fixture(scope="module")
def mtp_engines(mtp_ckpt, spec_pair):
    """(plain engine on the same target weights, compiled once a session; MTP engine with caching on)."""
    path, _, _ = mtp_ckpt
    base, _ = spec_pair("qwen3_next")
    assert base.num_mtp_layers == 0 and ENGINE == SPEC_ENGINE
    return base, LLM(path, speculative={"method": "mtp", "num_drafts": 2}, enable_prefix_caching=True, **ENGINE)


def test_mtp_greedy_identity(mtp_engines):
    base, spec = mtp_engines
    prompts = random_prompts(256, [5, 20, 70], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
    assert [o.outputs[0].token_ids for o in spec.generate(prompts[2], params)] == ref[2:]
    stats = spec.spec_stats()
    assert stats["drafted"] > 0 and stats["verify_steps"] > 0
    held = spec.engine.blocks.allocate(spec.num_pages - 15)   # 15 free: all three admitted (12), growing to 19 (swap)
    try:
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == ref
    finally:
        spec.engine.blocks.free(held)
    assert sum(spec.engine.stats()["num_preemptions"].values()) > 0
    assert spec.engine.blocks.num_free == spec.num_pages


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_mtp_with_prefix_caching(mtp_engines, sampled):
    """Multi-turn with a shared system prompt, caching on vs off: equal outputs, and the same drafts
    accepted (the head's KV is cached with the target's pages; a hit uses a position only when the
    token after it matches too, since the head's KV there depends on it)."""
    _, spec = mtp_engines

    def with_stats(llm, sampled):
        before = dict(llm.engine.spec_stats.__dict__)
        out = multiturn(llm, sampled)
        out["spec"] = {k: getattr(llm.engine.spec_stats, k) - before[k] for k in ("drafted", "accepted")}
        return out
    on, off, stats = on_and_off(spec, with_stats, sampled)
    assert on["spec"] == off["spec"] and on["spec"]["drafted"] > 0
    assert on["spec"]["accepted"] > 0 or sampled           # (temperature 0.9 on a tiny random model: flat)
    assert stats["hit_tokens"] > 0.5 * stats["query_tokens"]
    assert spec.engine.prefix_cache.la == 1


def test_mtp_drafts_equal_head_formula(mtp_engines, mtp_ckpt):
    """The first draft after a prefill is argmax of the MTP head at the prompt's last position with
    the emitted token, computed by HF's modules."""
    _, spec = mtp_engines
    _, hf, tensors = mtp_ckpt
    prompt = random_prompts(256, [11], seed=12)[0]
    req = spec.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    spec.engine.step()                                         # the whole prompt: one token + drafts
    spec.engine.drain()                                        # (async: read the step's token)
    seq = req.seqs[0]
    first = seq.output_ids[0]
    ref, _ = _hf_mtp_logits(hf, tensors, prompt, prompt[1:] + [first])
    assert seq.device_drafts == 2 and spec.runner.device_drafts(seq.slot)[0] == int(np.argmax(ref[-1]))
    spec.engine.abort(req.request_id)
    jax.block_until_ready(spec.runner.state.model.kv[0][0])


def test_mtp_draft_vocab(mtp_engines, mtp_ckpt, tmp_path):
    """A draft vocabulary (FR-Spec token map, listed out of order, without the head's unrestricted argmax): the
    first draft is HF's head argmax over the map's tokens only, every draft is in the map, and greedy outputs
    still equal the plain engine's (the verify scores every token)."""
    base, _ = mtp_engines
    path, hf, tensors = mtp_ckpt
    prompts = random_prompts(256, [11, 30], seed=12)
    first = base.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    ref = _hf_mtp_logits(hf, tensors, prompts[0], prompts[0][1:] + [first])[0][-1]
    ids = [int(t) for t in np.random.default_rng(3).permutation(256) if t != np.argmax(ref)][:96]
    (tmp_path / "map.json").write_text(json.dumps(ids))
    spec = LLM(path, speculative={"method": "mtp", "num_drafts": 2, "token_map": str(tmp_path / "map.json")}, **ENGINE)
    req = spec.engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    spec.engine.step()                                         # the whole prompt: one token + drafts
    spec.engine.drain()
    seq = req.seqs[0]
    drafts = spec.runner.device_drafts(seq.slot)
    assert seq.output_ids[0] == first
    assert drafts[0] == ids[int(np.argmax(ref[ids]))]
    assert set(drafts.tolist()) <= set(ids)
    spec.engine.abort(req.request_id)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    outs = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert spec.spec_stats()["drafted"] > 0


def test_token_map_loading(tmp_path):
    from atlas_jax.engine.speculative import TOKEN_MAP_FILE, SpeculativeConfig, load_token_map
    mtp_auto = SpeculativeConfig.parse({"method": "mtp"})
    assert load_token_map(mtp_auto, str(tmp_path), 16) is None                # auto, the checkpoint has none
    (tmp_path / TOKEN_MAP_FILE).write_text("[5, 1, 9]")
    assert load_token_map(mtp_auto, str(tmp_path), 16).tolist() == [5, 1, 9]
    assert load_token_map(SpeculativeConfig.parse({"method": "mtp", "token_map": None}), str(tmp_path), 16) is None
    assert load_token_map(SpeculativeConfig.parse({"method": "ngram"}), str(tmp_path), 16) is None
    for text, msg in [("[1, 2, 16]", "outside the vocabulary"), ("[1, 1]", "twice"), ("[]", "non-empty"),
                      ('{"a": 1}', "non-empty"), ("[1.5]", "non-empty"), ("[1,", "token_map")]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=msg):
            load_token_map(SpeculativeConfig.parse({"method": "mtp", "token_map": str(tmp_path / "bad.json")}),
                           str(tmp_path), 16)
    with pytest.raises(ValueError, match="token_map"):
        load_token_map(SpeculativeConfig.parse({"method": "mtp", "token_map": str(tmp_path / "none.json")}),
                       str(tmp_path), 16)
    with pytest.raises(ValueError, match="restricts the MTP head"):
        SpeculativeConfig.parse({"method": "ngram", "token_map": "x.json"})
    with pytest.raises(ValueError, match="token_map must be a path"):
        SpeculativeConfig.parse({"method": "mtp", "token_map": 5})
