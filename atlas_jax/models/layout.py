"""Param layout: how HF checkpoint tensors map onto the engine's param pytree.

Each family lists `ParamSpec`s: the typed, abstract description of every param leaf (shape, what the
layers do with it, the logical axis of each dimension). The loader (weights/loader.py), the orbax restore
target, the default-model writer, weight packing for the CPU kernels (engine/runner.py), the LoRA target
table and the executables' abstract params all read these lists, so the mapping is written once.
Linear weights are stored [in, out] (HF stores [out, in]) so a layer computes `x @ w`.

Roles (`ParamSpec.role`): proj (a projection applied as x @ w: packed for the CPU linear kernel,
LoRA-adaptable), head (the lm_head [H, V], packed, not adapted), router [H, E], experts [E, in, out],
embed [V, H], norm, conv [C, K], vector (gates, biases, A_log, dt_bias, D).

Logical axes (`ParamSpec.axes`, one per dimension of the engine's array; sharding rules map them to mesh axes):
  vocab, hidden, head_dim; heads (query heads x head_dim [x 2 with the output gate]), kv_heads;
  mlp (dense intermediate), experts, expert_mlp, latent (the experts' width when it differs from hidden),
  router (the router's expert logits), hidden_pair (MTP fc input: embedding | hidden);
  GDN: gdn_qkvz / gdn_ba (grouped per key head: Qwen3-Next), gdn_qkv (q | k | v sections: Qwen3.5),
  gdn_value (value heads x dv), gdn_heads (value heads), gdn_conv (the conv channels = the q | k | v sections),
  value_dim, conv_kernel; Mamba2: mamba_in (z | xBC | dt sections), mamba_conv (x | B | C), mamba_heads,
  mamba_inner (heads x head_dim); gate (the shared-expert gate's single output).
Sectioned axes (SECTIONED) carry their section widths (`ParamSpec.sections`) where the layers read them tiled
under tensor parallel (Mamba2's; layers/sections.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..config import ModelConfig
from ..param_tree import as_lists, get_path, path_of, set_path  # noqa: F401 (the loaders' helpers)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple                      # keys into the param pytree, e.g. ("layers", 3, "attn", "q")
    hf_names: tuple[str, ...]        # one tensor, or one per expert (stacked on a new axis 0)
    hf_shape: tuple[int, ...]        # shape of each HF tensor
    kind: str = "plain"              # plain | linear (transpose) | conv ([C,1,K] -> [C,K]) | fused experts:
                                     # experts ([E,out,in] -> [E,in,out]), gate_half / up_half (of [E,2F,H])
    role: str = "vector"             # what the layers do with it (module doc)
    axes: tuple[str, ...] = ()       # the logical axis of each dimension of `shape` (module doc)
    sections: tuple[int, ...] = ()   # a sectioned axis' (SECTIONED) section widths, end to end (layers/sections.py)

    @property
    def sectioned_axis(self) -> int | None:
        return next((i for i, a in enumerate(self.axes) if a in SECTIONED), None)

    def convert(self, t: np.ndarray) -> np.ndarray:
        if self.kind == "linear":
            return t.T
        if self.kind == "conv":
            return t.reshape(t.shape[0], t.shape[-1])
        if self.kind in ("experts", "gate_half", "up_half"):
            f = t.shape[1] // 2
            t = t[:, :f] if self.kind == "gate_half" else t[:, f:] if self.kind == "up_half" else t
            return np.swapaxes(t, 1, 2)
        return t

    def to_hf(self, a: np.ndarray) -> list[np.ndarray]:
        """Inverse of convert: one param array -> the HF tensor(s), in hf_names order."""
        if self.kind in ("gate_half", "up_half"):
            raise ValueError(f"{self.hf_names[0]} holds two params; write experts per expert instead")
        parts = list(a) if len(self.hf_names) > 1 else [a]
        if self.kind == "experts":
            parts = [np.swapaxes(a, 1, 2)]
        elif self.kind == "linear":
            parts = [p.T for p in parts]
        elif self.kind == "conv":
            parts = [p.reshape(self.hf_shape) for p in parts]
        return parts

    @property
    def shape(self) -> tuple[int, ...]:
        one = self.convert(np.empty(self.hf_shape, np.int8)).shape
        return (len(self.hf_names), *one) if len(self.hf_names) > 1 else one


ROLES = ("proj", "head", "router", "experts", "embed", "norm", "conv", "vector")
SECTIONED = frozenset({"gdn_qkv", "gdn_conv", "mamba_in", "mamba_conv"})      # axes of sections laid end to end
AXES = frozenset({"vocab", "hidden", "head_dim", "heads", "kv_heads", "mlp", "experts", "expert_mlp", "latent",
                  "router", "hidden_pair", "gdn_qkvz", "gdn_ba", "gdn_qkv", "gdn_value", "gdn_heads", "gdn_conv",
                  "value_dim", "conv_kernel", "mamba_in", "mamba_conv", "mamba_heads", "mamba_inner", "gate"})


def linear(path, name, n_in, n_out, axes: tuple[str, str], role: str = "proj", sections: tuple[int, ...] = ()):
    return ParamSpec(path, (f"{name}.weight",), (n_out, n_in), "linear", role, axes, sections=sections)


def vector(path, name, n, axis: str, role: str = "vector"):
    return ParamSpec(path, (name,), (n,), role=role, axes=(axis,))


def norm(path, name, n, axis: str = "hidden"):
    return vector(path, name, n, axis, "norm")


def conv(path, name, channels, kernel, axis: str, sections: tuple[int, ...] = ()):
    return ParamSpec(path, (name,), (channels, 1, kernel), "conv", "conv", (axis, "conv_kernel"), sections=sections)


def experts_spec(path, names, hf_shape, kind, axes):
    return ParamSpec(path, names, hf_shape, kind, "experts", ("experts", *axes))


def paths_with(specs, *roles) -> list[tuple]:
    """The param paths of the specs with one of these roles."""
    return [spec.path for spec in specs if spec.role in roles]


def attention_specs(cfg: ModelConfig, path, prefix):
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)
    kv_out = cfg.num_kv_heads * hd
    specs = [
        linear((*path, "q"), f"{prefix}.q_proj", h, q_out, ("hidden", "heads")),
        linear((*path, "k"), f"{prefix}.k_proj", h, kv_out, ("hidden", "kv_heads")),
        linear((*path, "v"), f"{prefix}.v_proj", h, kv_out, ("hidden", "kv_heads")),
        linear((*path, "o"), f"{prefix}.o_proj", cfg.num_heads * hd, h, ("heads", "hidden")),
    ]
    if cfg.qk_norm:
        specs += [norm((*path, "q_norm"), f"{prefix}.q_norm.weight", hd, "head_dim"),
                  norm((*path, "k_norm"), f"{prefix}.k_norm.weight", hd, "head_dim")]
    if cfg.attention_bias:
        for proj, n, axis in (("q", q_out, "heads"), ("k", kv_out, "kv_heads"), ("v", kv_out, "kv_heads"),
                              ("o", h, "hidden")):
            specs.append(vector((*path, f"{proj}_bias"), f"{prefix}.{proj}_proj.bias", n, axis))
    return specs


def mlp_specs(path, prefix, hidden, inter, gated: bool = True):
    """SwiGLU (gate, up, down), or with gated=False relu2 (up, down)."""
    return [
        *([linear((*path, "gate"), f"{prefix}.gate_proj", hidden, inter, ("hidden", "mlp"))] if gated else []),
        linear((*path, "up"), f"{prefix}.up_proj", hidden, inter, ("hidden", "mlp")),
        linear((*path, "down"), f"{prefix}.down_proj", inter, hidden, ("mlp", "hidden")),
    ]


def moe_specs(cfg: ModelConfig, path, prefix, fused_experts: bool = False):
    """fused_experts: the checkpoint holds each layer's experts as two 3-D tensors (Qwen3.5-MoE's
    `experts.gate_up_proj` [E, 2F, H] and `experts.down_proj` [E, H, F]) instead of one per expert."""
    h, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    up_axes, down_axes = ("hidden", "expert_mlp"), ("expert_mlp", "hidden")
    if fused_experts:
        gate_up = (f"{prefix}.experts.gate_up_proj",)
        routed = [experts_spec((*path, "experts", "gate"), gate_up, (e, 2 * f, h), "gate_half", up_axes),
                  experts_spec((*path, "experts", "up"), gate_up, (e, 2 * f, h), "up_half", up_axes),
                  experts_spec((*path, "experts", "down"), (f"{prefix}.experts.down_proj",), (e, h, f), "experts",
                               down_axes)]
    else:
        routed = [per_expert_spec(path, prefix, e, proj, n_in, n_out, axes)
                  for proj, n_in, n_out, axes in (("gate", h, f, up_axes), ("up", h, f, up_axes),
                                                  ("down", f, h, down_axes))]
    specs = [router_spec(path, prefix, h, e), *routed]
    if cfg.shared_expert_intermediate_size:
        specs += mlp_specs((*path, "shared"), f"{prefix}.shared_expert", h, cfg.shared_expert_intermediate_size)
        if cfg.shared_expert_gate:
            specs.append(linear((*path, "shared_gate"), f"{prefix}.shared_expert_gate", h, 1, ("hidden", "gate")))
    return specs


def per_expert_spec(path, prefix, e, proj, n_in, n_out, axes):
    """One routed projection held as one HF tensor per expert (stacked on a new axis 0)."""
    names = tuple(f"{prefix}.experts.{i}.{proj}_proj.weight" for i in range(e))
    return experts_spec((*path, "experts", proj), names, (n_out, n_in), "linear", axes)


def router_spec(path, prefix, h, e):
    return linear((*path, "router"), f"{prefix}.gate", h, e, ("hidden", "router"), "router")


def ffn_specs(cfg: ModelConfig, i: int, path, prefix, fused_experts: bool = False):
    if cfg.moe_layers[i]:
        return moe_specs(cfg, (*path, "moe"), f"{prefix}.mlp", fused_experts)
    return mlp_specs((*path, "mlp"), f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size)


def embedding_specs(cfg: ModelConfig):
    pre = cfg.weight_prefix
    return head_specs(cfg, f"{pre}embed_tokens.weight", f"{pre}norm.weight")


def head_specs(cfg: ModelConfig, embed_name: str, norm_name: str):
    """embed [V, H], final_norm and (untied) lm_head [H, V]."""
    specs = [ParamSpec(("embed",), (embed_name,), (cfg.vocab_size, cfg.hidden_size), role="embed",
                       axes=("vocab", "hidden")),
             norm(("final_norm",), norm_name, cfg.hidden_size)]
    if not cfg.tie_word_embeddings:
        specs.append(linear(("lm_head",), "lm_head", cfg.hidden_size, cfg.vocab_size, ("hidden", "vocab"), "head"))
    return specs


def hf_tensors(params, specs) -> dict[str, np.ndarray]:
    """A param pytree -> {HF tensor name: array}: what a checkpoint writer saves."""
    out = {}
    for spec in specs:
        out.update(zip(spec.hf_names, spec.to_hf(np.asarray(get_path(params, spec.path)))))
    return out


def abstract_params(specs, dtype):
    """The param pytree of ShapeDtypeStructs described by `specs`: the loaded params' form, no data."""
    import jax
    tree: dict = {}
    for spec in specs:
        set_path(tree, spec.path, jax.ShapeDtypeStruct(spec.shape, dtype))
    return as_lists(tree)


def check_params(params, like) -> None:
    """ValueError naming (as a dotted path, e.g. layers.3.attn.q) the first leaf where params (arrays) and `like`
    (their abstract form) differ in tree structure, shape or dtype."""
    import jax
    name = lambda keys: ".".join(map(str, path_of(keys)))
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    want, want_tree = jax.tree_util.tree_flatten_with_path(like)
    if tree != want_tree:
        got, exp = {name(k) for k, _ in flat}, {name(k) for k, _ in want}
        raise ValueError(f"params differ from their specs: unexpected {sorted(got - exp)[:3]}, "
                         f"missing {sorted(exp - got)[:3]}")
    for (path, a), (_, b) in zip(flat, want):
        if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
            raise ValueError(f"param {name(path)} is {a.dtype}{list(a.shape)}, its spec says {b.dtype}{list(b.shape)}")
