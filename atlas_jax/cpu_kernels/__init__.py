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

log = logging.getLogger(__name__)

_SOURCES = ("moe_experts.cc",)
_TARGETS = {"atlas_moe_experts": "AtlasMoeExperts"}      # FFI target name -> exported handler symbol
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
    for path in sources:
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
                _state["ok"] = True
            except (RuntimeError, OSError, AttributeError) as e:
                _state["error"] = str(e)
                log.warning("atlas_jax CPU kernels off: %s", e)
        return _state["ok"]


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")
