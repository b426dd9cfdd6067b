"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), pure-XLA path, and the gated linear
recurrence it shares with Mamba2 (layers/mamba2.py).

Recurrence per value head, state S [Dk, Dv] fp32, per token t:
    S = S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S = S + k_t delta^T;  o_t = S^T q_t
with q, k l2-normalised and q scaled by Dk^-0.5. Without the delta rule (delta_rule=False) the
update is S = S * exp(g_t) + beta_t k_t v_t^T: Mamba2's SSD with k = B, q = C, v = x, beta = dt,
g = dt * A, key heads = B/C groups. Decode-sized chunks run it token by token (`recurrent`);
longer chunks use the chunked form (`chunked`: WY with the delta rule, plain SSD without). A token
with g = 0 and beta = 0 leaves S unchanged: that is how padding columns stay inert. With Pallas
kernels (`kernels.pallas`) the recurrence runs in pallas_kernels/gdn.py under the same state contract,
and with `kernels.cpu` every chunk runs cpu_kernels/gdn_recurrent.cc (same contract): token by token
with each head's state in L1 is ~10x cheaper on a CPU than the chunked form's small XLA ops.
`mix` is the sequence-local part both mixers share: causal conv (+ conv state), the recurrence, and
the state pools' write-back. Under tensor parallel the conv channels q | k | v (and Qwen3.5's in_proj_qkv
outputs) are tiled (`kernels.section_tiles`, layers/sections.py): each device holds its own heads of each.
"""
import jax
import jax.numpy as jnp

from pallas_kernels import gdn as pallas_gdn

from .. import cpu_kernels
from ..batch import join_segments, split_segments
from ..kernels import XLA, Kernels
from .lora import project
from .norms import l2_normalize, rms_norm_gated
from .sections import split_tiled

CHUNK = 64
RECURRENT_MAX_T = 16   # chunks up to this many tokens use the token-by-token form


def _token_step(s, q_t, k_t, v_t, g_t, b_t, delta_rule: bool = True):
    """One token of the recurrence: s [B, H, Dk, Dv]; q_t, k_t [B, H, Dk]; v_t [B, H, Dv]; g_t, b_t [B, H]."""
    s = s * jnp.exp(g_t)[..., None, None]
    if delta_rule:
        v_t = v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)
    s = s + k_t[..., :, None] * (v_t * b_t[..., None])[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)


def recurrent(q, k, v, g, beta, s0, all_states: bool = False, delta_rule: bool = True):
    """q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; s0 [B, H, Dk, Dv] (all fp32,
    q already scaled). Returns (o [B, T, H, Dv], s_final), plus the state after every token
    [B, T, H, Dk, Dv] with all_states."""
    def step(s, xs):
        s, o = _token_step(s, *xs, delta_rule=delta_rule)
        return s, ((o, s) if all_states else o)
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    s, ys = jax.lax.scan(step, s0, xs)
    if all_states:
        return jnp.moveaxis(ys[0], 0, 1), s, jnp.moveaxis(ys[1], 0, 1)
    return jnp.moveaxis(ys, 0, 1), s


@jax.custom_vjp
def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], by forward substitution:
    row i of T is e_i - a[i, :] @ T (rows >= i of T are still identity, and a[i, j >= i] = 0).
    Pure jnp on purpose: XLA:CPU's LAPACK trsm custom call parallelises on the intra-op pool
    and deadlocks when two run concurrently on a 2-thread pool (jaxlib 0.10.2).
    Gradient (training): d(A^-1) = -A^-1 dA A^-1, so dL/da = -T^T (dL/dT) T^T on the strict lower triangle."""
    c = a.shape[-1]
    eye = jnp.eye(c, dtype=a.dtype)

    def row(i, t):
        r = eye[i] - jnp.einsum("...j,...jk->...k", a[..., i, :], t)
        return t.at[..., i, :].set(r)
    return jax.lax.fori_loop(1, c, row, jnp.broadcast_to(eye, a.shape))


def _unit_lower_inverse_fwd(a):
    t = unit_lower_inverse(a)
    return t, t


def _unit_lower_inverse_bwd(t, dt):
    da = -jnp.einsum("...ji,...jk,...lk->...il", t, dt, t)
    c = t.shape[-1]
    return (jnp.where(jnp.arange(c)[:, None] > jnp.arange(c)[None, :], da, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def chunked(q, k, v, g, beta, s0, chunk: int = CHUNK, delta_rule: bool = True):
    """Chunked form (WY with the delta rule, plain SSD without); same contract as `recurrent`."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    n = (t + pad) // chunk
    # -> [N, B, H, C, ...]: chunks lead so scan walks them
    def chunks(a):
        a = a.reshape(b, n, chunk, h, *a.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)
    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)                                       # [N, B, H, C]
    idx = jnp.arange(chunk)
    lower_incl = idx[:, None] >= idx[None, :]
    decay = jnp.exp(jnp.where(lower_incl, gc[..., :, None] - gc[..., None, :], -jnp.inf))  # [.., C, C]
    kb = k * beta[..., None]
    if delta_rule:
        a_mat = jnp.where(idx[:, None] > idx[None, :], jnp.einsum("...id,...jd->...ij", kb, k) * decay, 0.0)
        t_mat = unit_lower_inverse(a_mat)                                 # T = (I + A)^-1
        u = jnp.einsum("...ij,...jd->...id", t_mat, v * beta[..., None])            # u = T beta v
        w = jnp.einsum("...ij,...jd->...id", t_mat, kb * jnp.exp(gc)[..., None])    # w = T beta k exp(gc)
    else:
        u, w = v * beta[..., None], jnp.zeros_like(kb)
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay           # incl. diagonal
    q_dec = q * jnp.exp(gc)[..., None]
    g_last = gc[..., -1]                                              # [N, B, H]
    k_dec = k * jnp.exp(g_last[..., None] - gc)[..., None]

    def step(s, xs):
        u_c, w_c, intra_c, q_c, k_c, gl = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, s)
        o = jnp.einsum("bhck,bhkv->bhcv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", intra_c, v_new)
        s = s * jnp.exp(gl)[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
        return s, o
    s, o = jax.lax.scan(step, s0, (u, w, intra, q_dec, k_dec, g_last))   # o [N, B, H, C, Dv]
    o = jnp.moveaxis(o, 0, 1)                                         # [B, N, H, C, Dv]
    o = jnp.moveaxis(o, 2, 3).reshape(b, n * chunk, h, dv)
    return o[:, :t], s


def causal_conv(x, window, w, q_len, all_windows: bool = False, bias=None):
    """Depthwise causal conv1d (+ bias [C]) + SiLU over a chunk.
    x [B, T, C]; window [B, C, K] (the K inputs before column 0, oldest first); w [C, K];
    q_len [B]. Returns (y [B, T, C], new window [B, C, K] = the last K inputs up to column
    q_len - 1, i.e. unchanged for a row with q_len 0), or with all_windows the window after
    every column [B, T, C, K] in place of the new window."""
    kw = w.shape[-1]
    t = x.shape[1]
    ext = jnp.concatenate([jnp.swapaxes(window, 1, 2).astype(x.dtype), x], axis=1)   # [B, K+T, C]
    y = sum(ext[:, j + 1:j + 1 + t, :].astype(jnp.float32) * w[:, j].astype(jnp.float32) for j in range(kw))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if all_windows:
        windows = jnp.stack([ext[:, i + 1:i + 1 + kw] for i in range(t)], axis=1)     # [B, T, K, C]
        return jax.nn.silu(y).astype(x.dtype), jnp.swapaxes(windows, 2, 3)
    new_window = jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, kw, axis=0))(ext, q_len)
    return jax.nn.silu(y).astype(x.dtype), jnp.swapaxes(new_window, 1, 2)


# State pools are [S, R, ...]: R state positions per slot (R > 1 under speculative decoding). A row
# reads at (slot, state_idx); the state after its token t goes to (slot, t) for t < R - 1, the state
# after its last token to (slot, min(q_len - 1, R - 1)) — the same contract as pallas_kernels/gdn.py.

def _read_slot(pool, batch, fresh):
    """pool[slot, state_idx] per row ([B, ...]); zeros for padding rows (slot out of range) and for
    rows that start a sequence."""
    x = pool.at[batch.slot, batch.state_idx].get(mode="fill", fill_value=0)
    return jnp.where(fresh.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x)


def _after(value, dep):
    """value [B, ...], made data-dependent on dep [B, ...] row by row (adds 0 * a per-row sum of
    dep: XLA does not fold float x * 0, so the dependence survives optimisation)."""
    zero = jnp.sum(dep.astype(jnp.float32), axis=tuple(range(1, dep.ndim))) * 0
    return value + zero.reshape((-1,) + (1,) * (value.ndim - 1)).astype(value.dtype)


def _write_final(pool, batch, value):
    """value [B, ...] = the state after each row's last token."""
    idx = jnp.clip(batch.q_len - 1, 0, pool.shape[1] - 1)
    return pool.at[batch.slot, idx].set(value.astype(pool.dtype), mode="drop")


def _write_each(pool, batch, values):
    """values [B, T, ...] = the state after every column; written per the pool contract above."""
    b, t = values.shape[:2]
    r = pool.shape[1]
    col = jnp.arange(t, dtype=jnp.int32)[None, :]
    keep = batch.valid & ((col < r - 1) | (col == batch.q_len[:, None] - 1))
    slot = jnp.where(keep, batch.slot[:, None], pool.shape[0]).reshape(-1)
    idx = jnp.broadcast_to(jnp.minimum(col, r - 1), (b, t)).reshape(-1)
    return pool.at[slot, idx].set(values.reshape(b * t, *values.shape[2:]).astype(pool.dtype), mode="drop")


def pallas_core(q, k, v, g, beta, h_pool, batch, fresh, interpret: bool, delta_rule: bool = True):
    """The recurrence through the Pallas kernels: q, k [B, T, Hk, Dk] (key heads, not repeated);
    h_pool [S, R, Hv, Dk, Dv]; fresh [B] rows starting from zero state. Returns (o [B, T, Hv, Dv], h_pool)."""
    b, t = q.shape[:2]
    if t <= RECURRENT_MAX_T:
        return pallas_gdn.gdn_recurrent(q, k, v, g, beta, h_pool, batch.slot, batch.state_idx, batch.q_len, fresh,
                                        interpret=interpret, delta_rule=delta_rule)
    tp = -(-t // pallas_gdn.CHUNK) * pallas_gdn.CHUNK          # rows start on chunk boundaries
    flat = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2)).reshape(b * tp, *x.shape[2:])
    offset = jnp.arange(b, dtype=jnp.int32) * tp
    o, h_pool = pallas_gdn.gdn_chunked(*(flat(x) for x in (q, k, v, g, beta)), h_pool, offset, batch.q_len,
                                       batch.slot, batch.state_idx, fresh, interpret=interpret, delta_rule=delta_rule)
    return o.reshape(b, tp, *o.shape[1:])[:, :t], h_pool


def mix(mixed, ssm, batch, conv_w, prepare, kernels: Kernels = XLA, conv_b=None, delta_rule: bool = True,
        chunk: int = CHUNK):
    """The sequence-local part of one segment: causal conv, recurrence, state write-back.
    mixed [B, T, C] (the conv's input); conv_w [C, K] (+ conv_b [C]); prepare(y [B, T, C] the conv's
    fp32 output) -> (q, k [B, T, Hk, Dk] (key heads, not repeated), v [B, T, Hv, Dv], g, beta [B, T, Hv]),
    all fp32; columns past a row's q_len get g = beta = 0 here. Returns (o [B, T, Hv, Dv] fp32, v, ssm)."""
    b, t, _ = mixed.shape
    h_pool, conv_pool = ssm
    fresh = batch.start == 0                    # a sequence's first chunk starts from zero state
    decode = t == 1
    keep_all = h_pool.shape[1] > 1 and 1 < t <= RECURRENT_MAX_T    # verify-sized chunk: keep per-token states
    window = _read_slot(conv_pool, batch, fresh)
    if decode:
        window = jnp.concatenate([window[..., 1:], jnp.swapaxes(mixed, 1, 2).astype(window.dtype)], -1)
        w = conv_w.astype(jnp.float32)           # taps summed one by one: an elementwise fusion, no reduce op
        y = sum(window[..., j].astype(jnp.float32) * w[:, j] for j in range(w.shape[-1]))
        y = y if conv_b is None else y + conv_b.astype(jnp.float32)
        mixed = jax.nn.silu(y).astype(mixed.dtype)[:, None, :]
    else:
        mixed, window = causal_conv(mixed, window, conv_w, batch.q_len, all_windows=keep_all, bias=conv_b)
    q, k, v, g, beta = prepare(mixed.astype(jnp.float32))
    valid = batch.valid[..., None]
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)

    impl = kernels.gdn(q.shape[-1], v.shape[-1], h_pool.dtype)
    if impl == "pallas":
        o, h_pool = pallas_core(q, k, v, g, beta, h_pool, batch, fresh, kernels.interpret, delta_rule)
    elif impl == "cpu":
        o, h_pool = cpu_kernels.gdn_recurrent(q, k, v, g, beta, h_pool, batch.slot, batch.state_idx, batch.q_len,
                                              fresh, delta_rule)     # in place: no slot gather / scatter
    else:
        r = v.shape[2] // q.shape[2]
        q = jnp.repeat(q, r, axis=2)            # key head i serves value heads i*r..i*r+r-1
        k = jnp.repeat(k, r, axis=2)
        s = _read_slot(h_pool, batch, fresh)
        if decode:
            s, o = _token_step(s, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], delta_rule)
            o = o[:, None]
            h_pool = _write_final(h_pool, batch, _after(s, o))
        elif keep_all:
            o, _, states = recurrent(q, k, v, g, beta, s, all_states=True, delta_rule=delta_rule)
            h_pool = _write_each(h_pool, batch, _after(states, o))
        else:
            if t <= RECURRENT_MAX_T:
                o, s = recurrent(q, k, v, g, beta, s, delta_rule=delta_rule)
            else:
                o, s = chunked(q, k, v, g, beta, s, chunk=chunk, delta_rule=delta_rule)
            h_pool = _write_final(h_pool, batch, _after(s, o))
    # Pool writes depend on the outputs computed from the old values (`_after`), so every read of a
    # pool precedes its in-place update and XLA updates the donated pools in place (otherwise it
    # copies each whole pool around the update).
    write = _write_each if keep_all else _write_final
    return o, v, (h_pool, write(conv_pool, batch, _after(window, o)))


def qkv_sections(cfg) -> tuple[int, int, int]:
    """The conv channels' sections (and Qwen3.5's in_proj_qkv outputs): all q | all k | all v heads."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    return hk * dk, hk * dk, cfg.linear_num_value_heads * cfg.linear_value_head_dim


def gdn_mix(mixed, a_gate, b_gate, ssm, batch, p, cfg, kernels: Kernels = XLA):
    """GDN's mix: mixed [B, T, C] (q|k|v before the conv); a_gate, b_gate [B, T, Hv].
    Returns (o [B, T, Hv, Dv] fp32, ssm)."""
    b, t, _ = mixed.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def prepare(y):
        q, k, v = split_tiled(y, qkv_sections(cfg), kernels.section_tiles)
        q = l2_normalize(q.reshape(b, t, hk, dk)) * dk ** -0.5
        k = l2_normalize(k.reshape(b, t, hk, dk))
        beta = jax.nn.sigmoid(b_gate.astype(jnp.float32))
        g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a_gate.astype(jnp.float32)
                                                                       + p["dt_bias"].astype(jnp.float32))
        return q, k, v.reshape(b, t, hv, dv), g, beta
    o, _, ssm = mix(mixed, ssm, batch, p["conv"], prepare, kernels)
    return o, ssm


def gdn_layer(p, x, ssm, segments, cfg, kernels: Kernels = XLA, slot=None):
    """p: the input projections — grouped per key head (Qwen3-Next): qkvz [H, Hk*(2Dk+2rDv)],
    ba [H, Hk*2r]; or separate (Qwen3.5): qkv [H, 2HkDk+HvDv] (all q | all k | all v heads),
    z [H, HvDv], b, a [H, Hv] — then conv [C, K], A_log [Hv], dt_bias [Hv], norm [Dv],
    out [Hv*Dv, H]. ssm = (h [S, R, Hv, Dk, Dv] fp32, conv [S, R, C, K]).
    x [N, H] flat over the segments -> ([N, H], ssm)."""
    n = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    if kernels.gdn_fused(x.dtype, *(s.dtype for s in ssm)):
        return _cpu_layer(p, x, ssm, segments, cfg, slot)
    if cfg.gdn_grouped:
        qkvz = project(x, p, "qkvz", slot).reshape(n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        ba = project(x, p, "ba", slot).reshape(n, hk, 2 * r)
        b_gate, a_gate = ba[..., :r].reshape(n, hv), ba[..., r:].reshape(n, hv)
        tiles = kernels.section_tiles                # q | k | v in the conv's (tiled) channel order
        mixed = jnp.concatenate([a.reshape(n, tiles, -1) for a in (q, k, v)], axis=-1).reshape(n, -1)
    else:
        mixed, z, b_gate, a_gate = (project(x, p, name, slot) for name in ("qkv", "z", "b", "a"))
    outs = []
    for seg, m_s, a_s, b_s in zip(segments, *(split_segments(a, segments) for a in (mixed, a_gate, b_gate))):
        o, ssm = gdn_mix(m_s, a_s, b_s, ssm, seg, p, cfg, kernels)
        outs.append(o)
    o = join_segments(outs)                                          # [N, Hv, Dv]
    o = rms_norm_gated(o.astype(x.dtype), z.reshape(n, hv, dv), p["norm"], cfg.rms_norm_eps)
    return project(o.reshape(n, hv * dv), p, "out", slot), ssm


def _cpu_layer(p, x, ssm, segments, cfg, slot):
    """gdn_layer through cpu_kernels.gdn_layer: conv, gates, recurrence and gated norm in one call per segment
    on the projections' outputs as they are (no split / concat / gather / scatter ops in the step)."""
    grouped = cfg.gdn_grouped
    if grouped:
        src = z = project(x, p, "qkvz", slot)
        b_gate = a_gate = project(x, p, "ba", slot)
    else:
        src, z, b_gate, a_gate = (project(x, p, name, slot) for name in ("qkv", "z", "b", "a"))
    h_pool, conv_pool = ssm
    outs = []
    for seg, *inputs in zip(segments, *(split_segments(a, segments) for a in (src, z, b_gate, a_gate))):
        y, h_pool, conv_pool = cpu_kernels.gdn_layer(*inputs, p["conv"], p["A_log"], p["dt_bias"], p["norm"], h_pool,
                                                     conv_pool, seg.slot, seg.state_idx, seg.q_len, seg.start == 0,
                                                     grouped, cfg.rms_norm_eps)
        outs.append(y)
    return project(join_segments(outs), p, "out", slot), (h_pool, conv_pool)
