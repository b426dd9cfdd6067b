"""Qwen3 and Qwen3-MoE: every layer is full attention (plain RMSNorm, q/k norm, full RoPE);
the FFN is dense SwiGLU or a top-k MoE without a shared expert, per `cfg.moe_layers`."""
from ..config import ModelConfig
from .layout import attention_specs, embedding_specs, ffn_specs, norm

MODEL_TYPES = ("qwen3", "qwen3_moe")


def param_specs(cfg: ModelConfig, mtp_layers: int = 0, fused_experts: bool = False):
    del mtp_layers  # Qwen3 checkpoints carry no MTP head
    specs = embedding_specs(cfg)
    for i in range(cfg.num_layers):
        prefix, path = f"{cfg.weight_prefix}layers.{i}", ("layers", i)
        specs += [norm((*path, "input_norm"), f"{prefix}.input_layernorm.weight", cfg.hidden_size),
                  norm((*path, "post_norm"), f"{prefix}.post_attention_layernorm.weight", cfg.hidden_size)]
        specs += attention_specs(cfg, (*path, "attn"), f"{prefix}.self_attn")
        specs += ffn_specs(cfg, i, path, prefix, fused_experts)
    return specs
