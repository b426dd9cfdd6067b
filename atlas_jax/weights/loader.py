"""HF safetensors checkpoint -> param pytree.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints.
Tensors are read one at a time through memory-mapped `safe_open`, converted (transpose,
dtype cast) on the host and placed on the device, so at most one tensor (or one layer's
stack of experts) exists twice at any moment. With `placement` (tensor parallel: each param's
sharding) every device shard is read alone (`get_slice` of the HF tensor's matching region,
`read_shard`) and placed with `jax.make_array_from_callback`: no whole tensor is read on the host. Every tensor of the checkpoint must be
consumed by a ParamSpec and every spec must find its tensor with the right shape; anything
else is a CheckpointError naming the tensor.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from ..config import ModelConfig
from ..models import family
from ..models.layout import ParamSpec, as_lists, set_path

# Buffers some exporters write that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# A multimodal checkpoint's vision tower (the engine serves its language model).
_VISION = re.compile(r"^(model\.)?(visual|vision_tower|vision_model|multi_modal_projector)\.")
_FUSED_EXPERTS = re.compile(r".*\.experts\.(gate_up|up)_proj$")   # 3-D expert tensors, not one per expert
log = logging.getLogger("atlas_jax")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


def _tensor_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")
    with safe_open(single, framework="np") as f:
        return {name: single for name in f.keys()}


def read_checkpoint_names(path: str) -> list[str]:
    return sorted(_tensor_files(path))


def count_mtp_layers(names) -> int:
    idx = {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    return max(idx) + 1 if idx else 0


def read_shard(spec: ParamSpec, index: tuple, get) -> np.ndarray:
    """The region `index` (slices of the engine-layout array spec.shape) of a param, read from its HF tensor(s)
    by get(name, hf_index) -> np.ndarray (safetensors' get_slice): the inverse of ParamSpec.convert on a region."""
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, spec.shape))
    if len(spec.hf_names) > 1:                       # one tensor per expert, stacked on axis 0
        return np.stack([_read_one(spec, index[1:], lambda i, n=name: get(n, i)) for name in spec.hf_names[index[0]]])
    return _read_one(spec, index, lambda i: get(spec.hf_names[0], i))


def _read_one(spec: ParamSpec, index: tuple, get) -> np.ndarray:
    kind = spec.kind
    if kind == "linear":                             # [in, out] = HF [out, in].T
        return get((index[1], index[0])).T
    if kind == "conv":                               # [C, K] = HF [C, 1, K]
        t = get((index[0], slice(None), index[1]))
        return t.reshape(t.shape[0], t.shape[2])
    if kind in ("experts", "gate_half", "up_half"):  # [E, in, out] = HF [E, out, in] swapped (a half of 2F)
        off = spec.hf_shape[1] // 2 if kind == "up_half" else 0
        out = index[2]
        return np.swapaxes(get((index[0], slice(out.start + off, out.stop + off), index[1])), 1, 2)
    return get(index)


def load_params(path: str, cfg: ModelConfig, dtype=jnp.bfloat16, load_mtp: bool = True, placement=None):
    """Read the checkpoint at `path` into a param pytree of `dtype` arrays. placement(specs) -> {param path:
    sharding}: the params are placed so, each shard read alone (module doc).
    Returns (params, num_mtp_layers)."""
    files = _tensor_files(path)
    names = set(files)
    mtp_layers = count_mtp_layers(names) if load_mtp else 0
    fused = any(_FUSED_EXPERTS.match(n) for n in names)
    specs: list[ParamSpec] = family(cfg.model_type).param_specs(cfg, mtp_layers, fused_experts=fused)
    if not load_mtp:
        names = {n for n in names if not n.startswith("mtp.")}
    vision = {n for n in names if _VISION.match(n)}
    if vision:
        log.info("%s: loading the language model; %d vision-tower tensors are not loaded", path, len(vision))
        names -= vision
    params: dict = {}
    np_dtype = np.dtype(jnp.dtype(dtype))
    shardings = placement(specs) if placement is not None else {}
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="np")) for f in sorted(set(files.values()))}

        def read(name: str, shape) -> np.ndarray:
            if name not in files:
                raise CheckpointError(f"checkpoint {path} is missing tensor {name!r}")
            t = handles[files[name]].get_tensor(name)
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            return t

        def region(name: str, index, shape) -> np.ndarray:
            if name not in files:
                raise CheckpointError(f"checkpoint {path} is missing tensor {name!r}")
            view = handles[files[name]].get_slice(name)
            if tuple(view.get_shape()) != tuple(shape):
                raise CheckpointError(f"tensor {name!r} has shape {tuple(view.get_shape())}, expected {tuple(shape)}")
            return view[index]

        for spec in specs:
            if spec.path in shardings:
                get = lambda name, index, shape=spec.hf_shape: region(name, index, shape)
                shard = lambda index, spec=spec, get=get: np.ascontiguousarray(read_shard(spec, index, get), np_dtype)
                set_path(params, spec.path, jax.make_array_from_callback(spec.shape, shardings[spec.path], shard))
                continue
            if len(spec.hf_names) == 1:
                host = np.array(spec.convert(read(spec.hf_names[0], spec.hf_shape)), np_dtype, order="C")
            else:
                host = np.empty(spec.shape, np_dtype)
                for e, name in enumerate(spec.hf_names):
                    host[e] = spec.convert(read(name, spec.hf_shape))
            set_path(params, spec.path, jax.device_put(host))
            del host
    consumed = {n for s in specs for n in s.hf_names}
    if cfg.tie_word_embeddings:
        consumed.add("lm_head.weight")   # some exporters also write the tied head
    unexpected = sorted(n for n in names - consumed if not _IGNORED.match(n))
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"checkpoint {path} has unexpected tensors {unexpected[:5]}{more}")
    return as_lists(params), mtp_layers
