"""atlas_jax: a JAX/XLA inference engine for hybrid LLMs (attention + Gated DeltaNet + MoE).

The public names load on first use (PEP 562), so host-only modules (the scheduler, the frontend, the
server's protocol) import without jax."""
from . import host_memory  # noqa: F401  (first: glibc settings before any XLA thread allocates)

_EXPORTS = {"LLM": "engine.llm", "LoRARequest": "engine.client", "SamplingParams": "engine.sampling_params",
            "RequestOutput": "engine.outputs", "CompletionOutput": "engine.outputs", "ModelConfig": "config",
            "ConfigError": "config"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'atlas_jax' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
