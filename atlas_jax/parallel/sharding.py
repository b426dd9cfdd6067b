"""One table of sharding rules: each logical axis of a param (models/layout.py ParamSpec.axes) -> a mesh axis.

The mesh is ("tp",) for tensor parallelism, ("dp", "tp") with data-parallel attention (data_parallel_size > 1:
each dp rank runs its own batch on its own pages and slots, parallel/data_parallel.py). Layers stay pure functions: a step is compiled with its params
(and state) placed by these rules and XLA's SPMD partitioner inserts the collectives, so a rule decides how
much is communicated, never what is computed (a replicated axis is always correct). Rules (jax-llm-examples'
ShardingRules, sglang-jax's kernel axes):

  vocab, heads, kv_heads, mlp, expert_mlp        -> tp   (embedding / lm_head vocab-parallel, attention heads,
                                                          dense and expert intermediate dims)
  gdn_qkvz, gdn_ba, gdn_value, gdn_heads         -> tp   (Qwen3-Next's projections are grouped per key head,
  mamba_heads, mamba_inner                              the value side per value head)
  mamba_in, mamba_conv, gdn_qkv, gdn_conv        -> tp   when tiled (`section_tiles`: Mamba2's z | x | B | C | dt
                                                          and GDN's q | k | v sections stored so each device's
                                                          block holds its heads and groups of every section,
                                                          layers/sections.py)
  experts                                        -> tp   with expert parallel (whole experts per device);
                                                  (dp, tp) under data parallel (experts over every device)
  everything else                                -> replicated: hidden, norms, the router, and the sectioned
                                                    axes when their heads do not divide tp (a contiguous split
                                                    would cut sections)

The state follows the same heads: KV pages [P, page, KV heads, D] (the MTP head's too) by KV head, recurrent h
pools [S, R, H, Dk, Dv] and snapshots [N, H, Dk, Dv] by head; conv windows by channel when tiled; untiled conv
windows, the snapshots' conv windows, penalty history, sampling columns, LoRA pools replicated (`state_shardings`).
Under data parallel every state leaf but the LoRA pool is D ranks' pools end to end, split by "dp" on axis 0.

A dimension is split only when the mesh axis size divides it; `check_divides` refuses, naming the config
field, the head and vocabulary counts that must divide tp.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import LINEAR_ATTENTION, MAMBA
from ..layers.sections import tile
from ..param_tree import path_of, replace_at

TP = "tp"
DP = "dp"
RULES = {axis: TP for axis in ("vocab", "heads", "kv_heads", "mlp", "expert_mlp", "gdn_qkvz", "gdn_ba", "gdn_value",
                               "gdn_heads", "mamba_heads", "mamba_inner")}
EXPERT_RULES = {"experts": TP}              # expert parallel: the expert axis takes tp (an expert stays whole)
TILED_RULES = {"mamba_in": TP, "mamba_conv": TP, "gdn_qkv": TP, "gdn_conv": TP}   # stored tiled (section_tiles = tp)


def rules_for(expert_parallel: bool = False, tiled: bool = False, dp: int = 1) -> dict:
    experts = {"experts": (DP, TP)} if dp > 1 else EXPERT_RULES
    return {**RULES, **(experts if expert_parallel else {}), **(TILED_RULES if tiled else {})}


def uses_expert_parallel(cfg, tp: int, asked: bool, dp: int = 1) -> bool:
    """Whether the routed experts are split by expert: asked, over more than one device, and the model has any."""
    return bool(asked) and tp * dp > 1 and cfg.num_experts > 0


def model_rules(cfg, tp: int, expert_parallel: bool = False, dp: int = 1) -> dict:
    """The rules an engine of tensor_parallel_size tp (x data_parallel_size dp) places this model's params by
    (experts split by expert over all tp x dp devices when asked and the model has any; the sectioned axes when
    they tile; everything else replicated over dp)."""
    return rules_for(uses_expert_parallel(cfg, tp, expert_parallel, dp), section_tiles(cfg, tp) > 1, dp)


def section_tiles(cfg, tp: int) -> int:
    """tp when the model has sectioned axes (Mamba2's, GDN's q | k | v) and every section splits into whole heads
    and groups over tp (the sectioned params are then stored tiled and split, layers/sections.py); 1 otherwise
    (they stay replicated)."""
    types = set(cfg.layer_types)
    mamba = MAMBA not in types or (cfg.mamba_num_heads % tp == 0 and cfg.mamba_n_groups % tp == 0)
    gdn = LINEAR_ATTENTION not in types or (cfg.linear_num_key_heads % tp == 0
                                            and cfg.linear_num_value_heads % tp == 0)
    return tp if tp > 1 and types & {MAMBA, LINEAR_ATTENTION} and mamba and gdn else 1


def tile_params(params, specs, tiles: int):
    """params with every sectioned leaf of the specs (ParamSpec.sections) in tiled order (layers/sections.tile)."""
    for spec in specs:
        if spec.sections and tiles > 1:
            fn = jax.jit(functools.partial(tile, sections=spec.sections, tiles=tiles, axis=spec.sectioned_axis))
            params = replace_at(params, [spec.path], fn)
    return params


def conv_split(cfg, tiles: int) -> tuple[bool, ...]:
    """Per recurrent layer: its conv window pool is tiled and split by channel (Mamba2 and GDN layers when tiled)."""
    return tuple(tiles > 1 and cfg.layer_types[i] in (MAMBA, LINEAR_ATTENTION) for i in cfg.recurrent_layers)


def check_devices(n: int, devices=None, what: str = "tensor_parallel_size") -> list:
    """The devices a mesh of n takes (the first ones); ValueError when there are too few."""
    devices = list(devices if devices is not None else jax.devices())
    if n > len(devices):
        raise ValueError(f"{what} {n} needs that many devices; {len(devices)} are visible")
    return devices[:n]


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ("tp",) mesh over the first tensor_parallel_size devices; with data_parallel_size > 1 a ("dp", "tp") mesh
    over the first dp x tp (a dp rank's tp devices adjacent)."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if dp == 1:
        return Mesh(np.array(check_devices(tp, devices)), (TP,))
    return Mesh(np.array(check_devices(tp * dp, devices, "data_parallel_size x tensor_parallel_size")).reshape(dp, tp),
                (DP, TP))


def engine_mesh(tensor_parallel_size: int, data_parallel_size: int = 1) -> Mesh | None:
    """The mesh an engine of these sizes runs on (None: one device)."""
    if tensor_parallel_size * data_parallel_size == 1:
        return None
    return make_mesh(tensor_parallel_size, data_parallel_size)


def check_divides(cfg, tp: int, expert_parallel: bool = False, dp: int = 1) -> None:
    """ValueError naming the field when a count the rules split over tp does not divide (KV heads may be fewer
    than tp: they are then replicated, as sglang-jax does); with expert parallel the experts over tp x dp."""
    fields = {"num_attention_heads": cfg.num_heads, "vocab_size": cfg.vocab_size}
    if expert_parallel and cfg.num_experts % (tp * dp):
        raise ValueError(f"num_experts = {cfg.num_experts} is not divisible by the {tp * dp} devices expert "
                         f"parallel splits them over (tensor_parallel_size x data_parallel_size)")
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
        names = (target,) if isinstance(target, str) else tuple(target or ())
        if (not names or used & set(names) or any(n not in mesh.shape for n in names)
                or size % int(np.prod([mesh.shape[n] for n in names]))):
            out.append(None)
        else:
            used.update(names)
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


def _by_rank(sharding: NamedSharding, x) -> NamedSharding:
    """sharding with axis 0 (the pool axis: pages, slots, snapshots) split over "dp" as well."""
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(DP, *spec[1:]))


def kv_shardings(pools, mesh) -> tuple:
    """KV pools ((k, v) [P, page, KV heads, D] per layer) split by KV head where tp divides them."""
    return tuple((_by_head(k, 2, mesh), _by_head(v, 2, mesh)) for k, v in pools)


def model_state_shardings(model, mesh, split_conv: tuple[bool, ...] = ()):
    """A ModelState of shardings: KV pools by KV head, h pools [S, R, H, Dk, Dv] by head, conv windows
    [S, R, C, K] replicated, or by channel where `split_conv` (per recurrent layer: tiled, `conv_split`) says."""
    split_conv = split_conv or (False,) * len(model.ssm)
    conv = lambda c, split: _by_head(c, 2, mesh) if split else replicated(mesh)
    return dataclasses.replace(model, kv=kv_shardings(model.kv, mesh),
                               ssm=tuple((_by_head(h, 2, mesh), conv(c, split))
                                         for (h, c), split in zip(model.ssm, split_conv)))


def state_shardings(state, mesh, split_conv: tuple[bool, ...] = ()):
    """An EngineState-shaped tree of NamedShardings (module doc): what the state is placed with and kept at.
    mesh: a Mesh, or an AbstractMesh for planning without devices (parallel/memory_plan.py)."""
    out = jax.tree.map(lambda _: replicated(mesh), state)
    out = dataclasses.replace(out, model=model_state_shardings(state.model, mesh, split_conv),
                              draft_kv=kv_shardings(state.draft_kv, mesh),
                              snapshots=tuple((_by_head(h, 1, mesh), replicated(mesh)) for h, _ in state.snapshots))
    if DP not in mesh.axis_names:
        return out
    lora = out.lora
    out = jax.tree.map(_by_rank, dataclasses.replace(out, lora={}), dataclasses.replace(state, lora={}))
    return dataclasses.replace(out, lora=lora)
