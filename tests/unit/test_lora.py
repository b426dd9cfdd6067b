"""PEFT LoRA adapters (issue 16, first part): the loader maps a real peft adapter onto the engine's
projections for every family, and the multi-slot delta reproduces peft's own LoRA modules, per
token, for a batch mixing adapters. Refusals name what they refuse."""
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_models

from atlas_jax.config import ModelConfig
from atlas_jax.layers.lora import lora_delta, param_at
from atlas_jax.weights import load_model_params
from atlas_jax.weights.lora import LoRAError, adaptable, load_peft_adapter

# attention and GDN projections (peft 0.21 on transformers 5's fused-expert MoE also wraps the routed
# experts whenever an MLP projection is targeted in a MoE model; the dense MLP path is Qwen3's case)
QWEN3_NEXT_TARGETS = r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj))"


def _adapter(hf, path, targets, r, alpha, seed, rslora=False):
    """A peft LoRA on `hf` with random (non-zero) A and B, saved as users have it."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                          use_rslora=rslora))
    model.save_pretrained(path)
    return model


def _check_against_peft(peft_model, adapter, cfg, modules, seed):
    """For each adapted module: base @ x + our delta == peft's module(x)."""
    targets = adaptable(cfg)
    rng = np.random.default_rng(seed)
    layers = dict(peft_model.base_model.model.named_modules())
    for module in modules:
        path = targets[module]
        a, b = adapter.weights[path]
        x = rng.standard_normal((5, a.shape[0])).astype(np.float32)
        with torch.no_grad():
            ref = layers[module](torch.tensor(x)).numpy()
            base = layers[module].base_layer(torch.tensor(x)).numpy()
        delta = lora_delta(jnp.asarray(x), jnp.asarray(np.stack([np.zeros_like(a), a], axis=1)),
                           jnp.asarray(np.stack([np.zeros_like(b), b])), jnp.ones(5, jnp.int32))
        np.testing.assert_allclose(base + np.asarray(delta), ref, atol=1e-5, rtol=1e-4)
        assert np.abs(ref - base).max() > 1e-3                      # the adapter changes the output


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_adapter_matches_peft_modules(ckpt_dir, tmp_path, family):
    if family == "qwen3":
        path, _ = ckpt_dir("qwen3_lora_base", hf_models.make_qwen3)
        hf = hf_models.make_qwen3(str(tmp_path / "base"))
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    else:
        path, _ = ckpt_dir("qwen3_next_lora_base", hf_models.make_qwen3_next)
        hf = hf_models.make_qwen3_next(str(tmp_path / "base"))
        targets = QWEN3_NEXT_TARGETS
    cfg = ModelConfig.from_pretrained(path)
    peft_model = _adapter(hf, str(tmp_path / "adapter"), targets, r=4, alpha=8, seed=1, rslora=family == "qwen3_next")
    adapter = load_peft_adapter(str(tmp_path / "adapter"), cfg, max_rank=8)
    assert adapter.rank == 4 and adapter.scale == (8 / 2 if family == "qwen3_next" else 8 / 4)
    modules = sorted(m for m in adaptable(cfg) if any(m == n for n, _ in peft_model.base_model.model.named_modules()
                                                      if hasattr(_, "lora_A")))
    assert len(modules) == len(adapter.weights) > 0
    params, _ = load_model_params(path, cfg, "float32")
    for param_path, (a, b) in adapter.weights.items():            # each pair fits the param it adapts
        assert param_at(params, param_path).shape == (a.shape[0], b.shape[1])
    _check_against_peft(peft_model, adapter, cfg, modules, seed=2)


def test_mixed_slots_each_get_their_adapter():
    """Tokens of slots 0 (base), 1 and 2 in one call: each gets exactly its own delta."""
    rng = np.random.default_rng(0)
    s, d_in, d_out, r = 3, 12, 10, 4
    a = rng.standard_normal((s, d_in, r)).astype(np.float32)
    b = rng.standard_normal((s, r, d_out)).astype(np.float32)
    a[0] = b[0] = 0
    x = rng.standard_normal((7, d_in)).astype(np.float32)
    slot = np.array([0, 1, 2, 1, 0, 2, 2], np.int32)
    out = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a.transpose(1, 0, 2)), jnp.asarray(b),
                                jnp.asarray(slot)))
    for i, sl in enumerate(slot):
        np.testing.assert_allclose(out[i], x[i] @ a[sl] @ b[sl], atol=1e-5, rtol=1e-5)


def test_refusals_name_the_problem(ckpt_dir, tmp_path):
    path, _ = ckpt_dir("qwen3_next_lora_base", hf_models.make_qwen3_next)
    cfg = ModelConfig.from_pretrained(path)
    hf = hf_models.make_qwen3_next(str(tmp_path / "base"))
    _adapter(hf, str(tmp_path / "experts"), ["gate_proj", "up_proj"], r=4, alpha=8, seed=3)   # the routed experts too
    with pytest.raises(LoRAError, match=r"mlp\.experts"):
        load_peft_adapter(str(tmp_path / "experts"), cfg, max_rank=8)
    hf = hf_models.make_qwen3_next(str(tmp_path / "base2"))
    _adapter(hf, str(tmp_path / "big"), ["q_proj"], r=16, alpha=16, seed=4)
    with pytest.raises(LoRAError, match="rank 16 .* exceeds max_lora_rank 8"):
        load_peft_adapter(str(tmp_path / "big"), cfg, max_rank=8)
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "big", bad)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not valid JSON"):
        load_peft_adapter(str(bad), cfg, max_rank=32)
    with open(tmp_path / "big" / "adapter_config.json") as f:
        raw = json.load(f)
    (bad / "adapter_config.json").write_text(json.dumps({**raw, "use_dora": True}))
    with pytest.raises(LoRAError, match="use_dora"):
        load_peft_adapter(str(bad), cfg, max_rank=32)
    os.remove(bad / "adapter_config.json")
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_peft_adapter(str(bad), cfg, max_rank=32)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_forward_mixing_adapters_matches_peft(ckpt_dir, tmp_path, family):
    """One forward over three rows — base, adapter A, adapter B — with the pool merged into the params:
    each row's logits equal HF's base model / peft's model with that adapter (a GDN model's recurrent
    layers adapted too)."""
    from atlas_jax.batch import StepBatch
    from atlas_jax.layers.lora import with_pool
    from atlas_jax.models.decoder import forward
    from atlas_jax.state.cache import init_state
    maker = hf_models.make_qwen3 if family == "qwen3" else hf_models.make_qwen3_next
    targets = (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if family == "qwen3"
               else QWEN3_NEXT_TARGETS)
    path, base = ckpt_dir(f"{family}_lora_base", maker)
    cfg = ModelConfig.from_pretrained(path)
    prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 11))
    refs = []
    with torch.no_grad():
        refs.append(base(torch.tensor([prompt])).logits[0].numpy())
    adapters = []
    for i, (r, alpha) in enumerate([(4, 8), (2, 16)]):
        peft_model = _adapter(maker(str(tmp_path / f"base{i}")), str(tmp_path / f"adapter{i}"), targets, r, alpha,
                              seed=10 + i)
        with torch.no_grad():
            refs.append(peft_model(torch.tensor([prompt])).logits[0].numpy())
        adapters.append(load_peft_adapter(str(tmp_path / f"adapter{i}"), cfg, max_rank=4))
    pool = {}
    for p_path in adapters[0].weights:
        a0, b0 = adapters[0].weights[p_path]
        pool[p_path] = (jnp.asarray(np.stack([np.zeros_like(a0)] + [ad.weights[p_path][0] for ad in adapters], axis=1)),
                        jnp.asarray(np.stack([np.zeros_like(b0)] + [ad.weights[p_path][1] for ad in adapters])))
    params, _ = load_model_params(path, cfg, "float32")
    t, page = len(prompt), 4
    pages = -(-t // page)
    state = init_state(cfg, 3 * pages, page, 3, jnp.float32)
    seg = StepBatch(tokens=jnp.asarray([prompt] * 3), q_len=jnp.full(3, t), start=jnp.zeros(3, jnp.int32),
                    block_table=jnp.arange(3 * pages).reshape(3, pages), slot=jnp.arange(3),
                    state_idx=jnp.zeros(3, jnp.int32), adapter=jnp.arange(3, dtype=jnp.int32))
    logits, _, _ = forward(with_pool(params, pool), state, (seg,), cfg, all_logits=True)
    for row, ref in enumerate(refs):
        np.testing.assert_allclose(np.asarray(logits[0][row]), ref, atol=2e-5, rtol=1e-4)
    assert np.abs(refs[1] - refs[0]).max() > 1e-3 and np.abs(refs[2] - refs[1]).max() > 1e-3


def _write_adapter(path, tensors: dict, r: int, alpha: float = 8) -> str:
    """A PEFT-layout adapter directory from {module: (A [r, in], B [out, r])} arrays, written by hand."""
    from safetensors.numpy import save_file
    os.makedirs(path, exist_ok=True)
    save_file({f"base_model.model.{m}.lora_{ab}.weight": t for m, (a, b) in tensors.items()
               for ab, t in (("A", a), ("B", b))}, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none"}, f)
    return str(path)


def test_damaged_adapters_are_refused_at_load(ckpt_dir, tmp_path):
    """Every way an adapter's files can be wrong is a LoRAError naming it, raised when the adapter is read
    (before any request can reach the device): shapes against the base projection (checked from the
    header, before the data is read), dtype, non-finite values, truncated files, garbage headers."""
    from atlas_jax.weights.lora import adaptable_shapes
    path, _ = ckpt_dir("qwen3_lora_base", hf_models.make_qwen3)
    cfg = ModelConfig.from_pretrained(path)
    module = "model.layers.0.self_attn.q_proj"
    _, (n_in, n_out) = adaptable_shapes(cfg)[module]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, n_in)).astype(np.float32), rng.standard_normal((n_out, 4)).astype(np.float32)
    good = load_peft_adapter(_write_adapter(tmp_path / "good", {module: (a, b)}, 4), cfg, max_rank=8)
    assert good.weights[adaptable(cfg)[module]][0].shape == (n_in, 8)

    def refused(name, tensors, match, r=4, damage=None):
        p = _write_adapter(tmp_path / name, tensors, r)
        if damage is not None:
            damage(os.path.join(p, "adapter_model.safetensors"))
        with pytest.raises(LoRAError, match=match):
            load_peft_adapter(p, cfg, max_rank=8)

    other = rng.standard_normal((4, n_in + 3)).astype(np.float32)        # trained for another model size
    refused("wide", {module: (other, b)}, rf"lora_A has shape \[4, {n_in + 3}\], this model needs \[4, {n_in}\]")
    refused("tall", {module: (a, np.ones((n_out * 2, 4), np.float32))}, "lora_B has shape")
    refused("rank", {module: (a, b)}, r"lora_A has shape \[4, .*rank 2", r=2)
    refused("nan", {module: (a, np.where(b > 1, np.nan, b))}, "NaN or infinite")
    refused("inf", {module: (np.full_like(a, np.inf), b)}, "NaN or infinite")
    refused("ints", {module: (a.astype(np.int32), b.astype(np.int32))}, "dtype I32")

    def truncate(f):
        data = open(f, "rb").read()
        open(f, "wb").write(data[:len(data) - 100])
    refused("truncated", {module: (a, b)}, "cannot be read", damage=truncate)
    refused("garbage", {module: (a, b)}, "bad header length", damage=lambda f: open(f, "wb").write(b"\xff" * 64))
    refused("empty", {module: (a, b)}, "not a safetensors file", damage=lambda f: open(f, "wb").close())
    refused("not json", {module: (a, b)}, "header that is not JSON",
            damage=lambda f: open(f, "wb").write((16).to_bytes(8, "little") + b"\xff" * 16))
    huge = rng.standard_normal((4, n_in * 64)).astype(np.float32)       # refused from the header's shape
    refused("huge", {module: (huge, b)}, "lora_A has shape")
    refused("oversized", {module: (a, b)}, r"bytes; an adapter of rank <= 8 for this model has at most",
            damage=lambda f: open(f, "ab").write(bytes(4 << 20)))
