"""Mamba2 mixer (Nemotron-H), pure XLA + the shared recurrence (layers/gdn.py `mix`).

in_proj -> [gate z (I) | x B C (conv_dim) | dt (Hm)]; causal conv1d (+ bias) + SiLU over x B C;
per head h, state S [N, P] fp32 (N = state size, P = head_dim; HF keeps the transpose):
    dt = max(softplus(dt + dt_bias), dt_min);  S = S * exp(dt A) + dt * B x^T;  y = S^T C + D x
with A = -exp(A_log) and B, C shared by the Hm / n_groups heads of a group. That is the gated linear
recurrence without the delta rule (q = C, k = B, v = x, beta = dt, g = dt A), so it runs through
`gdn.mix` — conv window and h pools, chunked SSD for prefill (chunk = the config's chunk_size),
token steps for decode / verify with per-token states for rollback, the Pallas kernels on GPU.
Then y * silu(z) is RMS-normalised per group (n_groups groups of I / n_groups) and projected out.
Under tensor parallel in_proj's output, the conv channels and their state are tiled (`kernels.section_tiles`,
layers/sections.py), so every device holds its own heads and groups of each section.
"""
import jax
import jax.numpy as jnp

from ..batch import join_segments, split_segments
from ..kernels import XLA, Kernels
from .gdn import mix
from .lora import project
from .norms import rms_norm_gated_grouped
from .sections import split_tiled


def in_sections(cfg) -> tuple[int, ...]:
    """in_proj's output sections: z | x | B | C | dt."""
    width, gn = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.mamba_n_groups * cfg.mamba_state_size
    return (width, width, gn, gn, cfg.mamba_num_heads)


def conv_sections(cfg) -> tuple[int, ...]:
    """The conv channels' sections: x | B | C."""
    return in_sections(cfg)[1:4]


def mamba2_layer(p, x, ssm, segments, cfg, kernels: Kernels = XLA, slot=None):
    """p: in_proj [H, I + C + Hm] (+ in_proj_bias), conv [C, K] (+ conv_bias [C]), dt_bias, A_log, D [Hm],
    norm [I], out [I, H] (+ out_bias). ssm = (h [S, R, Hm, N, P] fp32, conv [S, R, C, K]).
    x [N, H] flat over the segments -> ([N, H], ssm)."""
    n = x.shape[0]
    hm, hd, ns, ng = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size, cfg.mamba_n_groups
    width = hm * hd
    tiles = kernels.section_tiles
    proj = project(x, p, "in_proj", slot, cfg.mamba_proj_bias)
    # tiled, block d of in_proj is [z_d | x_d B_d C_d | dt_d]: xbc comes out in the conv's tiled channel order
    z, xbc, dt = split_tiled(proj, (width, cfg.mamba_conv_dim, hm), tiles)
    a = -jnp.exp(p["A_log"].astype(jnp.float32))
    conv_b = p["conv_bias"] if cfg.mamba_conv_bias else None
    outs = []
    for seg, xbc_s, dt_s in zip(segments, split_segments(xbc, segments), split_segments(dt, segments)):
        b, t = seg.tokens.shape

        def prepare(y, dt_s=dt_s, b=b, t=t):
            xs, bm, cm = split_tiled(y, conv_sections(cfg), tiles)
            step = jax.nn.softplus(dt_s.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
            step = jnp.maximum(step, cfg.mamba_dt_min)                                   # [B, T, Hm]
            return (cm.reshape(b, t, ng, ns), bm.reshape(b, t, ng, ns), xs.reshape(b, t, hm, hd), step * a, step)
        o, v, ssm = mix(xbc_s, ssm, seg, p["conv"], prepare, kernels, conv_b=conv_b, delta_rule=False,
                        chunk=cfg.mamba_chunk_size)
        outs.append(o + p["D"].astype(jnp.float32)[:, None] * v)
    y = join_segments(outs).reshape(n, width)
    y = rms_norm_gated_grouped(y, z, p["norm"], cfg.rms_norm_eps, ng).astype(x.dtype)
    return project(y, p, "out", slot, cfg.mamba_proj_bias), ssm
