"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) -> per-projection (A, B).

An adapter's `base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] attach
to the base checkpoint's linear tensor `<module>.weight`; the family's ParamSpecs say which param
that is, so every family's dense projections are adaptable without a table per family: attention
q/k/v/o, dense MLP / shared-expert gate/up/down, GDN's input and output projections, Mamba2's
in/out projections. Routed experts, routers, embeddings and lm_head are refused by name.
Returned arrays are in the engine's [in, out] orientation, B already multiplied by the adapter's
scale (lora_alpha / r, or / sqrt(r) with rslora), ranks zero-padded to `max_rank`.

Everything is validated before an adapter is accepted, so a served adapter can never fail on the
device: the file's size against the largest adapter this model and max_rank allow (refused unread),
every tensor's shape against its base projection's (in, out) and the rank (from the header, before
the tensors are decoded), floating dtype, finite values, known target modules. Any unreadable file
(truncated, bad header, missing) is a LoRAError. The files are read once: the adapter's sha256
digest is of the bytes that were validated.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import numpy as np
import safetensors.numpy

from ..config import ModelConfig
from ..errors import LoRAError
from ..models import family

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
MAX_CONFIG_BYTES = 1 << 20             # adapter_config.json larger than this is refused unread
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int                         # the adapter's own r (<= the engine's max rank)
    scale: float                      # lora_alpha / r (or / sqrt(r)); rank_pattern / alpha_pattern modules differ
    weights: dict                     # param key -> (A [in, R], B [R, out] * scale), float32, R = max rank
    digest: str = ""                  # sha256 of its two files: a reload serves the same adapter or nothing


def adaptable(cfg: ModelConfig) -> dict[str, str]:
    """HF module name -> param key (the param's path joined by dots, e.g. 'layers.3.attn.q_proj'), for
    every projection a LoRA adapter may target."""
    return {module: key for module, (key, _) in adaptable_shapes(cfg).items()}


def adaptable_shapes(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """HF module name -> (param key, (in, out)) of every projection a LoRA adapter may target."""
    out = {}
    for spec in family(cfg.model_type).param_specs(cfg):
        name = spec.hf_names[0]
        if spec.role == "proj":
            n_out, n_in = spec.hf_shape
            module = name[:-len(".weight")]
            out[module] = (".".join(map(str, spec.path)), (n_in, n_out))
            if module.startswith("backbone."):   # transformers 5 names NemotronH's modules model.* (its files:
                out["model." + module[len("backbone."):]] = out[module]    # backbone.*): peft saves those names
    return out


def _config(path: str) -> tuple[dict, bytes]:
    """adapter_config.json, checked, and its bytes (part of the adapter's digest)."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"no adapter_config.json in {path}")
    if os.path.getsize(cfg_path) > MAX_CONFIG_BYTES:
        raise LoRAError(f"adapter_config.json in {path} is over {MAX_CONFIG_BYTES} bytes")
    with open(cfg_path, "rb") as f:
        data = f.read()
    try:
        raw = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"adapter_config.json in {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"adapter_config.json in {path} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {raw.get('peft_type')!r} is not supported (only LORA)")
    for key, ok in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if raw.get(key, ok) not in (ok, [], False if ok is False else ok):
            raise LoRAError(f"adapter_config.json: {key}={raw[key]!r} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(raw.get(key), (int, float)) or raw[key] <= 0:
            raise LoRAError(f"adapter_config.json: {key} must be a positive number, got {raw.get(key)!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(raw.get(key) or {}, dict):
            raise LoRAError(f"adapter_config.json: {key} must be an object")
    return raw, data


def _per_module(pattern: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the first key matching the module name's tail wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_peft_adapter(path: str, cfg: ModelConfig, max_rank: int, name: str | None = None) -> LoRAAdapter:
    """The adapter at `path`, validated completely (module docstring); LoRAError names what is wrong."""
    try:
        return _load(path, cfg, max_rank, name)
    except LoRAError:
        raise
    except Exception as e:                      # noqa: BLE001 — unreadable files: safetensors, OS, numpy errors
        raise LoRAError(f"adapter {path} cannot be read: {type(e).__name__}: {str(e)[:300]}") from None


def _load(path: str, cfg: ModelConfig, max_rank: int, name: str | None) -> LoRAAdapter:
    raw, config_bytes = _config(path)
    r = int(raw["r"])
    scale = raw["lora_alpha"] / (math.sqrt(r) if raw.get("use_rslora") else r)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoRAError(f"no adapter_model.safetensors in {path}")
    targets = adaptable_shapes(cfg)
    bound = MAX_CONFIG_BYTES + 8 * max_rank * sum(n_in + n_out for _, (n_in, n_out) in targets.values())
    if os.path.getsize(file) > bound:                      # refused unread
        raise LoRAError(f"adapter_model.safetensors is {os.path.getsize(file)} bytes; an adapter of rank <= "
                        f"{max_rank} for this model has at most {bound}")
    with open(file, "rb") as f:
        data = f.read()                                    # validated, hashed and loaded from these bytes
    header = _header(data)
    modules: dict[str, dict] = {}
    for key in header:
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"unexpected tensor {key!r} in {file}")
        modules.setdefault(m["module"], {})[m["ab"]] = key
    ranks = {}
    for module, keys in sorted(modules.items()):
        if module not in targets:
            raise LoRAError(f"adapter targets {module!r}, which this engine cannot adapt "
                            "(routed experts, routers, embeddings and lm_head are not supported)")
        if set(keys) != {"A", "B"}:
            raise LoRAError(f"adapter module {module!r} lacks lora_{'B' if 'A' in keys else 'A'}")
        _, (n_in, n_out) = targets[module]
        rank = ranks[module] = int(_per_module(raw.get("rank_pattern") or {}, module, r))
        if rank > max_rank:
            raise LoRAError(f"adapter rank {rank} ({module!r}) exceeds max_lora_rank {max_rank}")
        for ab, want in (("A", (rank, n_in)), ("B", (n_out, rank))):
            shape, dtype = tuple(header[keys[ab]].get("shape", ())), header[keys[ab]].get("dtype")
            if shape != want:
                raise LoRAError(f"adapter module {module!r}: lora_{ab} has shape {list(shape)}, this model "
                                f"needs {list(want)} (rank {rank}, base projection in {n_in}, out {n_out})")
            if dtype not in _FLOAT_DTYPES:
                raise LoRAError(f"adapter module {module!r}: lora_{ab} has dtype {dtype}; floating point needed")
    tensors = safetensors.numpy.load(data)
    weights = {}
    for module, keys in sorted(modules.items()):
        rank = ranks[module]
        a, b = (tensors[keys[ab]].astype(np.float32) for ab in "AB")
        for ab, t in (("A", a), ("B", b)):
            if not np.isfinite(t).all():
                raise LoRAError(f"adapter module {module!r}: lora_{ab} holds NaN or infinite values")
        alpha = _per_module(raw.get("alpha_pattern") or {}, module, raw["lora_alpha"])
        module_scale = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
        b_scaled = b.T * np.float32(module_scale)
        if not np.isfinite(b_scaled).all():
            raise LoRAError(f"adapter module {module!r}: lora_B times the scale {module_scale} overflows")
        pad = max_rank - rank
        weights[targets[module][0]] = (np.pad(a.T, ((0, 0), (0, pad))), np.pad(b_scaled, ((0, pad), (0, 0))))
    if not weights:
        raise LoRAError(f"adapter {path} has no LoRA tensors")
    digest = hashlib.sha256(hashlib.sha256(config_bytes).digest() + hashlib.sha256(data).digest()).hexdigest()
    return LoRAAdapter(name or os.path.basename(os.path.normpath(path)), r, float(scale), weights, digest)


def _header(data: bytes) -> dict:
    """A safetensors file's header (8-byte little-endian length, then JSON): tensor name -> dtype, shape."""
    if len(data) < 8:
        raise LoRAError("adapter_model.safetensors is not a safetensors file (under 8 bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, MAX_CONFIG_BYTES):
        raise LoRAError("adapter_model.safetensors has a bad header length (truncated or not safetensors)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoRAError("adapter_model.safetensors has a header that is not JSON") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for k, v in header.items() if k != "__metadata__"):
        raise LoRAError("adapter_model.safetensors has a malformed header")
    header.pop("__metadata__", None)
    return header
