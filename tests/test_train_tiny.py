"""scripts/train_tiny.py: the exported checkpoint is what the loader reads, the training forward is the
engine's, and an interrupted run resumes to exactly the params of an uninterrupted one."""
import json
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
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
    _, (main, mtp) = jax.jit(train_tiny.make_loss(cfg, 2, 32, 0.5))(params, windows)
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
    assert np.isfinite(float(mtp))


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
