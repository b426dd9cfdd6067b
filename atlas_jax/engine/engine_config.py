"""EngineConfig: EngineArgs resolved once into frozen sub-configs (vLLM's VllmConfig pattern). Every default
that depends on the model or the machine (max_model_len, the KV pool, max_num_seqs, snapshot slots, the
prefill token budget) is decided here, and every knob is validated here, before anything is allocated;
EngineCore, ModelRunner and the Scheduler read the result and decide nothing themselves."""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..kernels import Kernels
from ..models import family
from ..parallel.multihost import Distributed, check_agree, min_over_processes
from ..parallel.sharding import check_devices, check_divides, make_mesh, section_tiles, uses_expert_parallel
from ..state.cache import snapshot_slots
from .args import EngineArgs
from .scheduler import SchedulerConfig, default_watermark
from .sizing import default_max_num_seqs, free_memory_bytes, pages_for_memory
from .speculative import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int
    num_pages: int                   # serving KV pages (the scratch pages of prompt scoring come on top)
    max_pages_per_seq: int
    num_slots: int                   # recurrent-state / penalty slots = max_num_seqs (+1 for prompt scoring)
    num_snapshots: int               # prefix-cache snapshot slots (0: none)
    prefix_caching: bool
    prompt_logprobs: bool            # one scratch sequence (pages + slot) scores prompts

    @property
    def scratch_pages(self) -> int:
        return self.max_pages_per_seq if self.prompt_logprobs else 0


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    dtype: object                    # jnp dtype of weights and state
    kernels: Kernels
    max_model_len: int
    cache: CacheConfig
    scheduler: SchedulerConfig       # swap sizes filled in by EngineCore (they come from the state's shapes)
    speculative: SpeculativeConfig | None
    lora: LoRAConfig | None
    seed: int
    async_scheduling: bool = True    # (where it applies: EngineCore._overlaps)
    mtp_layers: int = 0              # the checkpoint's MTP layers as loaded (param_specs' count; 0: no head)
    tensor_parallel_size: int = 1    # devices of the ("tp",) mesh (parallel/sharding.py)
    data_parallel_size: int = 1      # ranks of the ("dp", "tp") mesh, each with its own batch: the cache and
                                     # scheduler sizes above are per rank (parallel/data_parallel.py)
    expert_parallel: bool = False    # routed experts split by expert over the mesh (kernels.expert_mesh is set)
    dist: Distributed = Distributed()    # the processes serving together (parallel/multihost.py; one by default)

    def param_specs(self):
        """The loaded params' typed description (models/layout.py ParamSpec per leaf)."""
        return family(self.model.model_type).param_specs(self.model, self.mtp_layers)

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def mtp_drafts(self) -> int:
        """Drafts the MTP head makes per step (0: not MTP)."""
        s = self.speculative
        return s.num_drafts if s is not None and s.method == "mtp" else 0

    @property
    def ngram_on_device(self) -> bool:
        """ngram drafts made by the device (device_ngram.py) so that verify steps overlap: where async scheduling
        applies (no prefix cache). Elsewhere the host's NgramProposer, whose unmatched rows decode plainly."""
        return self.scheduler.device_ngram

    @property
    def device_drafts(self) -> int:
        """Drafts the device leaves per row for its next verify (MTP, self, ngram on the device; 0: none)."""
        s = self.speculative
        return s.num_drafts if s is not None and (s.method in ("mtp", "self") or self.ngram_on_device) else 0

    @property
    def max_verify_tokens(self) -> int:
        return 1 + (self.speculative.num_drafts if self.speculative else 0)

    @classmethod
    def create(cls, args: EngineArgs, cfg: ModelConfig, dtype, kernels: Kernels, mtp_layers: int = 0) -> "EngineConfig":
        a = args
        for name in ("page_size", "max_num_seqs", "max_model_len", "max_prefill_chunk", "max_prefill_rows",
                     "max_num_batched_tokens", "num_pages", "tensor_parallel_size", "data_parallel_size"):
            v = getattr(a, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        tp, dp = a.tensor_parallel_size, a.data_parallel_size
        expert_parallel = uses_expert_parallel(cfg, tp, a.enable_expert_parallel, dp)
        dist = Distributed.from_args(a).check()
        check_layout(a, cfg, dist)
        if tp * dp > 1:
            if kernels.cpu or kernels.pallas:
                name = "data_parallel_size" if dp > 1 else "tensor_parallel_size"
                raise ValueError(f"{name} > 1 runs the pure-XLA layers: use kernels='xla' (or 'auto')")
        if expert_parallel:                          # the MoE layers split their dispatch over this mesh
            kernels = dataclasses.replace(kernels, expert_mesh=make_mesh(tp, dp), data_parallel=dp)
        if tp > 1:                                   # Mamba2's sectioned params tiled where they split whole
            kernels = dataclasses.replace(kernels, section_tiles=section_tiles(cfg, tp))
        spec = SpeculativeConfig.parse(a.speculative)
        max_model_len = a.max_model_len or min(cfg.max_position_embeddings, 4096)
        num_pages = a.num_pages
        if a.kv_cache_memory is not None:
            if num_pages is not None:
                raise ValueError("give num_pages or kv_cache_memory, not both")
            num_pages = pages_for_memory(cfg, dtype, a.page_size, a.kv_cache_memory)
        seqs = a.max_num_seqs or default_max_num_seqs(cfg, dtype, a.page_size, max_model_len, num_pages,
                                                      1 + (spec.num_drafts if spec else 0),
                                                      min_over_processes("free_memory", free_memory_bytes()))
        per_seq = -(-max_model_len // a.page_size)
        num_pages = num_pages or seqs * per_seq
        cache = CacheConfig(a.page_size, num_pages, per_seq, seqs + bool(a.enable_prompt_logprobs),
                            snapshot_slots(cfg, dtype, a.enable_prefix_caching, a.prefix_snapshot_bytes, seqs),
                            a.enable_prefix_caching, a.enable_prompt_logprobs)
        sched = SchedulerConfig(
            max_num_seqs=seqs, max_num_batched_tokens=a.max_num_batched_tokens or max(512, a.max_prefill_chunk),
            max_prefill_chunk=a.max_prefill_chunk, max_prefill_rows=a.max_prefill_rows,
            preemption_mode="recompute" if dist.multihost or dp > 1 else a.preemption_mode, swap_space_bytes=int(a.swap_space_gb * 2**30),
            watermark_pages=default_watermark(num_pages), num_drafts=spec.num_drafts if spec else 0,
            mtp_drafts=spec.num_drafts if spec is not None and spec.method == "mtp" else 0,
            max_model_len=max_model_len, device_ngram=spec is not None and spec.method == "ngram"
            and bool(a.async_scheduling) and not a.enable_prefix_caching)
        lora = LoRAConfig(a.max_loras, a.max_lora_rank, a.max_cpu_loras) if a.enable_lora else None
        config = cls(cfg, dtype, kernels, max_model_len, cache, sched, spec, lora, a.seed, bool(a.async_scheduling),
                     mtp_layers, tp, dp, expert_parallel, dist)
        check_agree("engine configuration", repr(dataclasses.replace(config, dist=Distributed())))
        return config


def check_layout(a: EngineArgs, cfg: ModelConfig, dist: Distributed) -> None:
    """ValueError naming the field when the parallel layout (tensor_parallel_size, data_parallel_size, expert
    parallel, nnodes) does not fit the model or the devices, or asks for what data parallel does not serve yet
    (each of those needs per-rank device operations). Run before loading (LLM) and again in `create`."""
    tp, dp = a.tensor_parallel_size, a.data_parallel_size
    dist.check_spans(tp * dp)
    refused = {"enable_lora": a.enable_lora,
               "enable_prompt_logprobs": a.enable_prompt_logprobs, "nnodes > 1": dist.multihost}
    for name, on in refused.items():
        if dp > 1 and on:
            raise ValueError(f"data_parallel_size > 1 does not support {name} yet")
    if tp * dp > 1:
        check_divides(cfg, tp, uses_expert_parallel(cfg, tp, a.enable_expert_parallel, dp), dp)
        check_devices(tp * dp, what="data_parallel_size x tensor_parallel_size" if dp > 1 else "tensor_parallel_size")
