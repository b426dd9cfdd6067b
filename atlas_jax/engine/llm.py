"""LLM: the offline, vLLM-shaped API over the continuous-batching engine.

    llm = LLM("path/to/hf_checkpoint")            # or LLM() for the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

`generate` queues every prompt on the EngineCore and steps it until all are done; requests
join and leave the running batch independently (core.py, scheduler.py).
"""
from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..kernels import resolve_kernels
from ..frontend.tokenizer import Tokenizer
from ..parallel import multihost
from ..parallel.sharding import make_mesh, model_rules, param_shardings
from ..weights import load_model_params
from .args import EngineArgs
from .compile_cache import default_compile_cache_dir, enable_compile_cache  # noqa: F401 (re-exported)
from .core import EngineCore
from .lora import LoRARequest
from .sampling_params import SamplingParams
from .engine_config import EngineConfig, check_layout
from .speculative import load_token_map

log = logging.getLogger("atlas_jax.engine")

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32,
           "float16": jnp.float16, "fp16": jnp.float16}


def resolve_dtype(dtype) -> jnp.dtype:
    """'auto' = bfloat16 on an accelerator, float32 on CPU (XLA:CPU bf16 matmuls are ~12x slower)."""
    if dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


class LLM:
    """model: HF checkpoint dir (None = embedded default); the other keywords are EngineArgs' fields
    (engine/args.py: vLLM's names and their meaning). warmup=True compiles every step bucket up
    front (progress: a progress bar). speculative={"method": "mtp" | "ngram" | "self" | "scripted",
    "num_drafts": k, ...} turns on speculative decoding; `spec_stats()` reports acceptance."""

    def __init__(self, model: str | None = None, *, warmup: bool = True, progress: bool = True, **engine_args):
        self.args = a = EngineArgs(model=model, **engine_args)
        self.dist = multihost.Distributed.from_args(a)
        multihost.initialize(self.dist)            # first: jax.distributed must join before any backend starts
        # the CPU custom calls and Pallas kernels are not partitioned: a split model runs the pure-XLA layers
        split = a.tensor_parallel_size != 1 or a.data_parallel_size != 1
        self.kernels = resolve_kernels("xla" if split and a.kernels == "auto" else a.kernels)
        enable_compile_cache(default_compile_cache_dir() if a.compile_cache_dir is None else a.compile_cache_dir)
        if model is None:
            from ..default_model import default_model_path
            model = default_model_path()
        self.model_path = os.fspath(model)
        self._chat_template = None
        self.cfg = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(a.dtype)
        placement = None
        tp, dp = a.tensor_parallel_size, a.data_parallel_size
        if type(tp) is int and type(dp) is int and tp > 0 and dp > 0 and tp * dp > 1:
            # shards read alone (EngineConfig checks the values)
            check_layout(a, self.cfg, self.dist)
            mesh = make_mesh(tp, dp)
            rules = model_rules(self.cfg, tp, bool(a.enable_expert_parallel), dp)
            placement = lambda specs: param_shardings(specs, mesh, rules)
        params, self.num_mtp_layers = load_model_params(self.model_path, self.cfg, self.dtype, a.load_mtp, placement)
        self.config = EngineConfig.create(a, self.cfg, self.dtype, self.kernels, self.num_mtp_layers)
        self.max_model_len = self.config.max_model_len
        self.kernels = self.config.kernels
        log.info("op table: %s", self.kernels.describe(self.cfg, self.dtype, a.page_size))
        self.engine = EngineCore(self.config, params, self.tokenizer,
                                 load_token_map(self.config.speculative, self.model_path, self.cfg.vocab_size))
        self.runner = self.engine.runner
        self.params = self.runner.params        # as the steps use them (packed for the CPU kernels)
        self.num_warmup_compiles = self.engine.warmup(progress) if warmup else 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kw) -> "LLM":
        return cls(args.model, **args.engine_kwargs(), **kw)

    @property
    def num_compiles(self) -> int:
        return self.engine.num_compiles

    # ---- multi-host (nnodes > 1: parallel/multihost.py) ---------------------------------------
    def follow(self) -> int:
        """On a rank other than 0: run rank 0's steps until its `close()`; returns the device calls run."""
        return self.runner.follow()

    def close(self) -> None:
        """On rank 0 of a multi-host engine: stop the followers (no-op otherwise)."""
        self.runner.close()

    def _check_schedules(self) -> None:
        if not self.dist.leader:
            raise RuntimeError(f"rank {self.dist.node_rank} follows rank 0's steps (LLM.follow()); "
                               f"requests go to rank 0")

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict | None:
        """Prefix cache counters (token hit rate, snapshots, evictions); None when caching is off."""
        return self.engine.prefix_cache_stats()

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (read from disk now; LoRAError when it cannot be served)."""
        self._lora_manager().register(lora_request)
        return True

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter; refused (LoRAError) while a request uses it."""
        self._lora_manager().unregister(name)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return self._lora_manager().names()

    def _lora_manager(self):
        if self.engine.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora=True)")
        return self.engine.lora

    def spec_stats(self) -> dict:
        """Speculative decoding counters: acceptance rate, mean accepted length, tokens per target step."""
        return self.engine.spec_stats.summary()

    blocks = property(lambda self: self.engine.blocks)
    slots = property(lambda self: self.engine.slots)
    num_pages = property(lambda self: self.engine.num_pages)
    page_size = property(lambda self: self.engine.blocks.page_size)
    max_num_seqs = property(lambda self: self.engine.sched_config.max_num_seqs)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None):
        """prompts: a str / token-id list, or a list of them. Returns one RequestOutput per prompt, in
        order. lora_request: one LoRARequest for every prompt, or a list with one per prompt (None = the
        base model); needs enable_lora=True. A bad request raises ValueError and runs nothing."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        if not isinstance(lora_request, (list, tuple)):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)} LoRA requests for {len(prompts)} prompts")
        self._check_schedules()
        reqs = []
        try:
            for p, sp, lr in zip(prompts, sampling_params, lora_request):
                reqs.append(self.engine.add_request(p, sp, lora_request=lr))
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [r.output() for r in reqs]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             tools: list[dict] | None = None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False):
        """vLLM's LLM.chat: one conversation (a list of {"role", "content", ...} messages) or a list of
        them, rendered with the checkpoint's chat template as transformers renders it (chat_template:
        a file or template text to use instead), then generated. sampling_params default: max_tokens
        None (the rest of the context). Returns one RequestOutput per conversation."""
        from ..frontend.chat import ChatTemplate
        if self._chat_template is None or chat_template is not None:
            self._chat_template = ChatTemplate.for_model(self.model_path, chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_template.render(list(c), add_generation_prompt and not continue_final_message,
                                              tools=tools, continue_final_message=continue_final_message,
                                              **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params or SamplingParams(max_tokens=None))

    # ---- scoring ----------------------------------------------------------------------------
    def prompt_logits(self, prompt, chunk: int | None = None) -> np.ndarray:
        """fp32 logits [len(prompt), V] of every prompt position, computed through the paged
        cache in chunks of `chunk` tokens (default: max_prefill_chunk). Needs an idle engine."""
        self._check_schedules()
        _, ids = self.engine.inputs.encode(prompt)
        chunk = chunk or self.engine.sched_config.max_prefill_chunk
        blocks, slots = self.engine.blocks, self.engine.slots
        pages = blocks.allocate(blocks.pages_for(len(ids)))
        slot = slots.allocate(1)
        try:
            if pages is None or slot is None:
                raise RuntimeError("no free pages / slot for scoring")
            return self.runner.scoring.chunked_logits(ids, pages, slot[0], chunk)
        finally:
            if pages:
                blocks.free(pages)
            if slot:
                slots.free(slot)
