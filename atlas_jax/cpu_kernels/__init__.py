"""CPU kernels as XLA FFI custom calls, built from C++ source with the system compiler on first use.

The library is compiled once per (source, jaxlib headers, compiler, CPU) with `-O3 -march=native` into
$ATLAS_JAX_HOME/cpu_kernels (default ~/.cache/atlas_jax) and registered with XLA for the CPU platform.
Without a C++ compiler (or with ATLAS_JAX_CPU_KERNELS=0) `available()` is False and the layers keep
their pure-XLA paths; the kernels are an optimisation, never a requirement.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

_SOURCES = ("moe_experts.cc", "moe_route.cc", "gdn_recurrent.cc", "gdn_layer.cc", "linear.cc", "paged_attention.cc",
            "rms_norm.cc")
_HEADERS = ("common.h", "tiles.h", "gdn_step.h")
_TARGETS = {"atlas_moe_experts": "AtlasMoeExperts",       # FFI target name -> exported handler symbol
            "atlas_moe_route": "AtlasMoeRoute", "atlas_rms_norm": "AtlasRmsNorm", "atlas_add_rms_norm": "AtlasAddRmsNorm",
            "atlas_gdn_recurrent": "AtlasGdnRecurrent", "atlas_gdn_layer": "AtlasGdnLayer",
            "atlas_linear": "AtlasLinear",
            "atlas_paged_attention": "AtlasPagedAttention"}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
_lock = threading.Lock()
_state: dict = {}                                         # "ok": bool, "error": str


def _cache_dir() -> str:
    home = os.environ.get("ATLAS_JAX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "atlas_jax")
    return os.path.join(home, "cpu_kernels")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str) -> str:
    here = os.path.dirname(__file__)
    sources = [os.path.join(here, s) for s in _SOURCES]
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for path in sources + [os.path.join(here, h) for h in _HEADERS]:
        with open(path, "rb") as f:
            key.update(f.read())
    key.update(jax.__version__.encode())
    key.update(include.encode())
    key.update(" ".join((compiler, *_FLAGS)).encode())
    key.update(_cpu_id().encode())
    out = os.path.join(_cache_dir(), f"atlas_cpu_kernels_{key.hexdigest()[:16]}.so")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    cmd = [compiler, *_FLAGS, "-I", include, *sources, "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
    os.replace(tmp, out)          # atomic: concurrent builders never load a half-written library
    return out


def available() -> bool:
    """True when the kernels are built and registered (builds them on the first call)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = False
            if os.environ.get("ATLAS_JAX_CPU_KERNELS", "1") in ("0", "false"):
                _state["error"] = "disabled by ATLAS_JAX_CPU_KERNELS=0"
                return False
            compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
            if compiler is None:
                _state["error"] = "no C++ compiler found (set CXX)"
                log.warning("atlas_jax CPU kernels off: %s", _state["error"])
                return False
            try:
                lib = ctypes.cdll.LoadLibrary(_build(compiler))
                for target, symbol in _TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _state["strips"] = (lib.atlas_up_strip(), lib.atlas_dn_strip())
                _state["ok"] = True
            except (RuntimeError, OSError, AttributeError) as e:
                _state["error"] = str(e)
                log.warning("atlas_jax CPU kernels off: %s", e)
        return _state["ok"]


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")


# ---- the custom calls (call `available()` first; shapes are checked again in C++) ----

MOE_PANEL_UP, MOE_PANEL_DN = 32, 64          # tiles.h's panel widths
LINEAR_PANEL = MOE_PANEL_DN


def strips() -> tuple[int, int]:
    """(UP_SUB, DN_SUB): the strip widths the built library's packed panels are stored in (tiles.h: 8 and 16
    columns with AVX2, 32 and 64 = whole panels with AVX-512). Call `available()` first."""
    return _state["strips"]


def strip_panels(w, panel: int, sub: int):
    """w [..., K, N] (N a multiple of `panel`) -> [..., N / panel, panel / sub, K, sub]: panels of `panel`
    output columns, each stored as strips of `sub` columns (the layout every packed weight of the kernels uses)."""
    *lead, k, n = w.shape
    w = w.reshape(*lead, k, n // panel, panel // sub, sub)
    d = len(lead)
    return w.transpose(*range(d), d + 1, d + 2, d, d + 3)


def linear(x, panels, n: int):
    """x [M, K] fp32 @ a weight [K, n] packed as panels [ceil(n / 64), 64 / DN_SUB, K, DN_SUB] (layers/linear.
    pack_linear) -> [M, n] fp32."""
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call("atlas_linear", out)(x, panels)


def moe_experts(x, token, weight, sizes, gate_up, down):
    """Routed experts over packed panels (layers/moe.pack_experts). x [N, H] fp32; token [P] int32 = the
    source row of each pair, sorted by expert; weight [P] fp32; sizes [E] int32 = pairs per expert.
    Returns y [N, H] fp32 = sum over each token's pairs of weight * expert(x)."""
    n, h = x.shape
    pairs = token.shape[0]
    f_padded = gate_up.shape[1] * MOE_PANEL_UP
    out = (jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((pairs, f_padded), jnp.float32))
    y, _ = jax.ffi.ffi_call("atlas_moe_experts", out)(x, token, weight, sizes, gate_up, down)
    return y


def moe_route(logits, top_k: int, renormalise: bool):
    """Softmax top-k routing (moe_route.cc; reference: layers/moe.route + the stable sort of the pairs):
    logits [N, E] fp32 -> (token [N * k] int32: the source row of each pair, sorted by expert; weight [N * k]
    fp32; sizes [E] int32), the arguments of `moe_experts`."""
    n, e = logits.shape
    out = (jax.ShapeDtypeStruct((n * top_k,), jnp.int32), jax.ShapeDtypeStruct((n * top_k,), jnp.float32),
           jax.ShapeDtypeStruct((e,), jnp.int32))
    return jax.ffi.ffi_call("atlas_moe_route", out)(logits.astype(jnp.float32), top_k=np.int64(top_k),
                                                    renormalise=bool(renormalise))


def rms_norm(x, w, eps: float, zero_centred: bool):
    """layers/norms.rms_norm on fp32 x [..., D] as one call (rms_norm.cc)."""
    flat = x.reshape(-1, x.shape[-1])
    y = jax.ffi.ffi_call("atlas_rms_norm", jax.ShapeDtypeStruct(flat.shape, jnp.float32))(
        flat, w, eps=np.float32(eps), zero_centred=bool(zero_centred))
    return y.reshape(x.shape)


def add_rms_norm(x, h, w, eps: float, zero_centred: bool):
    """(x + h, rms_norm(x + h)) on fp32 [..., D] as one call (rms_norm.cc)."""
    flat = lambda a: a.reshape(-1, x.shape[-1])
    out = (jax.ShapeDtypeStruct(flat(x).shape, jnp.float32),) * 2
    r, y = jax.ffi.ffi_call("atlas_add_rms_norm", out)(flat(x), flat(h), w, eps=np.float32(eps),
                                                       zero_centred=bool(zero_centred))
    return r.reshape(x.shape), y.reshape(x.shape)


def gdn_recurrent(q, k, v, g, beta, h_pool, slot, read_idx, q_len, fresh, delta_rule: bool = True):
    """pallas_kernels.gdn.gdn_recurrent's contract on the CPU, the pool updated in place (aliased):
    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv] (fp32); h_pool [S, R, Hv, Dk, Dv] fp32;
    slot, read_idx, q_len [B] int32; fresh [B] bool. Returns (o [B, T, Hv, Dv] fp32, h_pool)."""
    f32 = lambda a: a.astype(jnp.float32)
    i32 = lambda a: a.astype(jnp.int32)
    b, t = q.shape[:2]
    out = (jax.ShapeDtypeStruct((b, t) + v.shape[2:], jnp.float32), jax.ShapeDtypeStruct(h_pool.shape, h_pool.dtype))
    return jax.ffi.ffi_call("atlas_gdn_recurrent", out, input_output_aliases={5: 1})(
        f32(q), f32(k), f32(v), f32(g), f32(beta), h_pool, i32(slot), i32(read_idx), i32(q_len), i32(fresh),
        delta_rule=delta_rule)


def gdn_layer(src, z, b, a, conv_w, a_log, dt_bias, norm_w, h_pool, conv_pool, slot, read_idx, q_len, fresh,
              grouped: bool, eps: float):
    """A GDN layer's sequence-local part (gdn_layer.cc; reference: layers/gdn.gdn_layer on XLA): the input
    projections' outputs src [B, T, W], z [B, T, Wz], b, a [B, T, Wg] (grouped per key head as qkvz / ba, src = z
    and b = a; or flat as qkv / z / b / a) -> y [B, T, Hv * Dv] = rmsnorm(o) * norm_w * silu(z), the out
    projection's input; h_pool [S, R, Hv, Dk, Dv] and conv_pool [S, R, C, K] (fp32) updated in place.
    Returns (y, h_pool, conv_pool)."""
    i32 = lambda x: x.astype(jnp.int32)
    bsz, t = src.shape[:2]
    hv, dv = h_pool.shape[2], h_pool.shape[4]
    out = (jax.ShapeDtypeStruct((bsz, t, hv * dv), jnp.float32), jax.ShapeDtypeStruct(h_pool.shape, jnp.float32),
           jax.ShapeDtypeStruct(conv_pool.shape, jnp.float32))
    f32 = lambda x: x.astype(jnp.float32)
    return jax.ffi.ffi_call("atlas_gdn_layer", out, input_output_aliases={8: 1, 9: 2})(
        *(f32(x) for x in (src, z, b, a, conv_w, a_log, dt_bias, norm_w)), h_pool, conv_pool, i32(slot),
        i32(read_idx), i32(q_len), i32(fresh), grouped=grouped, eps=np.float32(eps))


def paged_attention(q, k_pages, v_pages, block_table, start, q_len, scale: float):
    """layers/attention.paged_attention (no soft-cap, no window) reading K / V in place from the pages:
    q [B, T, H, D]; k_pages, v_pages [P, S, Hkv, D] fp32; block_table [B, MP]; start, q_len [B].
    Returns o [B, T, H, D] fp32 (zeros for t >= q_len)."""
    i32 = lambda a: a.astype(jnp.int32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("atlas_paged_attention", out)(
        q.astype(jnp.float32), k_pages, v_pages, i32(block_table), i32(start), i32(q_len), scale=np.float32(scale))
