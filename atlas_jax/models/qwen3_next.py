"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet layers with a full-attention layer every
`full_attention_interval` (output-gated, partial RoPE), zero-centred RMSNorms, dense SwiGLU or MoE
with a sigmoid-gated shared expert, and an optional MTP head (`mtp.*`, loaded for speculative decoding).

Qwen3.5 differs in its checkpoint only: the GDN input projections are separate (in_proj_qkv -> all q,
all k, all v heads; in_proj_z; in_proj_b; in_proj_a) where Qwen3-Next groups them per key head
(in_proj_qkvz, in_proj_ba); multimodal checkpoints nest the decoder under model.language_model.
(cfg.weight_prefix); MoE checkpoints may hold each layer's experts fused in two 3-D tensors."""
from ..config import ModelConfig
from ..layers.gdn import qkv_sections
from .layout import attention_specs, conv, embedding_specs, ffn_specs, linear, norm, vector
from .mtp import mtp_config

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def gdn_specs(cfg: ModelConfig, path, prefix):
    h = cfg.hidden_size
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if cfg.gdn_grouped:
        projections = [linear((*path, "qkvz"), f"{prefix}.in_proj_qkvz", h, 2 * hk * dk + 2 * hv * dv,
                              ("hidden", "gdn_qkvz")),
                       linear((*path, "ba"), f"{prefix}.in_proj_ba", h, 2 * hv, ("hidden", "gdn_ba"))]
    else:
        projections = [linear((*path, "qkv"), f"{prefix}.in_proj_qkv", h, 2 * hk * dk + hv * dv, ("hidden", "gdn_qkv"),
                              sections=qkv_sections(cfg)),
                       linear((*path, "z"), f"{prefix}.in_proj_z", h, hv * dv, ("hidden", "gdn_value")),
                       linear((*path, "b"), f"{prefix}.in_proj_b", h, hv, ("hidden", "gdn_heads")),
                       linear((*path, "a"), f"{prefix}.in_proj_a", h, hv, ("hidden", "gdn_heads"))]
    return [
        *projections,
        conv((*path, "conv"), f"{prefix}.conv1d.weight", cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim, "gdn_conv",
             sections=qkv_sections(cfg)),
        vector((*path, "A_log"), f"{prefix}.A_log", hv, "gdn_heads"),
        vector((*path, "dt_bias"), f"{prefix}.dt_bias", hv, "gdn_heads"),
        norm((*path, "norm"), f"{prefix}.norm.weight", dv, "value_dim"),
        linear((*path, "out"), f"{prefix}.out_proj", hv * dv, h, ("gdn_value", "hidden")),
    ]


def layer_specs(cfg: ModelConfig, i: int, path, prefix, fused_experts: bool = False):
    specs = [norm((*path, "input_norm"), f"{prefix}.input_layernorm.weight", cfg.hidden_size),
             norm((*path, "post_norm"), f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)]
    if cfg.layer_types[i] == "full_attention":
        specs += attention_specs(cfg, (*path, "attn"), f"{prefix}.self_attn")
    else:
        specs += gdn_specs(cfg, (*path, "gdn"), f"{prefix}.linear_attn")
    return specs + ffn_specs(cfg, i, path, prefix, fused_experts)


def mtp_specs(cfg: ModelConfig, num_layers: int, fused_experts: bool = False):
    h = cfg.hidden_size
    specs = [linear(("mtp", "fc"), "mtp.fc", 2 * h, h, ("hidden_pair", "hidden")),
             norm(("mtp", "pre_fc_norm_embedding"), "mtp.pre_fc_norm_embedding.weight", h),
             norm(("mtp", "pre_fc_norm_hidden"), "mtp.pre_fc_norm_hidden.weight", h),
             norm(("mtp", "norm"), "mtp.norm.weight", h)]
    mcfg = mtp_config(cfg)
    for i in range(num_layers):
        specs += layer_specs(mcfg, 0, ("mtp", "layers", i), f"mtp.layers.{i}", fused_experts)
    return specs


def param_specs(cfg: ModelConfig, mtp_layers: int = 0, fused_experts: bool = False):
    specs = embedding_specs(cfg)
    for i in range(cfg.num_layers):
        specs += layer_specs(cfg, i, ("layers", i), f"{cfg.weight_prefix}layers.{i}", fused_experts)
    return specs + (mtp_specs(cfg, mtp_layers, fused_experts) if mtp_layers else [])
