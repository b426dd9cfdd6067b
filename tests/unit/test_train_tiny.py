"""scripts/train_tiny.py: the exported checkpoint is what the loader reads, the training forward is the
engine's, and an interrupted run resumes to exactly the params of an uninterrupted one."""
import json
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import train_tiny  # noqa: E402

from atlas_jax.config import ModelConfig  # noqa: E402
from atlas_jax.weights.loader import load_params  # noqa: E402

TINY = {"hidden_size": 64, "num_hidden_layers": 3, "num_experts": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "head_dim": 16, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16}


def _config(vocab=300):
    return {**train_tiny.CONFIG, **TINY, "vocab_size": vocab, "eos_token_id": 0, "pad_token_id": 0,
            "bos_token_id": None}


def test_export_is_what_the_loader_reads(tmp_path):
    """init -> export (HF names, [out, in] linears, [C, 1, K] conv, one tensor per expert) -> load_params."""
    config = _config()
    cfg = ModelConfig.from_dict(config)
    params = train_tiny.init_params(cfg, seed=3)
    tok = train_tiny.train_tokenizer(["def f(x):\n    return x + 1\n"] * 4, 300)
    train_tiny.export(str(tmp_path), jax.tree.map(np.asarray, params), {**config, "vocab_size": 300}, tok)
    loaded, mtp_layers = load_params(str(tmp_path), cfg, np.float32)
    assert mtp_layers == 1
    flat, tree = jax.tree.flatten(params)
    flat_loaded, tree_loaded = jax.tree.flatten(loaded)
    assert tree == tree_loaded
    for a, b in zip(flat, flat_loaded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.exists(tmp_path / name)


def test_training_loss_matches_the_engine_forward():
    """The loss's next-token CE equals one computed from the serving engine's prompt logits path
    (decoder.forward over paged state) — the training graph is the engine's forward."""
    import jax.numpy as jnp

    from atlas_jax.batch import StepBatch
    from atlas_jax.models.decoder import forward
    from atlas_jax.state.cache import init_state
    cfg = ModelConfig.from_dict(_config())
    params = train_tiny.init_params(cfg, seed=4)
    windows = np.random.default_rng(0).integers(0, 300, (2, 34)).astype(np.int32)
    _, (main, mtp, _) = jax.jit(train_tiny.make_loss(cfg, 2, 32, 0.5))(params, windows)
    # the same tokens, one row at a time, through a differently paged state (page size 8)
    @jax.jit
    def row_logits(tokens):
        seg = StepBatch(tokens=tokens[None], q_len=jnp.array([32]), start=jnp.array([0]),
                        block_table=jnp.arange(4)[None], slot=jnp.array([0]), state_idx=jnp.array([0]))
        return forward(params, init_state(cfg, 4, 8, 1, jnp.float32), (seg,), cfg, all_logits=True)[0][0][0]
    ce = []
    for row in windows:
        logp = jax.nn.log_softmax(np.asarray(row_logits(jnp.asarray(row[:32])), np.float64), axis=-1)
        ce.append(-np.mean(np.take_along_axis(np.asarray(logp), row[1:33, None], axis=-1)))
    np.testing.assert_allclose(float(main), np.mean(ce), rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(mtp)))


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_params(tmp_path):
    """6 steps in one go == 3 steps, a new process-equivalent run resuming from the orbax checkpoint,
    then the rest."""
    common = ["--steps", "6", "--batch", "2", "--seq", "32", "--max-files", "30", "--eval-tokens", "64",
              "--config", json.dumps(TINY), "--lr", "1e-2", "--warmup", "1"]
    straight = train_tiny.main(["--out", str(tmp_path / "a"), *common])
    train_tiny.main(["--out", str(tmp_path / "b"), *common, "--ckpt-every", "3", "--minutes", "0.0001"])
    resumed = train_tiny.main(["--out", str(tmp_path / "b"), *common, "--ckpt-every", "3"])
    assert resumed["steps"] == straight["steps"] == 6
    from safetensors.numpy import load_file
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_chained_depths_extend_the_one_depth_loss():
    """mtp_depths=3: depth 1 is exactly the one-depth objective (same windows), deeper depths are finite CEs of
    the head fed its own output; the total is main + weight * their mean; distillation changes only the
    objective (same reported CEs and agreements, a different total)."""
    cfg = ModelConfig.from_dict(_config())
    params = train_tiny.init_params(cfg, seed=5)
    windows = np.random.default_rng(1).integers(0, 300, (2, 36)).astype(np.int32)
    _, (main1, mtp1, agree1) = jax.jit(train_tiny.make_loss(cfg, 2, 32, 0.5))(params, windows[:, :34])
    total3, (main3, mtp3, agree3) = jax.jit(train_tiny.make_loss(cfg, 2, 32, 0.5, mtp_depths=3))(params, windows)
    assert mtp3.shape == agree3.shape == (3,) and np.all(np.isfinite(np.asarray(mtp3)))
    assert np.all((np.asarray(agree3) >= 0) & (np.asarray(agree3) <= 1))
    np.testing.assert_allclose(float(main3), float(main1), rtol=1e-6)
    np.testing.assert_allclose(float(mtp3[0]), float(mtp1[0]), rtol=1e-6)
    np.testing.assert_allclose(float(agree3[0]), float(agree1[0]), rtol=1e-6)
    np.testing.assert_allclose(float(total3), float(main3) + 0.5 * float(np.mean(mtp3)), rtol=1e-6)
    assert abs(float(mtp3[1]) - float(mtp3[0])) > 1e-4      # depth 2 reads other tokens and hidden states
    total_d, (main_d, mtp_d, agree_d) = jax.jit(train_tiny.make_loss(cfg, 2, 32, 0.5, mtp_depths=3, distill=True))(
        params, windows)
    np.testing.assert_allclose(np.asarray(mtp_d), np.asarray(mtp3), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(agree_d), np.asarray(agree3), rtol=1e-6)
    assert np.isfinite(float(total_d)) and abs(float(total_d) - float(total3)) > 1e-4


def test_agreement_and_distillation_against_the_engine():
    """Depth 1's agreement and distillation CE, recomputed from the serving engine's logits (decoder.forward
    for the main model, mtp_forward over a differently paged KV for the head) in float64."""
    import jax.numpy as jnp

    from atlas_jax.batch import StepBatch
    from atlas_jax.models.decoder import forward, lm_head
    from atlas_jax.models.mtp import init_mtp_kv, mtp_forward
    from atlas_jax.state.cache import init_state
    cfg = ModelConfig.from_dict(_config())
    params = train_tiny.init_params(cfg, seed=6)
    windows = np.random.default_rng(2).integers(0, 300, (2, 34)).astype(np.int32)
    total, (main, _, agree) = jax.jit(train_tiny.make_loss(cfg, 2, 32, 1.0, distill=True))(params, windows)

    @jax.jit
    def row(tokens, nxt):
        seg = StepBatch(tokens=tokens[None], q_len=jnp.array([32]), start=jnp.array([0]),
                        block_table=jnp.arange(4)[None], slot=jnp.array([0]), state_idx=jnp.array([0]))
        (logits,), hidden, _ = forward(params, init_state(cfg, 4, 8, 1, jnp.float32), (seg,), cfg,
                                       all_logits=True, all_hidden=True)
        out, _ = mtp_forward(params, init_mtp_kv(cfg, 1, 4, 8, jnp.float32), (seg,), nxt, hidden, cfg)
        return logits[0], lm_head(params, out, cfg)
    soft, same = [], []
    for w in windows:
        main_logits, head_logits = (np.asarray(a, np.float64) for a in row(jnp.asarray(w[:32]), jnp.asarray(w[1:33])))
        p = np.exp(main_logits[1:] - main_logits[1:].max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        q = head_logits[:31] - head_logits[:31].max(-1, keepdims=True)
        logq = q - np.log(np.exp(q).sum(-1, keepdims=True))
        soft.append(-np.sum(p * logq, -1))
        same.append(np.argmax(head_logits[:31], -1) == np.argmax(main_logits[1:], -1))
    np.testing.assert_allclose(float(agree[0]), np.mean(same), atol=1e-6)
    np.testing.assert_allclose(float(total) - float(main), np.mean(soft), rtol=1e-4)


@pytest.mark.slow
def test_head_stage_trains_only_the_mtp_head(tmp_path):
    """Stage 2 (--head-from): the exported checkpoint's main-model tensors are the source's bit for bit (greedy
    outputs and held-out numbers unchanged), every mtp.* tensor moved."""
    common = ["--batch", "2", "--seq", "32", "--max-files", "30", "--eval-tokens", "64", "--config",
              json.dumps(TINY), "--lr", "1e-2", "--warmup", "1", "--token-map", "0"]
    train_tiny.main(["--out", str(tmp_path / "a"), "--steps", "2", *common])
    report = train_tiny.main(["--out", str(tmp_path / "b"), "--head-from", str(tmp_path / "a"), "--steps", "3",
                              "--mtp-depths", "2", *common])
    assert len(report["held_out"]["mtp_loss_by_depth"]) == 2
    from safetensors.numpy import load_file
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        if name.startswith("mtp."):
            assert not np.array_equal(a[name], b[name]), name
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
