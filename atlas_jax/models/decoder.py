"""The decoder forward shared by every family: embed -> layers -> final norm -> logits.

`forward(params, state, segments, cfg)` is pure: it returns new state instead of mutating it.
Hidden states live on one flat token axis [N, H] over all segments (batch.py), so every
matmul, norm and FFN is one op per layer whatever mix of decode rows and prefill chunks.
Layer i's mixer is attention, GDN, Mamba2 or none by `cfg.layer_types[i]`; its FFN is MoE, dense or
none by `cfg.ffn_types[i]` (Nemotron-H's blocks have one of the two). The i-th attention layer owns
state.kv[i], the i-th recurrent (GDN or Mamba2) layer state.ssm[i].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..batch import StepBatch, split_segments
from ..config import FULL_ATTENTION, LINEAR_ATTENTION, MAMBA, MOE, NONE, RECURRENT, ModelConfig
from ..kernels import XLA, Kernels
from ..layers.attention import attention_layer
from ..layers.gdn import gdn_layer
from ..layers.linear import PackedLinear
from ..layers.mamba2 import mamba2_layer
from ..layers.mlp import mlp
from ..layers.moe import MoeSpec, moe
from ..layers.norms import add_rms_norm, rms_norm
from ..layers.rope import rope_cos_sin
from ..state.cache import ModelState


def decoder_layer(p, x, layer_state, segments, cos, sin, cfg: ModelConfig, i: int, kernels: Kernels = XLA,
                  skip_mixer: bool = False, slot=None):
    """One layer: a pre-norm residual mixer block and / or FFN block (skip_mixer: the FFN half only).
    slot [N]: each token's LoRA adapter slot (None: no adapters). Returns (x, layer_state)."""
    mixer, ffn = cfg.layer_types[i], cfg.ffn_types[i]
    eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm
    with jax.named_scope(f"layer_{i}"):
        h = None                                     # the mixer's output, not yet added to x
        if mixer != NONE and not skip_mixer:
            h = rms_norm(x, p["input_norm"], eps, zc, kernels)
            if mixer == FULL_ATTENTION:
                h, layer_state = attention_layer(p["attn"], h, layer_state, segments, cos, sin, cfg, kernels, slot)
            elif mixer == LINEAR_ATTENTION:
                h, layer_state = gdn_layer(p["gdn"], h, layer_state, segments, cfg, kernels, slot)
            else:
                assert mixer == MAMBA, mixer
                h, layer_state = mamba2_layer(p["mamba"], h, layer_state, segments, cfg, kernels, slot)
        if ffn == NONE:
            return (x if h is None else x + h), layer_state
        if h is None:
            h = rms_norm(x, p["post_norm"], eps, zc, kernels)
        else:
            x, h = add_rms_norm(x, h, p["post_norm"], eps, zc, kernels)
        if ffn == MOE:
            h = moe(p["moe"], h, MoeSpec.of(cfg), kernels, slot)
        else:
            h = mlp(p["mlp"], h, cfg.mlp_act, slot)
        return x + h, layer_state


def argmax(logits):
    """[..., V] -> [...] int32: jnp.argmax's answer (the first maximum; the first NaN if any), as two plain
    reductions. XLA:CPU lowers jnp.argmax to a scalar (value, index) reduce: 2.4 ms for [32, 32000] vs 0.5."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hit = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hit, iota, logits.shape[-1]), axis=-1)


def lm_head_weight(params, cfg: ModelConfig):
    """The output projection [H, V]: the transposed embedding when the config ties them, else the lm_head."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def project_logits(x, w):
    """x [N, H] @ w [H, V] -> fp32 logits."""
    if isinstance(w, PackedLinear):                  # the CPU custom call (fp32 throughout)
        return x @ w
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def lm_head(params, x, cfg: ModelConfig):
    return project_logits(x, lm_head_weight(params, cfg))


def forward(params, state: ModelState, segments: tuple[StepBatch, ...], cfg: ModelConfig, all_logits: bool = False,
            kernels: Kernels = XLA, all_hidden: bool = False, skip_recurrent: bool = False, logits: bool = True):
    """Returns (logits, hidden, state). logits: [sum B, V] fp32 at each row's last new token
    (rows of all segments in order), or per segment [B, T, V] (a list) with all_logits;
    hidden: final-normed hidden states at the same positions, or at every position ([N, H] on the
    flat token axis) with all_hidden. kernels: XLA layers or Pallas kernels. skip_recurrent: the GDN
    mixers are skipped (their state untouched): the self-speculative draft model. logits=False (with
    all_hidden): no lm_head, logits is None. LoRA: each row's adapter slot is its segment's `adapter`
    column, the adapter pool merged into params (layers/lora.with_pool); adapter None: no adapters."""
    tokens = jnp.concatenate([s.tokens.reshape(-1) for s in segments])
    x = jnp.take(params["embed"], tokens, axis=0)                               # [N, H]
    positions = jnp.concatenate([s.positions.reshape(-1) for s in segments])
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    kv, ssm = list(state.kv), list(state.ssm)
    slot = None
    if segments[0].adapter is not None:                     # per row -> per token on the flat axis
        slot = jnp.concatenate([jnp.repeat(s.adapter, s.tokens.shape[1]) for s in segments])
    n_attn = n_rec = 0
    for i, p in enumerate(params["layers"]):
        if cfg.layer_types[i] == FULL_ATTENTION:
            x, kv[n_attn] = decoder_layer(p, x, kv[n_attn], segments, cos, sin, cfg, i, kernels, slot=slot)
            n_attn += 1
        elif cfg.layer_types[i] in RECURRENT:
            x, ssm[n_rec] = decoder_layer(p, x, ssm[n_rec], segments, cos, sin, cfg, i, kernels, skip_recurrent,
                                          slot)
            n_rec += 1
        else:
            x, _ = decoder_layer(p, x, None, segments, cos, sin, cfg, i, kernels, slot=slot)
    new_state = ModelState(kv=tuple(kv), ssm=tuple(ssm))
    if all_logits or all_hidden:
        x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm, kernels)
        if all_logits:
            return split_segments(lm_head(params, x, cfg), segments), (x if all_hidden else split_segments(x, segments)), new_state
        return (lm_head(params, last_positions(x, segments), cfg) if logits else None), x, new_state
    x = rms_norm(last_positions(x, segments), params["final_norm"], cfg.rms_norm_eps, cfg.zero_centred_norm, kernels)
    return lm_head(params, x, cfg), x, new_state


def last_positions(x, segments):
    """x [N, H] on the flat token axis -> [sum B, H]: each row's entry at its last new token."""
    return jnp.concatenate([jnp.take_along_axis(x_s, jnp.maximum(s.q_len - 1, 0)[:, None, None], axis=1)[:, 0]
                            for s, x_s in zip(segments, split_segments(x, segments))])
