"""Config parsing and the safetensors loader: clear errors naming the field / tensor,
sharded checkpoints, MTP tensors, tied embeddings, orbax round trip."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_models
from atlas_jax import ConfigError, ModelConfig
from atlas_jax.models import qwen3_next
from atlas_jax.weights import CheckpointError, load_params, restore_params, save_params


@pytest.fixture(scope="module")
def next_ckpt(ckpt_dir):
    return ckpt_dir("qwen3_next", hf_models.make_qwen3_next)[0]


def _edited_copy(src, dst, edit):
    """A copy of checkpoint `src` at `dst` whose tensor dict went through `edit` (in place)."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_config_families(ckpt_dir, next_ckpt):
    cfg = ModelConfig.from_pretrained(next_ckpt)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 8 and cfg.zero_centred_norm and cfg.attn_output_gate
    assert cfg.moe_layers == (True,) * 4 and cfg.shared_expert_intermediate_size == 48
    assert cfg.gdn_conv_dim == 2 * 2 * 16 + 4 * 24
    moe = ModelConfig.from_pretrained(ckpt_dir("moe_cfg", hf_models.make_qwen3_moe, mlp_only_layers=(0,))[0])
    assert moe.moe_layers == (False, True) and moe.num_experts == 8 and moe.shared_expert_intermediate_size == 0
    dense = ModelConfig.from_pretrained(ckpt_dir("qwen3_cfg", hf_models.make_qwen3, tie=True)[0])
    assert dense.tie_word_embeddings and dense.rotary_dim == dense.head_dim and not any(dense.moe_layers)


def test_config_full_attention_interval():
    base = {"model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 6,
            "num_attention_heads": 2, "intermediate_size": 8, "rope_theta": 1e4, "full_attention_interval": 3,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
            "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4}
    cfg = ModelConfig.from_dict(base)
    assert cfg.attention_layers == (2, 5) and cfg.gdn_layers == (0, 1, 3, 4)


def test_config_qwen3_5_wrapper():
    """A released Qwen3.5 config: the decoder's fields in text_config (model_type qwen3_5_text), the
    wrapper's own tie_word_embeddings / eos winning, multimodal RoPE fields accepted (text = plain RoPE)."""
    text = {"model_type": "qwen3_5_moe_text", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
            "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
            "shared_expert_intermediate_size": 4, "tie_word_embeddings": True, "full_attention_interval": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False,
                                 "eos_token_id": 3, "vision_config": {"depth": 1}})
    assert (cfg.model_type, cfg.weight_prefix, cfg.vision, cfg.tie_word_embeddings) == (
        "qwen3_5_moe_text", "model.language_model.", True, False)
    assert cfg.attention_layers == (1, 3) and cfg.rotary_dim == 2 and cfg.zero_centred_norm and cfg.attn_output_gate
    assert cfg.shared_expert_intermediate_size == 4 and cfg.eos_token_ids == (3,)
    plain = ModelConfig.from_dict(text)
    assert plain.weight_prefix == "model." and not plain.vision and plain.tie_word_embeddings
    with pytest.raises(ConfigError, match="'text_config'"):
        ModelConfig.from_dict({"model_type": "qwen3_5"})


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        ModelConfig.from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="'hidden_size'"):
        ModelConfig.from_dict({"model_type": "qwen3", "vocab_size": 10})
    with pytest.raises(ConfigError, match="'linear_key_head_dim'"):
        ModelConfig.from_dict({"model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
                               "num_attention_heads": 2, "intermediate_size": 8, "rope_theta": 1e4,
                               "linear_num_key_heads": 1, "linear_num_value_heads": 2,
                               "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4})
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        ModelConfig.from_dict({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 8,
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})


def test_missing_tensor_is_named(next_ckpt, tmp_path):
    path = _edited_copy(next_ckpt, tmp_path / "m", lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.linear_attn.A_log'"):
        load_params(path, ModelConfig.from_pretrained(path), jnp.float32)


def test_misshaped_tensor_is_named(next_ckpt, tmp_path):
    path = _edited_copy(next_ckpt, tmp_path / "m", lambda t: t.update(
        {"model.layers.3.self_attn.k_proj.weight": np.zeros((5, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.3.self_attn.k_proj.weight' has shape \(5, 64\)"):
        load_params(path, ModelConfig.from_pretrained(path), jnp.float32)


def test_unexpected_tensor_is_named(next_ckpt, tmp_path):
    path = _edited_copy(next_ckpt, tmp_path / "m", lambda t: t.update(
        {"model.layers.0.mystery.weight": np.zeros((2,), np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensors.*model.layers.0.mystery.weight"):
        load_params(path, ModelConfig.from_pretrained(path), jnp.float32)


def test_sharded_equals_single_and_casts(ckpt_dir, tmp_path):
    path, hf = ckpt_dir("qwen3_next", hf_models.make_qwen3_next)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    cfg = ModelConfig.from_pretrained(path)
    a, _ = load_params(path, cfg, jnp.float32)
    b, _ = load_params(sharded, cfg, jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    c, _ = load_params(sharded, cfg, jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(c))
    # HF [out, in] -> ours [in, out]; experts stacked on axis 0
    sd = hf.state_dict()
    np.testing.assert_array_equal(a["layers"][3]["attn"]["q"], sd["model.layers.3.self_attn.q_proj.weight"].numpy().T)
    np.testing.assert_array_equal(a["layers"][0]["moe"]["experts"]["down"][5],
                                  sd["model.layers.0.mlp.experts.down_proj"][5].numpy().T)


def test_mtp_tensors_loaded_when_present(next_ckpt, tmp_path):
    cfg = ModelConfig.from_pretrained(next_ckpt)
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(spec.hf_shape).astype(np.float32)
               for spec in qwen3_next.mtp_specs(cfg, 1) for name in spec.hf_names}
    path = _edited_copy(next_ckpt, tmp_path / "m", lambda t: t.update(tensors))
    params, n_mtp = load_params(path, cfg, jnp.float32)
    assert n_mtp == 1
    np.testing.assert_array_equal(params["mtp"]["fc"], tensors["mtp.fc.weight"].T)
    np.testing.assert_array_equal(params["mtp"]["layers"][0]["attn"]["k_norm"],
                                  tensors["mtp.layers.0.self_attn.k_norm.weight"])
    assert params["mtp"]["layers"][0]["moe"]["experts"]["gate"].shape == (8, 64, 32)
    no_mtp, n = load_params(path, cfg, jnp.float32, load_mtp=False)
    assert n == 0 and "mtp" not in no_mtp


def test_tied_embeddings_have_no_lm_head(ckpt_dir):
    path, hf = ckpt_dir("qwen3_tied", hf_models.make_qwen3, tie=True)
    params, _ = load_params(path, ModelConfig.from_pretrained(path), jnp.float32)
    assert "lm_head" not in params
    np.testing.assert_array_equal(params["embed"], hf.lm_head.weight.detach().numpy())


def test_orbax_round_trip(next_ckpt, tmp_path):
    cfg = ModelConfig.from_pretrained(next_ckpt)
    params, _ = load_params(next_ckpt, cfg, jnp.float32)
    save_params(str(tmp_path), params, 0)
    restored, n = restore_params(str(tmp_path), cfg, jnp.float32)
    assert n == 0
    jax.tree.map(np.testing.assert_array_equal, params, restored)
