"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) -> per-projection (A, B).

An adapter's `base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] attach
to the base checkpoint's linear tensor `<module>.weight`; the family's ParamSpecs say which param
that is, so every family's dense projections are adaptable without a table per family: attention
q/k/v/o, dense MLP / shared-expert gate/up/down, GDN's input and output projections, Mamba2's
in/out projections. Routed experts, routers, embeddings and lm_head are refused by name.
Returned arrays are in the engine's [in, out] orientation, B already multiplied by the adapter's
scale (lora_alpha / r, or / sqrt(r) with rslora), ranks zero-padded to `max_rank`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
from safetensors import safe_open

from ..config import ModelConfig
from ..models import family

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter the engine cannot serve; the message names the module or field."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int                         # the adapter's own r (<= the engine's max rank)
    scale: float                      # lora_alpha / r (or / sqrt(r)); rank_pattern / alpha_pattern modules differ
    weights: dict                     # param key -> (A [in, R], B [R, out] * scale), float32, R = max rank


def adaptable(cfg: ModelConfig) -> dict[str, str]:
    """HF module name -> param key (the param's path joined by dots, e.g. 'layers.3.attn.q_proj'), for
    every projection a LoRA adapter may target."""
    out = {}
    for spec in family(cfg.model_type).param_specs(cfg):
        name = spec.hf_names[0]
        if spec.kind == "linear" and len(spec.hf_names) == 1 and name.endswith(".weight") \
                and spec.path[-1] not in ("router", "lm_head"):
            out[name[:-len(".weight")]] = ".".join(map(str, spec.path))
    return out


def _config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.exists(cfg_path):
        raise LoRAError(f"no adapter_config.json in {path}")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise LoRAError(f"adapter_config.json in {path} is not valid JSON: {e}") from None
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
    return raw


def _per_module(pattern: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: the first key matching the module name's tail wins."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_peft_adapter(path: str, cfg: ModelConfig, max_rank: int, name: str | None = None) -> LoRAAdapter:
    raw = _config(path)
    r = int(raw["r"])
    scale = raw["lora_alpha"] / (math.sqrt(r) if raw.get("use_rslora") else r)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise LoRAError(f"no adapter_model.safetensors in {path}")
    targets = adaptable(cfg)
    pairs: dict[str, dict] = {}
    with safe_open(file, framework="np") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None:
                raise LoRAError(f"unexpected tensor {key!r} in {file}")
            pairs.setdefault(m["module"], {})[m["ab"]] = f.get_tensor(key).astype(np.float32)
    weights = {}
    for module, ab in sorted(pairs.items()):
        if module not in targets:
            raise LoRAError(f"adapter targets {module!r}, which this engine cannot adapt "
                            "(routed experts, routers, embeddings and lm_head are not supported)")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter module {module!r} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        rank = int(_per_module(raw.get("rank_pattern") or {}, module, r))
        alpha = _per_module(raw.get("alpha_pattern") or {}, module, raw["lora_alpha"])
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"adapter module {module!r} has rank {a.shape[0]}, the config says {rank}")
        if rank > max_rank:
            raise LoRAError(f"adapter rank {rank} ({module!r}) exceeds max_lora_rank {max_rank}")
        module_scale = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
        pad = max_rank - rank
        weights[targets[module]] = (np.pad(a.T, ((0, 0), (0, pad))), np.pad(b.T * module_scale, ((0, pad), (0, 0))))
    if not weights:
        raise LoRAError(f"adapter {path} has no LoRA tensors")
    return LoRAAdapter(name or os.path.basename(os.path.normpath(path)), r, float(scale), weights)
