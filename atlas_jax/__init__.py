"""atlas_jax: a JAX/XLA inference engine for hybrid LLMs (attention + Gated DeltaNet + MoE)."""
from . import host_memory  # noqa: F401  (first: glibc settings before any XLA thread allocates)
from .config import ConfigError, ModelConfig
from .engine.llm import LLM
from .engine.lora import LoRARequest
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "ModelConfig", "ConfigError"]
