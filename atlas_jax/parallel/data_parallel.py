"""Data-parallel attention (data_parallel_size D > 1) on one ("dp", "tp") mesh.

Each dp rank is an engine of its own on the host (engine/dp_scheduler.py: its own scheduler, pages, slots and
prefix cache, with ids local to the rank). On the device every state leaf but the LoRA pool is the D ranks'
pools end to end, split by "dp" on axis 0 (sharding.state_shardings), and a step's arguments are the D ranks'
batches end to end, all padded to one shape bucket. The step functions run under `jax.shard_map` with "dp"
manual and "tp" left to the partitioner, so inside it a rank sees exactly a one-rank step: its own rows, pools
and local ids, the tp-split params. The only traffic between ranks is the expert-parallel MoE's (layers/moe.py
`_experts_data_parallel`: tokens gathered over "dp", sums reduce-scattered back); without expert parallel the
ranks do not communicate at all.

State operations (snapshot, prefix load) act on one rank: their arguments get a leading [D] axis, the other
ranks' entries out of range (dropped), and each rank runs its own entry (`per_rank(..., batch=False)`).
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from .sharding import DP


def manual(spec) -> P:
    """The "dp" part of a PartitionSpec (what shard_map's in / out specs name; "tp" stays automatic)."""
    names = lambda e: (e,) if isinstance(e, str) else tuple(e or ())
    return P(*[DP if DP in names(e) else None for e in spec])


def per_rank(fn, mesh, params, state_sharding, batch: bool = True):
    """fn(params, state, *args) run on every dp rank with its own block of the state and of each argument.
    params: the abstract params (ShapeDtypeStructs with shardings); state_sharding: the state's NamedShardings.
    batch: every argument is the ranks' blocks end to end on axis 0 and so are the outputs; else (a state
    operation) every argument has a leading [D] axis, rank d runs entry d, and the outputs are rank 0's."""
    param_spec = jax.tree.map(lambda a: manual(a.sharding.spec), params)
    state_spec = jax.tree.map(lambda s: manual(s.spec), state_sharding)
    body = fn if batch else (lambda p, s, *a: fn(p, s, *jax.tree.map(lambda x: x[0], a)))

    def run(params, state, *args):
        return jax.shard_map(body, mesh=mesh, in_specs=(param_spec, state_spec) + (P(DP),) * len(args),
                             out_specs=(P(DP) if batch else P(), state_spec), axis_names={DP},
                             check_vma=False)(params, state, *args)
    return run
