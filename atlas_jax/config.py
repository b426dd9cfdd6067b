"""ModelConfig: the engine's view of an HF `config.json` (qwen3, qwen3_moe, qwen3_next, qwen3_5, qwen3_5_moe,
nemotron_h).

A ModelConfig is frozen and hashable: step functions close over it, so every field that
changes a compiled shape lives here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import json
import os

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text",
                         "qwen3_5_moe_text", "nemotron_h")
# Qwen3-Next's architecture: GDN + gated attention, zero-centred norms, partial RoPE, shared expert
NEXT_FAMILY = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# multimodal wrappers: the language model's config is `text_config`, its tensors under model.language_model.
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# A layer's mixer (cfg.layer_types) and FFN (cfg.ffn_types); Nemotron-H's blocks have one or the other.
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet
MAMBA = "mamba"                        # Mamba2 (SSD)
NONE = "none"
RECURRENT = (LINEAR_ATTENTION, MAMBA)  # mixers with a recurrent-state slot (state.ssm)
MLP, MOE = "mlp", "moe"


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
    layer_types: tuple[str, ...]    # per layer, its mixer: FULL_ATTENTION | LINEAR_ATTENTION | MAMBA | NONE
    ffn_types: tuple[str, ...]      # per layer, its FFN: MLP (dense) | MOE | NONE
    zero_centred_norm: bool         # RMSNorm scales by (1 + w) (Qwen3-Next) instead of w
    attn_output_gate: bool          # q_proj yields [query | gate] per head; out *= sigmoid(gate)
    qk_norm: bool = True            # RMSNorm on each query / key head (Qwen3); Nemotron-H has none
    mlp_act: str = "silu"           # silu: gated SwiGLU (gate, up, down); relu2: relu(x @ up)^2 @ down
    # MoE (zeros when absent)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x @ shared_gate) (Qwen3-Next)
    norm_topk_prob: bool = True
    moe_router: str = "softmax"     # softmax top-k | sigmoid (+ correction bias, group-limited top-k: Nemotron-H)
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling: float = 1.0
    moe_latent_size: int = 0        # experts run in a latent width (fc1 / fc2 latent projections) when > 0
    # Gated DeltaNet (zeros when absent)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Mamba2 (zeros when absent): heads x head_dim channels, B / C in n_groups groups of state size
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_kernel: int = 0
    mamba_chunk_size: int = 0
    mamba_dt_min: float = 0.0       # dt = max(softplus(dt + dt_bias), dt_min)
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    mtp_ffn: str = "mlp"            # the MTP layer's FFN (MLP | MOE | NONE: a head the engine cannot run)
    weight_prefix: str = "model."   # the decoder's tensors: model.layers.* or model.language_model.layers.*
    vision: bool = False            # a multimodal checkpoint (its vision tower is not loaded)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_grouped(self) -> bool:
        """The GDN input projections grouped per key head (qkvz, ba: Qwen3-Next), else separate (qkv, z, b, a)."""
        return self.model_type == "qwen3_next"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Layers owning a recurrent-state slot (GDN or Mamba2), in order: state.ssm[j] is the j-th."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in RECURRENT)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(f == MOE for f in self.ffn_types)

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim + 2 * self.mamba_n_groups * self.mamba_state_size

    def recurrent_shapes(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Layer i's recurrent state per slot position: (h [H, Dk, Dv] fp32, conv window [C, K])."""
        if self.layer_types[i] == MAMBA:    # Dk = state, Dv = head_dim (layers/mamba2.py)
            return ((self.mamba_num_heads, self.mamba_state_size, self.mamba_head_dim),
                    (self.mamba_conv_dim, self.mamba_conv_kernel))
        return ((self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim),
                (self.gdn_conv_dim, self.linear_conv_kernel_dim))

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


def _unwrap(raw: dict) -> tuple[dict, dict]:
    """A multimodal wrapper's config -> (its text config with the wrapper's tie / eos settings,
    extra ModelConfig fields); other configs pass through."""
    model_type = raw.get("model_type")
    if model_type not in WRAPPERS:
        return raw, {}
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{model_type} config.json has no 'text_config' object")
    inner = {**text, "model_type": text.get("model_type", WRAPPERS[model_type])}
    for key in ("tie_word_embeddings", "_generation_eos_token_id"):
        if key in raw:
            inner[key] = raw[key]
    if inner.get("eos_token_id") is None and raw.get("eos_token_id") is not None:
        inner["eos_token_id"] = raw["eos_token_id"]
    return inner, {"weight_prefix": "model.language_model.", "vision": "vision_config" in raw}


def _parse(raw: dict) -> ModelConfig:
    if raw.get("model_type") is None:
        raise ConfigError("config.json has no 'model_type'")
    raw, wrapper_fields = _unwrap(raw)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES or model_type in WRAPPERS:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "nemotron_h":
        return _parse_nemotron_h(raw)
    next_family = model_type in NEXT_FAMILY

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
    # Qwen3.5's multimodal RoPE (mrope_section / mrope_interleaved) gives text tokens the same position
    # on all three axes, which is plain RoPE: the engine serves text only.
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError(f"{model_type} config.json is missing required field 'rope_theta'")
    default_partial = 0.25 if next_family else 1.0
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))

    if next_family:
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
    ffn_types = tuple(MOE if m else MLP for m in moe_layers)
    moe_fields = {}
    if any(moe_layers):
        moe_fields = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_expert_intermediate_size=(
                int(need("shared_expert_intermediate_size")) if next_family else 0),
            shared_expert_gate=next_family,
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
        ffn_types=ffn_types,
        mtp_ffn=MOE if any(moe_layers) else MLP,
        zero_centred_norm=next_family,
        attn_output_gate=next_family,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        **moe_fields,
        **gdn_fields,
        **wrapper_fields,
    )


NEMOTRON_BLOCKS = {"linear_attention": (MAMBA, NONE), "mamba": (MAMBA, NONE), "full_attention": (FULL_ATTENTION, NONE),
                   "attention": (FULL_ATTENTION, NONE), "mlp": (NONE, MLP), "moe": (NONE, MOE)}
NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _parse_nemotron_h(raw: dict) -> ModelConfig:
    """Nemotron-H / Nemotron 3: a stack of single-purpose blocks (norm -> one of Mamba2, attention
    without RoPE, relu2 MLP, MoE -> residual), by `layers_block_type` or the older
    `hybrid_override_pattern` string (M mamba, * attention, - mlp, E moe)."""
    def need(name, *aliases):
        for key in (name, *aliases):
            if raw.get(key) is not None:
                return raw[key]
        raise ConfigError(f"nemotron_h config.json is missing required field {name!r}")

    blocks = raw.get("layers_block_type") or raw.get("layer_types")
    if blocks is None:
        pattern = need("hybrid_override_pattern")
        bad = sorted(set(pattern) - set(NEMOTRON_PATTERN))
        if bad:
            raise ConfigError(f"hybrid_override_pattern has unknown block symbols {bad}")
        blocks = [NEMOTRON_PATTERN[c] for c in pattern]
    bad = sorted(set(blocks) - set(NEMOTRON_BLOCKS))
    if bad:
        raise ConfigError(f"layers_block_type contains unsupported kinds {bad}")
    layer_types = tuple(NEMOTRON_BLOCKS[b][0] for b in blocks)
    ffn_types = tuple(NEMOTRON_BLOCKS[b][1] for b in blocks)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise ConfigError(f"{key} {raw[key]!r} is not supported (only {want!r})")
    for key in ("mlp_bias", "sliding_window"):
        if raw.get(key):
            raise ConfigError(f"{key}={raw[key]!r} is not supported yet")
    hidden, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    n_kv = int(raw.get("num_key_value_heads") or n_heads)
    if n_heads % n_kv:
        raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    fields = {}
    if MAMBA in layer_types:
        fields.update(mamba_num_heads=int(need("mamba_num_heads")), mamba_head_dim=int(need("mamba_head_dim")),
                      mamba_state_size=int(need("ssm_state_size")), mamba_n_groups=int(need("n_groups", "mamba_n_groups")),
                      mamba_conv_kernel=int(need("conv_kernel", "mamba_d_conv")),
                      mamba_chunk_size=int(need("chunk_size", "mamba_chunk_size")),
                      mamba_dt_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
                      mamba_conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
                      mamba_proj_bias=bool(raw.get("use_bias", False)))
        if fields["mamba_num_heads"] % fields["mamba_n_groups"]:
            raise ConfigError("mamba_num_heads must be a multiple of n_groups")
    if MOE in ffn_types:
        n_group = int(raw.get("n_group") or 1)
        experts = int(need("n_routed_experts", "num_local_experts"))
        if experts % n_group:
            raise ConfigError(f"n_routed_experts {experts} is not a multiple of n_group {n_group}")
        fields.update(num_experts=experts, num_experts_per_tok=int(need("num_experts_per_tok")),
                      moe_intermediate_size=int(need("moe_intermediate_size")),
                      shared_expert_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size") or 0),
                      norm_topk_prob=bool(raw.get("norm_topk_prob", True)), moe_router="sigmoid",
                      moe_n_group=n_group, moe_topk_group=int(raw.get("topk_group") or 1),
                      moe_routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
                      moe_latent_size=int(raw.get("moe_latent_size") or 0))
    # MTP head blocks: the engine runs [attention, mlp | moe] (one MTP layer)
    mtp_blocks = raw.get("mtp_layers_block_type") or [NEMOTRON_PATTERN.get(c, c) for c in
                                                       raw.get("mtp_hybrid_override_pattern", "*E")]
    mtp_kinds = [NEMOTRON_BLOCKS.get(b) for b in mtp_blocks]
    mtp_ffn = mtp_kinds[1][1] if len(mtp_kinds) == 2 and mtp_kinds[0] == (FULL_ATTENTION, NONE) and \
        mtp_kinds[1] and mtp_kinds[1][0] == NONE else NONE
    fields["mtp_ffn"] = mtp_ffn
    eos = _ids(raw.get("eos_token_id")) + _ids(raw.get("_generation_eos_token_id"))
    return ModelConfig(
        model_type="nemotron_h", vocab_size=int(need("vocab_size")), hidden_size=hidden, num_layers=len(blocks),
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=int(raw.get("head_dim") or hidden // n_heads),
        intermediate_size=int(raw.get("intermediate_size") or 0) if MLP in ffn_types else 0,
        rms_norm_eps=float(raw.get("layer_norm_epsilon", raw.get("rms_norm_eps", 1e-5))),
        rope_theta=10000.0, partial_rotary_factor=0.0,                         # no positional encoding
        tie_word_embeddings=False,            # transformers' NemotronH never ties: lm_head.weight is its own
        attention_bias=False,                                                  # its projections have none
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        layer_types=layer_types, ffn_types=ffn_types, zero_centred_norm=False, attn_output_gate=False,
        qk_norm=False, mlp_act="relu2", eos_token_ids=tuple(dict.fromkeys(eos)), weight_prefix="backbone.",
        **fields)
