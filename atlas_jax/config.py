"""ModelConfig: the engine's view of an HF `config.json` (qwen3, qwen3_moe, qwen3_next).

A ModelConfig is frozen and hashable: step functions close over it, so every field that
changes a compiled shape lives here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import json
import os

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet


class ConfigError(ValueError):
    """A config.json the engine cannot run; the message names the offending field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP width (0 when no layer is dense)
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float    # rotary applied to the first int(factor * head_dim) dims
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    layer_types: tuple[str, ...]    # per layer: FULL_ATTENTION | LINEAR_ATTENTION
    moe_layers: tuple[bool, ...]    # per layer: sparse MoE FFN (else dense SwiGLU)
    zero_centred_norm: bool         # RMSNorm scales by (1 + w) (Qwen3-Next) instead of w
    attn_output_gate: bool          # q_proj yields [query | gate] per head; out *= sigmoid(gate)
    # MoE (zeros when absent)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Gated DeltaNet (zeros when absent)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    eos_token_ids: tuple[int, ...] = ()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ConfigError(f"no config.json in {path}")
        with open(cfg_path) as f:
            raw = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
            raw = {**raw, "_generation_eos_token_id": gen_eos}
        return _parse(raw)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _parse(raw: dict) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError("config.json has no 'model_type'")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

    def need(name):
        if raw.get(name) is None:
            raise ConfigError(f"{model_type} config.json is missing required field {name!r}")
        return raw[name]

    hidden = int(need("hidden_size"))
    n_layers = int(need("num_hidden_layers"))
    n_heads = int(need("num_attention_heads"))
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported yet")

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError(f"{model_type} config.json is missing required field 'rope_theta'")
    default_partial = 0.25 if model_type == "qwen3_next" else 1.0
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))

    if model_type == "qwen3_next":
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = int(raw.get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]
    else:
        layer_types = [FULL_ATTENTION] * n_layers
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
    bad = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
    if bad:
        raise ConfigError(f"layer_types contains unsupported kinds {sorted(bad)}")

    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0) if model_type != "qwen3" else 0
    sparse_step = int(raw.get("decoder_sparse_step") or 1)
    mlp_only = set(raw.get("mlp_only_layers") or [])
    moe_layers = tuple(num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0 for i in range(n_layers))
    moe_fields = {}
    if any(moe_layers):
        moe_fields = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_expert_intermediate_size=(
                int(need("shared_expert_intermediate_size")) if model_type == "qwen3_next" else 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        )
    gdn_fields = {}
    if LINEAR_ATTENTION in layer_types:
        gdn_fields = {f: int(need(f)) for f in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")}
        if gdn_fields["linear_num_value_heads"] % gdn_fields["linear_num_key_heads"]:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    n_kv = int(raw.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv:
        raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    eos = _ids(raw.get("eos_token_id")) + _ids(raw.get("_generation_eos_token_id"))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(raw.get("head_dim") or hidden // n_heads),
        intermediate_size=int(need("intermediate_size")) if not all(moe_layers) else int(raw.get("intermediate_size") or 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(partial),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        layer_types=layer_types,
        moe_layers=moe_layers,
        zero_centred_norm=model_type == "qwen3_next",
        attn_output_gate=model_type == "qwen3_next",
        eos_token_ids=tuple(dict.fromkeys(eos)),
        **moe_fields,
        **gdn_fields,
    )
