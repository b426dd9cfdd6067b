"""Model families. Each family module exposes MODEL_TYPES and `param_specs(cfg, mtp_layers)`;
the forward pass is shared (decoder.py) and driven by the config's layer pattern."""
from . import nemotron_h, qwen3, qwen3_next

_FAMILIES = {t: m for m in (qwen3, qwen3_next, nemotron_h) for t in m.MODEL_TYPES}


def family(model_type: str):
    if model_type not in _FAMILIES:
        raise ValueError(f"no model family for model_type {model_type!r}; known: {sorted(_FAMILIES)}")
    return _FAMILIES[model_type]
