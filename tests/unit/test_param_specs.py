"""The param specs are the typed, abstract description of every family's params: the loaded arrays match them
leaf for leaf, and the CPU kernels' packing, the LoRA targets and the executables' abstract params follow
their roles (not key names)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import hf_models
from atlas_jax import ModelConfig, cpu_kernels
from atlas_jax.default_model import default_model_path
from atlas_jax.kernels import CPU, MIN_PACKED_OUT, XLA
from atlas_jax.layers.linear import PackedLinear
from atlas_jax.models import family
from atlas_jax.models.layout import AXES, ROLES, abstract_params, check_params
from atlas_jax.param_tree import get_path
from atlas_jax.weights import load_params
from atlas_jax.weights.loader import _tensor_files, read_shard

MAKERS = {
    "qwen3": lambda p: hf_models.make_qwen3(p, attention_bias=True),
    "qwen3_moe": lambda p: hf_models.make_qwen3_moe(p, mlp_only_layers=(1,)),
    "qwen3_next": hf_models.make_qwen3_next,
    "qwen3_5_moe_fused": lambda p: hf_models.make_qwen3_5(p, moe=True, fused_experts=True),
    "nemotron_h_latent": lambda p: hf_models.make_nemotron_h(p, blocks="M-*E", latent=32),
}


@pytest.fixture(scope="module", params=[*MAKERS, "atlas_tiny_mtp"])
def loaded(request, tmp_path_factory):
    """(cfg, specs, params, path) of one family's checkpoint as the loader reads it (atlas-tiny: with its MTP head)."""
    if request.param == "atlas_tiny_mtp":
        path = default_model_path()
    else:
        path = str(tmp_path_factory.mktemp(request.param))
        MAKERS[request.param](path)
    cfg = ModelConfig.from_pretrained(path)
    params, mtp_layers = load_params(path, cfg, jnp.float32)
    fused = request.param.endswith("fused")
    return cfg, family(cfg.model_type).param_specs(cfg, mtp_layers, fused_experts=fused), params, path


def test_every_leaf_is_described(loaded):
    cfg, specs, params, _ = loaded
    for spec in specs:
        assert spec.role in ROLES, spec
        assert len(spec.axes) == len(spec.shape) and set(spec.axes) <= AXES, spec
    assert len(specs) == len(jax.tree.leaves(params))
    check_params(params, abstract_params(specs, jnp.float32))         # structure, shapes and dtypes


def test_a_leaf_that_differs_is_named(loaded):
    cfg, specs, params, _ = loaded
    i = next(i for i, s in enumerate(specs) if s.role == "proj")
    wrong = list(specs)
    wrong[i] = dataclasses.replace(specs[i], hf_shape=(specs[i].hf_shape[0] + 1, specs[i].hf_shape[1]))
    with pytest.raises(ValueError, match=re.escape(".".join(map(str, specs[i].path)) + " is")):
        check_params(params, abstract_params(wrong, jnp.float32))
    with pytest.raises(ValueError, match="missing"):
        check_params(params, abstract_params(specs[:-1] + [dataclasses.replace(specs[-1], path=("extra",))],
                                             jnp.float32))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the CPU kernels")
def test_cpu_packing_follows_the_roles(loaded):
    from atlas_jax.engine.runner import prepared_params
    cfg, specs, params, _ = loaded
    packed = prepared_params(params, specs, CPU)
    for spec in specs:
        if spec.role == "experts":
            assert set(get_path(packed, spec.path[:-1])) == {"gate_up", "down"}, spec.path
            continue
        leaf = get_path(packed, spec.path)
        wide = spec.shape[-1] >= MIN_PACKED_OUT
        assert isinstance(leaf, PackedLinear) == (spec.role in ("proj", "head") and wide), spec.path
    assert prepared_params(params, specs, XLA) is params
    abstract = jax.eval_shape(lambda p: prepared_params(p, specs, CPU), abstract_params(specs, jnp.float32))
    check_params(packed, abstract)


def test_a_shard_is_read_alone(loaded):
    """read_shard (tensor-parallel loading: one device's region of a param from get_slice of its HF tensors)
    equals that region of the param loaded whole, for every spec kind (linear, conv, per-expert stacks, fused
    expert halves, plain), over regions that cut every axis; it never asks for more than the region."""
    import numpy as np
    from safetensors import safe_open
    _, specs, params, path = loaded
    files = _tensor_files(path)
    rng = np.random.default_rng(0)
    for spec in specs:
        region = []
        for n in spec.shape:
            a = int(rng.integers(0, n))
            region.append(slice(a, int(rng.integers(a + 1, n + 1))))
        asked = []

        def get(name, index):
            with safe_open(files[name], framework="np") as f:
                t = f.get_slice(name)[index]
            asked.append(t.size)
            return t
        got = read_shard(spec, tuple(region), get)
        want = np.asarray(get_path(params, spec.path))[tuple(region)]
        np.testing.assert_array_equal(got, want, err_msg=str(spec.path))
        assert sum(asked) == want.size, spec.path
