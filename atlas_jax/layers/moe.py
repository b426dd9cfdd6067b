"""Sparse MoE FFN: router -> top-k -> experts, plus an optional shared expert.

Routers (`Routing`): softmax top-k, optionally renormalised (Qwen); or sigmoid scores with a
correction bias for the choice, group-limited top-k, renormalised and scaled (Nemotron-H, as
DeepSeek-V3). Experts are SwiGLU (gate, up, down) or relu2 (up, down); Nemotron-H may run them in a
latent width (latent_in / latent_out projections around them); the shared expert may have a sigmoid gate
(Qwen3-Next / Qwen3.5). Which variant is the config's (`MoeSpec.of`), never which params are present.

Expert parallel (`kernels.expert_mesh`): each device of the mesh's "tp" axis holds E / tp whole experts and
runs the dispatch below on every token for the pairs routed to its own experts (the others weigh 0); the
shards' outputs are summed (psum) — replicated tokens, local experts, one all-reduce a layer. Under data-parallel
attention (`kernels.data_parallel`) the experts span the dp x tp devices: every rank's tokens are gathered, and
the sums reduce-scattered back to their ranks.

Cost grows with top-k, not with the number of experts. The N*k (token, expert) pairs are
sorted by expert and run by one of five dispatches. Packed experts (`pack_params`, done once by the
ModelRunner under Kernels.cpu, the CPU default when `atlas_jax.cpu_kernels` builds) always take:
  * "cpu"     (XLA:CPU custom call, cpu_kernels/moe_experts.cc): each expert's panels read in place,
    only routed experts read; 2-4x the blocked scan at 1-2048 tokens (scripts/bench_moe.py).
The others take the checkpoint's [E, H, F] layout; the op table chooses among them (`Kernels.moe`, from
its platform and the shapes):
  * "pallas"  (Pallas kernels): `block_layout` pads each expert's run of pairs to whole blocks
    of tb >= 16 rows; `pallas_kernels.grouped_matmul` multiplies each block by its expert's
    weights, read in place: only routed experts are read.
  * "blocked" (XLA:CPU): the same layout; a scan walks the blocks, indexing one expert's weights
    per block (no copy) for a [tb, H] @ [H, F] matmul; empty blocks are skipped. Blocks <=
    ceil((N*k + min(E, N*k) * (tb - 1)) / tb), so decode (tb = 1) reads only the k chosen experts.
  * "gather"  (XLA:GPU/TPU, N*k <= E): each pair's expert weights gathered, one batched einsum:
    reads the routed experts only, where ragged_dot would read all E.
  * "ragged"  (XLA:GPU/TPU, N*k > E): `jax.lax.ragged_dot` over the sorted pairs (XLA:GPU expands
    it to dense matmuls over all experts, which is what tokens covering the experts cost anyway).
"""
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import grouped_matmul as pallas_gmm

from .. import cpu_kernels
from ..kernels import CPU, XLA, Kernels
from ..param_tree import get_path, replace_at
from .mlp import mlp


@dataclasses.dataclass(frozen=True)
class Routing:
    kind: str = "softmax"      # softmax | sigmoid (group-limited, + p["router_bias"] for the choice)
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


SOFTMAX = Routing()


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """One model's MoE variant (static: part of the traced step)."""
    top_k: int
    renormalise: bool = True
    routing: Routing = SOFTMAX
    act: str = "silu"           # the routed and shared experts' activation (layers/mlp.ACTIVATIONS)
    latent: bool = False        # experts in a latent width: latent_in [H, H'] / latent_out [H', H] around them
    shared: bool = False        # a shared expert (p["shared"]: MLP params) on every token
    shared_gate: bool = False   # the shared expert scaled by sigmoid(x @ p["shared_gate"])

    @classmethod
    def of(cls, cfg) -> "MoeSpec":
        routing = SOFTMAX if cfg.moe_router == "softmax" else Routing(
            cfg.moe_router, cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_routed_scaling)
        return cls(cfg.num_experts_per_tok, cfg.norm_topk_prob, routing, cfg.mlp_act, cfg.moe_latent_size > 0,
                   cfg.shared_expert_intermediate_size > 0, cfg.shared_expert_gate)


def _act(gate, up):
    """The expert hidden activation: silu(gate) * up (SwiGLU), or relu(up)^2 when there is no gate."""
    up = up.astype(jnp.float32)
    return jnp.square(jax.nn.relu(up)) if gate is None else jax.nn.silu(gate.astype(jnp.float32)) * up


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block: a power of two in [1, 64] at about twice the mean group size, so most groups
    fit one block (every block re-reads its expert's weights; padding rows only cost FLOPs)."""
    if num_pairs <= num_experts:
        return 1                       # decode: every pair is its own expert's only row, more or less
    return min(64, 1 << (2 * num_pairs // num_experts - 1).bit_length())


def route(router_w, x, top_k: int, renormalise: bool, routing: Routing = SOFTMAX, bias=None):
    """x [N, H] -> (weights [N, k] fp32, expert ids [N, k] int32)."""
    if routing.kind == "softmax":
        logits = (x @ router_w).astype(jnp.float32)                  # [N, E]
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        if renormalise:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, ids
    scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32)))    # [N, E]
    choice = scores + bias.astype(jnp.float32) if bias is not None else scores
    n, e = choice.shape
    if routing.n_group > 1:     # keep the topk_group groups whose two best experts score highest
        grouped = choice.reshape(n, routing.n_group, e // routing.n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)                      # [N, G]
        _, keep = jax.lax.top_k(group_score, routing.topk_group)
        kept = jnp.zeros((n, routing.n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(kept, e // routing.n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if renormalise:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routing.scaling, ids


def _sort_pairs(ids, num_experts):
    """Sorted view of the N*k pairs: (order, expert of each sorted pair, group sizes [E])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _experts_ragged(p, x, weights, ids, act: str):
    n, k = ids.shape
    order, _, sizes = _sort_pairs(ids, p["up"].shape[0])
    token_of = order // k
    xs = jnp.take(x, token_of, axis=0)                               # [N*k, H]
    gate = jax.lax.ragged_dot(xs, p["gate"], sizes) if act == "silu" else None
    h = _act(gate, jax.lax.ragged_dot(xs, p["up"], sizes)).astype(x.dtype)
    y = jax.lax.ragged_dot(h, p["down"], sizes).astype(jnp.float32)  # [N*k, H]
    y = y * jnp.take(weights.reshape(-1), order)[:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


def _experts_gather(p, x, weights, ids, act: str):
    n, k = ids.shape
    w = {name: jnp.take(a, ids.reshape(-1), axis=0) for name, a in p.items()}        # [N*k, ...]
    xs = jnp.repeat(x, k, axis=0)                                                    # [N*k, H]
    gate = jnp.einsum("ph,phf->pf", xs, w["gate"]) if act == "silu" else None
    h = _act(gate, jnp.einsum("ph,phf->pf", xs, w["up"])).astype(x.dtype)
    y = jnp.einsum("pf,pfh->ph", h, w["down"]).astype(jnp.float32) * weights.reshape(-1, 1)
    return jnp.sum(y.reshape(n, k, -1), axis=1).astype(x.dtype)


def block_layout(ids, weights, num_experts: int, tb: int):
    """The pairs sorted by expert, each expert's run padded to whole blocks of tb rows.
    Returns (token [NB*tb] source row per slot (N = padding), weight [NB*tb] fp32,
    block_expert [NB], block_used [NB] bool); NB is static."""
    n, k = ids.shape
    pairs = n * k
    nb = -(-(pairs + min(num_experts, pairs) * (tb - 1)) // tb)
    order, expert, sizes = _sort_pairs(ids, num_experts)
    padded = -(-sizes // tb) * tb
    group_start = jnp.cumsum(sizes) - sizes
    padded_start = jnp.cumsum(padded) - padded
    dest = padded_start[expert] + jnp.arange(pairs) - group_start[expert]   # row of each sorted pair
    rows = nb * tb
    token = jnp.full((rows,), n, jnp.int32).at[dest].set(order // k)
    weight = jnp.zeros((rows,), jnp.float32).at[dest].set(weights.reshape(-1)[order])
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(nb) * tb, side="right"),
                               num_experts - 1)
    return token, weight, block_expert, jnp.arange(nb) * tb < jnp.sum(padded)


def _combine(y, token, weight, n):
    """Per-slot expert outputs [NB*tb, H] -> per-token weighted sums [N, H] fp32."""
    y = y.astype(jnp.float32) * weight[:, None]
    return jnp.zeros((n + 1, y.shape[1]), jnp.float32).at[token].add(y)[:n]


def _experts_pallas(p, x, weights, ids, act: str, interpret: bool = False):
    n, k = ids.shape
    e = p["up"].shape[0]
    tb = max(pallas_gmm.MIN_BLOCK_ROWS, min(64, block_rows(n * k, e)))
    token, weight, block_expert, used = block_layout(ids, weights, e, tb)
    xs = jnp.take(x, token, axis=0, mode="fill", fill_value=0)
    gmm = lambda a, w: pallas_gmm.grouped_matmul(a, w, block_expert, used, block_rows=tb, interpret=interpret)
    h = _act(gmm(xs, p["gate"]) if act == "silu" else None, gmm(xs, p["up"])).astype(x.dtype)
    return _combine(gmm(h, p["down"]), token, weight, n).astype(x.dtype)


def _experts_blocked(p, x, weights, ids, act: str):
    n, k = ids.shape
    e, h_dim = p["up"].shape[:2]
    tb = block_rows(n * k, e)
    token, weight, block_expert, block_used = block_layout(ids, weights, e, tb)
    nb = block_expert.shape[0]
    xs = jnp.take(x, token, axis=0, mode="fill", fill_value=0).reshape(nb, tb, h_dim)

    def block(_, xs_b):
        xb, eb, used = xs_b
        def run(xb):
            w = {name: jax.lax.dynamic_index_in_dim(a, eb, 0, keepdims=False) for name, a in p.items()}
            return mlp(w, xb, act)
        return None, jax.lax.cond(used, run, jnp.zeros_like, xb)
    _, y = jax.lax.scan(block, None, (xs, block_expert, block_used))
    return _combine(y.reshape(nb * tb, h_dim), token, weight, n).astype(x.dtype)


PANEL_UP, PANEL_DN = cpu_kernels.MOE_PANEL_UP, cpu_kernels.MOE_PANEL_DN


def pack_experts(experts: dict) -> dict:
    """{[gate [E, H, F]], up [E, H, F], down [E, F, H]} -> the CPU kernel's zero-padded panels in strips
    (cpu_kernels.strips(): su, sd columns): gate_up [E, Fp/32, 32/su, H, 2su] (gate | up per strip row;
    [.., su] = up alone for relu2 experts) and down [E, Hp/64, 64/sd, Fp, sd]; Fp, Hp = F, H rounded up to
    whole panels."""
    up = experts["up"]
    e, h, f = up.shape
    fp, hp = -(-f // PANEL_UP) * PANEL_UP, -(-h // PANEL_DN) * PANEL_DN
    su, sd = cpu_kernels.strips()

    def strips(w):                                   # [E, H, F] -> [E, Fp/32, 32/su, H, su]
        return cpu_kernels.strip_panels(jnp.pad(w, ((0, 0), (0, 0), (0, fp - f))), PANEL_UP, su)
    gate_up = jnp.concatenate([strips(experts["gate"]), strips(up)], -1) if "gate" in experts else strips(up)
    down = jnp.pad(experts["down"], ((0, 0), (0, fp - f), (0, hp - h)))
    return {"gate_up": gate_up, "down": cpu_kernels.strip_panels(down, PANEL_DN, sd)}


def pack_params(params, paths, kernels: Kernels = CPU):
    """params with the experts {[gate], up, down} at each of `paths` (every MoE layer's, decoder and MTP) packed
    for the CPU kernel where the table says (Kernels.packs_experts). The packed arrays replace the originals."""
    paths = [p for p in paths if kernels.packs_experts(get_path(params, p)["up"].dtype)]
    return replace_at(params, paths, jax.jit(pack_experts))


def _routed(p, x, spec: MoeSpec):
    """route() for this layer's spec: (weights [N, k] fp32, expert ids [N, k])."""
    bias = p["router_bias"] if spec.routing.kind == "sigmoid" else None
    return route(p["router"], x, spec.top_k, spec.renormalise, spec.routing, bias)


def _experts_cpu(p, x, xe, spec: MoeSpec):
    """Packed experts through the CPU custom call (the activation is the packed layout's); x [N, H] the tokens
    routed, xe the experts' input. Softmax routing and the sort of the pairs run as one CPU call too."""
    experts = p["experts"]
    if spec.routing.kind == "softmax":
        token, weight, sizes = cpu_kernels.moe_route((x @ p["router"]).astype(jnp.float32), spec.top_k,
                                                     spec.renormalise)
    else:
        weights, ids = _routed(p, x, spec)
        order, _, sizes = _sort_pairs(ids, experts["gate_up"].shape[0])
        token = (order // spec.top_k).astype(jnp.int32)
        weight = weights.reshape(-1)[order].astype(jnp.float32)
    y = cpu_kernels.moe_experts(xe.astype(jnp.float32), token, weight, sizes, experts["gate_up"], experts["down"])
    return y.astype(xe.dtype)


def _experts(experts, x, weights, ids, act: str, kernels: Kernels):
    """The routed experts on the checkpoint's layout by the dispatch the op table picks for these shapes."""
    e, h_dim, f_dim = experts["up"].shape
    dispatch = kernels.moe(x.shape[0] * ids.shape[1], e, (h_dim, f_dim))
    if dispatch == "pallas":
        return _experts_pallas(experts, x, weights, ids, act, kernels.interpret)
    return {"blocked": _experts_blocked, "gather": _experts_gather, "ragged": _experts_ragged}[dispatch](
        experts, x, weights, ids, act)


def _experts_parallel(experts, x, weights, ids, act: str, kernels: Kernels):
    """Expert parallel (module doc): per shard, the pairs of its E / tp experts (ids made local, the rest weigh
    0) through `_experts`; the partial sums psum'd over "tp"."""
    mesh = kernels.expert_mesh
    local = experts["up"].shape[0] // mesh.shape["tp"]

    def shard(experts, x, weights, ids):
        first = jax.lax.axis_index("tp") * local
        mine = (ids >= first) & (ids < first + local)
        y = _experts(experts, x, jnp.where(mine, weights, 0.0), jnp.where(mine, ids - first, 0), act, kernels)
        return jax.lax.psum(y.astype(jnp.float32), "tp").astype(x.dtype)
    by_expert = jax.tree.map(lambda _: P("tp"), experts)
    return jax.shard_map(shard, mesh=mesh, in_specs=(by_expert, P(), P(), P()), out_specs=P())(
        experts, x, weights, ids)


def _experts_data_parallel(experts, x, weights, ids, act: str, kernels: Kernels):
    """Expert parallel under data-parallel attention (called per dp rank, "dp" manual): every rank's tokens and
    routes gathered, each device's E / (dp x tp) experts run on them (ids made local, the rest weigh 0), the
    partial sums reduced over "tp" and reduce-scattered over "dp" back to each rank's own tokens."""
    tp = kernels.expert_mesh.shape["tp"]
    x, weights, ids = (jax.lax.all_gather(a, "dp", tiled=True) for a in (x, weights, ids))

    def shard(experts, x, weights, ids):
        local = experts["up"].shape[0]
        first = (jax.lax.axis_index("dp") * tp + jax.lax.axis_index("tp")) * local
        mine = (ids >= first) & (ids < first + local)
        y = _experts(experts, x, jnp.where(mine, weights, 0.0), jnp.where(mine, ids - first, 0), act, kernels)
        return jax.lax.psum(y.astype(jnp.float32), "tp")
    by_expert = jax.tree.map(lambda _: P("tp"), experts)
    y = jax.shard_map(shard, in_specs=(by_expert, P(), P(), P()), out_specs=P(), axis_names={"tp"})(
        experts, x, weights, ids)
    return jax.lax.psum_scatter(y, "dp", tiled=True).astype(x.dtype)


def moe(p, x, spec: MoeSpec, kernels: Kernels = XLA, slot=None):
    """p: {router [H, E], [router_bias [E]: sigmoid routing], experts: {[gate [E, H', F]: silu], up [E, H', F],
    down [E, F, H']} (or packed: pack_experts), [latent_in [H, H'], latent_out [H', H]], [shared: MLP params],
    [shared_gate [H, 1]]} as `spec` says; x [..., H] -> [..., H]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xe = x2 @ p["latent_in"] if spec.latent else x2
    if kernels.packs_experts(p["experts"]["down"].dtype):       # pack_params packed them: the CPU kernel
        y = _experts_cpu(p, x2, xe, spec)
    elif kernels.expert_mesh is not None:
        y = (_experts_data_parallel if kernels.data_parallel > 1 else _experts_parallel)(p["experts"], xe, *_routed(p, x2, spec), spec.act, kernels)
    else:
        y = _experts(p["experts"], xe, *_routed(p, x2, spec), spec.act, kernels)
    if spec.latent:
        y = y @ p["latent_out"]
    if spec.shared:
        shared = mlp(p["shared"], x2, spec.act, slot).astype(jnp.float32)   # LoRA adapts the shared expert
        if spec.shared_gate:
            shared = jax.nn.sigmoid((x2 @ p["shared_gate"]).astype(jnp.float32)) * shared
        y = y + shared.astype(x.dtype)
    return y.reshape(shape)

