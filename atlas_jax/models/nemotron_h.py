"""Nemotron-H / Nemotron 3 (`nemotron_h`): a stack of single-purpose blocks under `backbone.`, each
norm -> mixer -> residual, the mixer one of Mamba2, attention (GQA, no RoPE, no q/k norm), relu2
MLP, or MoE (sigmoid router with correction bias and group-limited top-k, relu2 experts, a relu2
shared expert, optional latent projections). An engine layer holds one block: a mixer block's norm
is its `input_norm`, an FFN block's its `post_norm` (cfg.layer_types / cfg.ffn_types). An MTP head
(`mtp.layers.*`, vLLM's NemotronH-MTP layout) is loaded when present."""
import dataclasses

from ..config import FULL_ATTENTION, MAMBA, MLP, MOE, NONE, ModelConfig
from ..layers.mamba2 import conv_sections, in_sections
from .layout import (attention_specs, conv, experts_spec, head_specs, linear, mlp_specs, norm, per_expert_spec,
                     router_spec, vector)

MODEL_TYPES = ("nemotron_h",)


def mamba_specs(cfg: ModelConfig, path, prefix):
    h, hm, c = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_conv_dim
    width = hm * cfg.mamba_head_dim
    specs = [linear((*path, "in_proj"), f"{prefix}.in_proj", h, width + c + hm, ("hidden", "mamba_in")),
             conv((*path, "conv"), f"{prefix}.conv1d.weight", c, cfg.mamba_conv_kernel, "mamba_conv"),
             vector((*path, "dt_bias"), f"{prefix}.dt_bias", hm, "mamba_heads"),
             vector((*path, "A_log"), f"{prefix}.A_log", hm, "mamba_heads"),
             vector((*path, "D"), f"{prefix}.D", hm, "mamba_heads"),
             norm((*path, "norm"), f"{prefix}.norm.weight", width, "mamba_inner"),
             linear((*path, "out"), f"{prefix}.out_proj", width, h, ("mamba_inner", "hidden"))]
    if cfg.mamba_conv_bias:
        specs.append(vector((*path, "conv_bias"), f"{prefix}.conv1d.bias", c, "mamba_conv"))
    if cfg.mamba_proj_bias:
        specs += [vector((*path, "in_proj_bias"), f"{prefix}.in_proj.bias", width + c + hm, "mamba_in"),
                  vector((*path, "out_bias"), f"{prefix}.out_proj.bias", h, "hidden")]
    sections = {"mamba_in": in_sections(cfg), "mamba_conv": conv_sections(cfg)}
    return [dataclasses.replace(s, sections=sections[s.axes[s.sectioned_axis]]) if s.sectioned_axis is not None
            else s for s in specs]


def relu2_specs(path, prefix, hidden, inter):
    return mlp_specs(path, prefix, hidden, inter, gated=False)


def moe_specs(cfg: ModelConfig, path, prefix, fused_experts: bool):
    h, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    d = cfg.moe_latent_size or h                                   # the experts' width
    width = "latent" if cfg.moe_latent_size else "hidden"
    up_axes, down_axes = (width, "expert_mlp"), ("expert_mlp", width)
    if fused_experts:        # transformers' own layout: experts.up_proj [E, F, D], experts.down_proj [E, D, F]
        experts = [experts_spec((*path, "experts", "up"), (f"{prefix}.experts.up_proj",), (e, f, d), "experts", up_axes),
                   experts_spec((*path, "experts", "down"), (f"{prefix}.experts.down_proj",), (e, d, f), "experts",
                                down_axes)]
    else:
        experts = [per_expert_spec(path, prefix, e, "up", d, f, up_axes),
                   per_expert_spec(path, prefix, e, "down", f, d, down_axes)]
    specs = [router_spec(path, prefix, h, e),
             vector((*path, "router_bias"), f"{prefix}.gate.e_score_correction_bias", e, "router"), *experts]
    if cfg.shared_expert_intermediate_size:
        specs += relu2_specs((*path, "shared"), f"{prefix}.shared_experts", h, cfg.shared_expert_intermediate_size)
    if cfg.moe_latent_size:
        specs += [linear((*path, "latent_in"), f"{prefix}.fc1_latent_proj", h, d, ("hidden", "latent")),
                  linear((*path, "latent_out"), f"{prefix}.fc2_latent_proj", d, h, ("latent", "hidden"))]
    return specs


def mtp_specs(cfg: ModelConfig, blocks: int, fused_experts: bool):
    """The MTP head's blocks [attention, FFN] -> one MTP layer (models/mtp.py): mtp.layers.0 holds the
    fusion (enorm, hnorm, eh_proj) and the attention block, mtp.layers.1 the FFN block and the
    head's final norm."""
    if blocks != 2 or cfg.mtp_ffn == NONE:
        raise ValueError(f"this checkpoint's MTP head has {blocks} blocks; the engine runs [attention, mlp | moe]")
    h, path = cfg.hidden_size, ("mtp", "layers", 0)
    specs = [linear(("mtp", "fc"), "mtp.layers.0.eh_proj", 2 * h, h, ("hidden_pair", "hidden")),
             norm(("mtp", "pre_fc_norm_embedding"), "mtp.layers.0.enorm.weight", h),
             norm(("mtp", "pre_fc_norm_hidden"), "mtp.layers.0.hnorm.weight", h),
             norm(("mtp", "norm"), "mtp.layers.1.final_layernorm.weight", h),
             norm((*path, "input_norm"), "mtp.layers.0.norm.weight", h),
             norm((*path, "post_norm"), "mtp.layers.1.norm.weight", h),
             *attention_specs(cfg, (*path, "attn"), "mtp.layers.0.mixer")]
    if cfg.mtp_ffn == MLP:
        return specs + relu2_specs((*path, "mlp"), "mtp.layers.1.mixer", h, cfg.intermediate_size)
    return specs + moe_specs(cfg, (*path, "moe"), "mtp.layers.1.mixer", fused_experts)


def param_specs(cfg: ModelConfig, mtp_layers: int = 0, fused_experts: bool = False):
    """mtp_layers: the checkpoint's mtp.layers.* blocks (0: no head)."""
    pre, h = cfg.weight_prefix, cfg.hidden_size
    specs = head_specs(cfg, f"{pre}embeddings.weight", f"{pre}norm_f.weight")
    for i, (mixer, ffn) in enumerate(zip(cfg.layer_types, cfg.ffn_types)):
        path, prefix = ("layers", i), f"{pre}layers.{i}.mixer"
        norm_key = "input_norm" if ffn not in (MLP, MOE) else "post_norm"
        specs.append(norm((*path, norm_key), f"{pre}layers.{i}.norm.weight", h))
        if mixer == MAMBA:
            specs += mamba_specs(cfg, (*path, "mamba"), prefix)
        elif mixer == FULL_ATTENTION:
            specs += attention_specs(cfg, (*path, "attn"), prefix)
        elif ffn == MLP:
            specs += relu2_specs((*path, "mlp"), prefix, h, cfg.intermediate_size)
        else:
            specs += moe_specs(cfg, (*path, "moe"), prefix, fused_experts)
    return specs + (mtp_specs(cfg, mtp_layers, fused_experts) if mtp_layers else [])
