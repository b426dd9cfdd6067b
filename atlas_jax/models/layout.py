"""Param layout: how HF checkpoint tensors map onto the engine's param pytree.

Each family lists `ParamSpec`s; the loader (weights/loader.py) and the default-model writer
(default_model.py) both read these lists, so the mapping is written once.
Linear weights are stored [in, out] (HF stores [out, in]) so a layer computes `x @ w`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple                      # keys into the param pytree, e.g. ("layers", 3, "attn", "q")
    hf_names: tuple[str, ...]        # one tensor, or one per expert (stacked on a new axis 0)
    hf_shape: tuple[int, ...]        # shape of each HF tensor
    kind: str = "plain"              # plain | linear (transpose) | conv ([C,1,K] -> [C,K]) | fused experts:
                                     # experts ([E,out,in] -> [E,in,out]), gate_half / up_half (of [E,2F,H])

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


def linear(path, name, n_in, n_out):
    return ParamSpec(path, (f"{name}.weight",), (n_out, n_in), "linear")


def vector(path, name, n):
    return ParamSpec(path, (name,), (n,))


def attention_specs(cfg: ModelConfig, path, prefix):
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)
    kv_out = cfg.num_kv_heads * hd
    specs = [
        linear((*path, "q"), f"{prefix}.q_proj", h, q_out),
        linear((*path, "k"), f"{prefix}.k_proj", h, kv_out),
        linear((*path, "v"), f"{prefix}.v_proj", h, kv_out),
        linear((*path, "o"), f"{prefix}.o_proj", cfg.num_heads * hd, h),
    ]
    if cfg.qk_norm:
        specs += [vector((*path, "q_norm"), f"{prefix}.q_norm.weight", hd),
                  vector((*path, "k_norm"), f"{prefix}.k_norm.weight", hd)]
    if cfg.attention_bias:
        for proj, n in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", h)):
            specs.append(vector((*path, f"{proj}_bias"), f"{prefix}.{proj}_proj.bias", n))
    return specs


def mlp_specs(path, prefix, hidden, inter):
    return [
        linear((*path, "gate"), f"{prefix}.gate_proj", hidden, inter),
        linear((*path, "up"), f"{prefix}.up_proj", hidden, inter),
        linear((*path, "down"), f"{prefix}.down_proj", inter, hidden),
    ]


def moe_specs(cfg: ModelConfig, path, prefix, fused_experts: bool = False):
    """fused_experts: the checkpoint holds each layer's experts as two 3-D tensors (Qwen3.5-MoE's
    `experts.gate_up_proj` [E, 2F, H] and `experts.down_proj` [E, H, F]) instead of one per expert."""
    h, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    def experts(proj, n_in, n_out):
        names = tuple(f"{prefix}.experts.{i}.{proj}_proj.weight" for i in range(e))
        return ParamSpec((*path, "experts", proj), names, (n_out, n_in), "linear")
    if fused_experts:
        gate_up = (f"{prefix}.experts.gate_up_proj",)
        routed = [ParamSpec((*path, "experts", "gate"), gate_up, (e, 2 * f, h), "gate_half"),
                  ParamSpec((*path, "experts", "up"), gate_up, (e, 2 * f, h), "up_half"),
                  ParamSpec((*path, "experts", "down"), (f"{prefix}.experts.down_proj",), (e, h, f), "experts")]
    else:
        routed = [experts("gate", h, f), experts("up", h, f), experts("down", f, h)]
    specs = [linear((*path, "router"), f"{prefix}.gate", h, e), *routed]
    if cfg.shared_expert_intermediate_size:
        specs += mlp_specs((*path, "shared"), f"{prefix}.shared_expert", h, cfg.shared_expert_intermediate_size)
        if cfg.shared_expert_gate:
            specs.append(linear((*path, "shared_gate"), f"{prefix}.shared_expert_gate", h, 1))
    return specs


def ffn_specs(cfg: ModelConfig, i: int, path, prefix, fused_experts: bool = False):
    if cfg.moe_layers[i]:
        return moe_specs(cfg, (*path, "moe"), f"{prefix}.mlp", fused_experts)
    return mlp_specs((*path, "mlp"), f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size)


def embedding_specs(cfg: ModelConfig):
    pre = cfg.weight_prefix
    specs = [ParamSpec(("embed",), (f"{pre}embed_tokens.weight",), (cfg.vocab_size, cfg.hidden_size)),
             vector(("final_norm",), f"{pre}norm.weight", cfg.hidden_size)]
    if not cfg.tie_word_embeddings:
        specs.append(linear(("lm_head",), "lm_head", cfg.hidden_size, cfg.vocab_size))
    return specs


def set_path(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def get_path(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def hf_tensors(params, specs) -> dict[str, np.ndarray]:
    """A param pytree -> {HF tensor name: array}: what a checkpoint writer saves."""
    out = {}
    for spec in specs:
        out.update(zip(spec.hf_names, spec.to_hf(np.asarray(get_path(params, spec.path)))))
    return out


def as_lists(tree):
    """{'layers': {0: .., 1: ..}} -> {'layers': [.., ..]} (integer-keyed dicts become lists)."""
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            return [as_lists(tree[k]) for k in sorted(tree)]
        return {k: as_lists(v) for k, v in tree.items()}
    return tree


def abstract_params(specs, dtype):
    """The param pytree of ShapeDtypeStructs described by `specs`."""
    import jax
    tree: dict = {}
    for spec in specs:
        set_path(tree, spec.path, jax.ShapeDtypeStruct(spec.shape, dtype))
    return as_lists(tree)
