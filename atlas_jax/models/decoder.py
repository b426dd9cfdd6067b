"""The decoder forward shared by every family: embed -> layers -> final norm -> logits.

`forward(params, state, segments, cfg)` is pure: it returns new state instead of mutating it.
Hidden states live on one flat token axis [N, H] over all segments (batch.py), so every
matmul, norm and FFN is one op per layer whatever mix of decode rows and prefill chunks.
Layer i's mixer is attention or GDN by `cfg.layer_types[i]`; its FFN is MoE or dense by
`cfg.moe_layers[i]`. The i-th attention layer owns state.kv[i], the i-th GDN layer state.ssm[i].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..batch import StepBatch, split_segments
from ..config import FULL_ATTENTION, ModelConfig
from ..kernels import XLA, Kernels
from ..layers.attention import attention_layer
from ..layers.gdn import gdn_layer
from ..layers.mlp import swiglu
from ..layers.moe import moe
from ..layers.norms import rms_norm
from ..layers.rope import rope_cos_sin
from ..state.cache import ModelState


def decoder_layer(p, x, layer_state, segments, cos, sin, cfg: ModelConfig, i: int, kernels: Kernels = XLA,
                  skip_mixer: bool = False):
    """One pre-norm residual block (skip_mixer: the FFN half only). Returns (x, layer_state)."""
    with jax.named_scope(f"layer_{i}"):
        if not skip_mixer:
            h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
            if cfg.layer_types[i] == FULL_ATTENTION:
                h, layer_state = attention_layer(p["attn"], h, layer_state, segments, cos, sin, cfg, kernels)
            else:
                h, layer_state = gdn_layer(p["gdn"], h, layer_state, segments, cfg, kernels)
            x = x + h
        h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
        if cfg.moe_layers[i]:
            h = moe(p["moe"], h, cfg.num_experts_per_tok, cfg.norm_topk_prob, kernels)
        else:
            h = swiglu(p["mlp"], h)
        return x + h, layer_state


def lm_head(params, x):
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def forward(params, state: ModelState, segments: tuple[StepBatch, ...], cfg: ModelConfig, all_logits: bool = False,
            kernels: Kernels = XLA, all_hidden: bool = False, skip_recurrent: bool = False, logits: bool = True):
    """Returns (logits, hidden, state). logits: [sum B, V] fp32 at each row's last new token
    (rows of all segments in order), or per segment [B, T, V] (a list) with all_logits;
    hidden: final-normed hidden states at the same positions, or at every position ([N, H] on the
    flat token axis) with all_hidden. kernels: XLA layers or Pallas kernels. skip_recurrent: the GDN
    mixers are skipped (their state untouched): the self-speculative draft model. logits=False (with
    all_hidden): no lm_head, logits is None."""
    tokens = jnp.concatenate([s.tokens.reshape(-1) for s in segments])
    x = jnp.take(params["embed"], tokens, axis=0)                               # [N, H]
    positions = jnp.concatenate([s.positions.reshape(-1) for s in segments])
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    kv, ssm = list(state.kv), list(state.ssm)
    n_attn = n_gdn = 0
    for i, p in enumerate(params["layers"]):
        if cfg.layer_types[i] == FULL_ATTENTION:
            x, kv[n_attn] = decoder_layer(p, x, kv[n_attn], segments, cos, sin, cfg, i, kernels)
            n_attn += 1
        else:
            x, ssm[n_gdn] = decoder_layer(p, x, ssm[n_gdn], segments, cos, sin, cfg, i, kernels, skip_recurrent)
            n_gdn += 1
    new_state = ModelState(kv=tuple(kv), ssm=tuple(ssm))
    if all_logits or all_hidden:
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
        if all_logits:
            return split_segments(lm_head(params, x), segments), (x if all_hidden else split_segments(x, segments)), new_state
        return (lm_head(params, last_positions(x, segments)) if logits else None), x, new_state
    x = rms_norm(last_positions(x, segments), params["final_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm)
    return lm_head(params, x), x, new_state


def last_positions(x, segments):
    """x [N, H] on the flat token axis -> [sum B, H]: each row's entry at its last new token."""
    return jnp.concatenate([jnp.take_along_axis(x_s, jnp.maximum(s.q_len - 1, 0)[:, None, None], axis=1)[:, 0]
                            for s, x_s in zip(segments, split_segments(x, segments))])
