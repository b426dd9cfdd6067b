"""One table of sharding rules: each logical axis of a param (models/layout.py ParamSpec.axes) -> a mesh axis.

The mesh is ("tp",) for tensor parallelism. Layers stay pure functions: a step is compiled with its params
(and state) placed by these rules and XLA's SPMD partitioner inserts the collectives, so a rule decides how
much is communicated, never what is computed (a replicated axis is always correct). Rules (jax-llm-examples'
ShardingRules, sglang-jax's kernel axes):

  vocab, heads, kv_heads, mlp, expert_mlp        -> tp   (embedding / lm_head vocab-parallel, attention heads,
                                                          dense and expert intermediate dims)
  gdn_qkvz, gdn_ba, gdn_value, gdn_heads         -> tp   (Qwen3-Next's projections are grouped per key head,
  mamba_heads, mamba_inner                              the value side per value head)
  everything else                                -> replicated: hidden, norms, the router, and the sectioned
                                                    axes (gdn_qkv, gdn_conv, mamba_in, mamba_conv: q | k | v or
                                                    z | xBC | dt laid end to end, so a contiguous split would
                                                    cut sections; they need a per-section permutation first)

The state follows the same heads: KV pages [P, page, KV heads, D] (the MTP head's too) by KV head, recurrent h
pools [S, R, H, Dk, Dv] and snapshots [N, H, Dk, Dv] by head; conv windows (sectioned channels), penalty
history, sampling columns, LoRA pools replicated (`state_shardings`).

A dimension is split only when the mesh axis size divides it; `check_divides` refuses, naming the config
field, the head and vocabulary counts that must divide tp.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..param_tree import path_of

TP = "tp"
RULES = {axis: TP for axis in ("vocab", "heads", "kv_heads", "mlp", "expert_mlp", "gdn_qkvz", "gdn_ba", "gdn_value",
                               "gdn_heads", "mamba_heads", "mamba_inner")}
EXPERT_RULES = {**RULES, "experts": TP}      # expert parallel: the expert axis takes tp (an expert stays whole)


def rules_for(expert_parallel: bool) -> dict:
    return EXPERT_RULES if expert_parallel else RULES


def check_devices(tensor_parallel_size: int, devices=None) -> list:
    """The devices a tensor_parallel_size mesh takes (the first ones); ValueError when there are too few."""
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs that many devices; "
                         f"{len(devices)} are visible")
    return devices[:tensor_parallel_size]


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A ("tp",) mesh over the first tensor_parallel_size devices."""
    return Mesh(np.array(check_devices(tensor_parallel_size, devices)), (TP,))


def check_divides(cfg, tp: int, expert_parallel: bool = False) -> None:
    """ValueError naming the field when a count the rules split over tp does not divide (KV heads may be fewer
    than tp: they are then replicated, as sglang-jax does)."""
    fields = {"num_attention_heads": cfg.num_heads, "vocab_size": cfg.vocab_size}
    if expert_parallel:
        fields["num_experts"] = cfg.num_experts
    if cfg.num_kv_heads >= tp:
        fields["num_key_value_heads"] = cfg.num_kv_heads
    if cfg.recurrent_layers and cfg.linear_num_key_heads:
        fields["linear_num_key_heads"] = cfg.linear_num_key_heads
        fields["linear_num_value_heads"] = cfg.linear_num_value_heads
    if cfg.mamba_num_heads:
        fields["mamba_num_heads"] = cfg.mamba_num_heads
    for name, n in fields.items():
        if n % tp:
            raise ValueError(f"{name} = {n} is not divisible by tensor_parallel_size {tp}")


def partition(spec, mesh: Mesh, rules=RULES) -> P:
    """The PartitionSpec of one param: each axis by the rules where the mesh axis divides its size, each mesh
    axis used once (the first dimension that asks for it)."""
    used, out = set(), []
    for axis, size in zip(spec.axes, spec.shape):
        target = rules.get(axis)
        if target is None or target in used or size % mesh.shape[target]:
            out.append(None)
        else:
            used.add(target)
            out.append(target)
    return P(*out)


def param_shardings(specs, mesh: Mesh, rules=RULES) -> dict:
    """{param path: NamedSharding} for every spec."""
    return {spec.path: NamedSharding(mesh, partition(spec, mesh, rules)) for spec in specs}


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def leaf_shardings(params, specs, mesh: Mesh, rules=RULES):
    """A params-shaped tree of NamedShardings by the rules (a leaf without a spec, e.g. the MTP draft vocabulary:
    replicated)."""
    shardings = param_shardings(specs, mesh, rules)
    return jax.tree_util.tree_map_with_path(lambda k, _: shardings.get(path_of(k), replicated(mesh)), params)


def shard_params(params, specs, mesh: Mesh, rules=RULES):
    """params placed on the mesh by the rules."""
    return jax.device_put(params, leaf_shardings(params, specs, mesh, rules))


def abstract_sharded(abstract, specs, mesh: Mesh, rules=RULES):
    """The abstract params (ShapeDtypeStructs) with the shardings `shard_params` gives them."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                        leaf_shardings(abstract, specs, mesh, rules))


def _by_head(x, axis: int, mesh) -> NamedSharding:
    return NamedSharding(mesh, P(*[None] * axis, TP)) if x.shape[axis] % mesh.shape[TP] == 0 else replicated(mesh)


def kv_shardings(pools, mesh) -> tuple:
    """KV pools ((k, v) [P, page, KV heads, D] per layer) split by KV head where tp divides them."""
    return tuple((_by_head(k, 2, mesh), _by_head(v, 2, mesh)) for k, v in pools)


def model_state_shardings(model, mesh):
    """A ModelState of shardings: KV pools by KV head, h pools [S, R, H, Dk, Dv] by head, conv windows replicated."""
    return dataclasses.replace(model, kv=kv_shardings(model.kv, mesh),
                               ssm=tuple((_by_head(h, 2, mesh), replicated(mesh)) for h, _ in model.ssm))


def state_shardings(state, mesh):
    """An EngineState-shaped tree of NamedShardings (module doc): what the state is placed with and kept at.
    mesh: a Mesh, or an AbstractMesh for planning without devices (parallel/plan.py)."""
    out = jax.tree.map(lambda _: replicated(mesh), state)
    return dataclasses.replace(out, model=model_state_shardings(state.model, mesh),
                               draft_kv=kv_shardings(state.draft_kv, mesh),
                               snapshots=tuple((_by_head(h, 1, mesh), replicated(mesh)) for h, _ in state.snapshots))
