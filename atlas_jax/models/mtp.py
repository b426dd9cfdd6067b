"""The multi-token-prediction (MTP) head (Qwen3-Next, Qwen3.5, Nemotron-H) as a drafter, and the draft loop.

At position p the head combines the token at p + 1 with the target's final-normed hidden state
at p:  x = fc([norm_e(embed(tok_{p+1})) | norm_h(h_p)]) -> one decoder layer (full attention
over the head's own paged KV, same page ids as the target's, then the FFN) -> norm -> shared
lm_head, which predicts tok_{p+2}. Drafting continues from the head's own output hidden state.
(Nemotron-H's head is written as blocks — mtp.layers.0 = enorm / hnorm / eh_proj + attention,
mtp.layers.1 = MoE + final_layernorm — which is the same computation: models/nemotron_h.py maps it.)

KV invariant: the head's KV at every position below the sequence's num_cached comes from a
catch-up over target hidden states (`propose`'s first pass), so a rejected draft's KV (written at positions
>= num_cached) is overwritten by the next step's catch-up before anything attends to it: the
trim on rejection is implicit and free.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..batch import StepBatch
from ..config import FULL_ATTENTION, ModelConfig
from ..kernels import XLA, Kernels
from ..layers.norms import rms_norm
from ..layers.rope import rope_cos_sin
from .decoder import argmax, decoder_layer, last_positions, lm_head, project_logits


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """An MTP layer: one full-attention layer with the config's MTP FFN kind (cfg.mtp_ffn)."""
    return dataclasses.replace(cfg, num_layers=1, layer_types=(FULL_ATTENTION,), ffn_types=(cfg.mtp_ffn,))


def mtp_forward(params, kv, segments, tokens, hidden, cfg: ModelConfig, depth: int = 0, kernels: Kernels = XLA):
    """One head pass. tokens [N] (the token after each position), hidden [N, H] (the hidden state at
    each position), over the segments' positions and pages. Returns (out [N, H] normed, kv)."""
    p = params["mtp"]
    eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norm
    e = rms_norm(jnp.take(params["embed"], tokens, axis=0), p["pre_fc_norm_embedding"], eps, zc, kernels)
    h = rms_norm(hidden.astype(e.dtype), p["pre_fc_norm_hidden"], eps, zc, kernels)
    x = jnp.concatenate([e, h], axis=-1) @ p["fc"]
    positions = jnp.concatenate([s.positions.reshape(-1) for s in segments])
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
    i = depth % len(p["layers"])
    kv = list(kv)
    x, kv[i] = decoder_layer(p["layers"][i], x, kv[i], segments, cos, sin, mtp_config(cfg), 0, kernels)
    return rms_norm(x, p["norm"], eps, zc, kernels), tuple(kv)


def propose(params, kv, segments, tokens_segs, hidden, catch_len, draft_ok, cfg: ModelConfig, num_drafts: int,
            kernels: Kernels = XLA):
    """Catch the head up on this step's accepted positions, then draft num_drafts tokens greedily.

    segments: the target step's segments; tokens_segs: per segment [B, T] the token after each fed
    position (the emitted token where the run ends); hidden: [N, H] target final-normed hidden on
    the flat token axis; catch_len: per segment [B] positions to catch up (accepted + 1, 0 for
    padding); draft_ok [sum B]: rows whose pages cover the draft positions (the others write no
    draft KV). Returns (drafts [sum B, num_drafts] int32, kv)."""
    with jax.named_scope("mtp"):                         # the head's ops, apart in profiles
        return _propose(params, kv, segments, tokens_segs, hidden, catch_len, draft_ok, cfg, num_drafts, kernels)


def _propose(params, kv, segments, tokens_segs, hidden, catch_len, draft_ok, cfg, num_drafts, kernels):
    caught = tuple(dataclasses.replace(s, tokens=jnp.maximum(t, 0), q_len=jnp.where(s.q_len > 0, n, 0))
                   for s, t, n in zip(segments, tokens_segs, catch_len))
    tokens = jnp.concatenate([s.tokens.reshape(-1) for s in caught])
    out, kv = mtp_forward(params, kv, caught, tokens, hidden, cfg, 0, kernels)
    h = last_positions(out, caught)                                                     # [R, H]
    draft = draft_tokens(params, h, cfg)
    drafts = [draft]
    start = jnp.concatenate([s.start + n for s, n in zip(caught, catch_len)])          # the emitted token's position
    table = jnp.concatenate([s.block_table for s in caught])
    slot = jnp.concatenate([s.slot for s in caught])
    live = draft_ok & (jnp.concatenate(catch_len) > 0)
    for j in range(1, num_drafts):
        seg = StepBatch(tokens=draft[:, None], q_len=live.astype(jnp.int32), start=start + j - 1, block_table=table,
                        slot=slot, state_idx=jnp.zeros_like(slot))
        h, kv = mtp_forward(params, kv, (seg,), draft, h, cfg, j, kernels)
        draft = draft_tokens(params, h, cfg)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), kv


def draft_tokens(params, h, cfg: ModelConfig):
    """The head's greedy draft from its hidden state h [R, H]: the argmax over the whole vocabulary, or with a
    draft vocabulary (params["mtp_vocab"]: ids [n], lm_head [H, n]; FR-Spec) over those n tokens only."""
    vocab = params.get("mtp_vocab")
    if vocab is None:
        return argmax(lm_head(params, h, cfg))
    return jnp.take(vocab["ids"], argmax(project_logits(h, vocab["lm_head"])))


def init_mtp_kv(cfg: ModelConfig, num_layers: int, num_pages: int, page_size: int, dtype):
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers))

