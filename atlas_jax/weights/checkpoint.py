"""Save / restore converted params with orbax-checkpoint (a fast-start cache of a converted
checkpoint; `scripts/convert.py` writes it beside config.json as `params.orbax/`)."""
from __future__ import annotations

import json
import os

import orbax.checkpoint as ocp

from ..config import ModelConfig
from ..models import family
from ..models.layout import abstract_params

ORBAX_DIR = "params.orbax"


def _to_tree(params):
    """Orbax restores lists as dicts keyed '0','1',..; store lists as such explicitly."""
    if isinstance(params, list):
        return {str(i): _to_tree(v) for i, v in enumerate(params)}
    if isinstance(params, dict):
        return {k: _to_tree(v) for k, v in params.items()}
    return params


def _from_tree(tree, like):
    if isinstance(like, list):
        return [_from_tree(tree[str(i)], v) for i, v in enumerate(like)]
    if isinstance(like, dict):
        return {k: _from_tree(tree[k], v) for k, v in like.items()}
    return tree


def has_orbax(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, ORBAX_DIR + ".json"))


def save_params(directory: str, params, mtp_layers: int) -> str:
    path = os.path.abspath(os.path.join(directory, ORBAX_DIR))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _to_tree(params), force=True)
    with open(path + ".json", "w") as f:
        json.dump({"mtp_layers": mtp_layers}, f)
    return path


def restore_params(directory: str, cfg: ModelConfig, dtype):
    """Returns (params, mtp_layers) restored (and cast) to `dtype`."""
    with open(os.path.join(directory, ORBAX_DIR + ".json")) as f:
        mtp_layers = json.load(f)["mtp_layers"]
    like = abstract_params(family(cfg.model_type).param_specs(cfg, mtp_layers), dtype)
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(os.path.abspath(os.path.join(directory, ORBAX_DIR)), _to_tree(like))
    return _from_tree(tree, like), mtp_layers
