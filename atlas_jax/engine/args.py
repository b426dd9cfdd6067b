"""EngineArgs: the one engine configuration (vLLM's pattern). `LLM`, `python -m atlas_jax.serve`,
`python -m atlas_jax.generate` and the scripts build from it; its CLI flags are generated from the
fields (name -> --name-with-dashes, help from the field's metadata), so a new knob is added once."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from ..kernels import KERNELS
from .scheduler import PREEMPTION_MODES


def _knob(default, help: str, *, choices=None, flag: str | None = None):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclasses.dataclass
class EngineArgs:
    model: str | None = _knob(None, "HF checkpoint directory (default: the shipped atlas-tiny model)")
    dtype: str = _knob("auto", "auto (bf16 on accelerators, fp32 on CPU), bfloat16, float32")
    kernels: str = _knob("auto", "attention / GDN / MoE implementation: auto (Pallas on GPU, C++ custom calls on CPU), xla, pallas",
                         choices=KERNELS)
    tensor_parallel_size: int = _knob(1, "devices the model is split over (heads, intermediate dims, vocabulary: "
                                      "parallel/sharding.py); > 1 runs the pure-XLA layers", flag="--tensor-parallel-size")
    enable_expert_parallel: bool = _knob(False, "split the routed experts by expert over the tensor-parallel devices "
                                         "(each runs its own experts on every token; the outputs are summed) instead "
                                         "of splitting each expert's intermediate dim")
    data_parallel_size: int = _knob(1, "independent batches, each with its own pages, slots and scheduler, over "
                                    "data_parallel_size x tensor_parallel_size devices; the routed experts are "
                                    "split over all of them (data-parallel attention, parallel/sharding.py)",
                                    flag="--data-parallel-size")
    nnodes: int = _knob(1, "processes (hosts) serving one model together; every rank runs the same steps, rank 0 "
                        "schedules and serves HTTP (parallel/multihost.py)")
    node_rank: int = _knob(0, "this process's rank among nnodes (0: the scheduler and HTTP server)")
    dist_init_addr: str | None = _knob(None, "HOST:PORT of rank 0's coordination service (jax.distributed), "
                                       "with nnodes > 1")
    dist_timeout: int = _knob(60, "seconds a rank may go silent before every rank is ended (nnodes > 1)")
    page_size: int = _knob(16, "tokens per KV page")
    num_pages: int | None = _knob(None, "KV pages in the pool (default: every slot can reach max-model-len)")
    kv_cache_memory: float | None = _knob(None, "KV pool size in GiB, instead of num-pages (default: num-pages' "
                                          "default)")
    max_num_seqs: int | None = _knob(None, "running sequences (= recurrent-state slots; default: as many as fit "
                                     "in half the free memory on CPU / 90% on accelerators, at most 32 / 256)")
    max_model_len: int | None = _knob(None, "prompt + output tokens per request (default: min(config, 4096))")
    max_prefill_chunk: int = _knob(256, "prompt tokens per sequence per step")
    max_num_batched_tokens: int | None = _knob(None, "prefill token budget per step (decode rows beside it)")
    max_prefill_rows: int = _knob(4, "prefill rows per step")
    preemption_mode: str = _knob("swap", "what a sequence preempted for pages does: swap (to host memory) or "
                                 "recompute (re-prefill later)", choices=PREEMPTION_MODES)
    swap_space_gb: float = _knob(4.0, "host memory for swapped sequences, GiB", flag="--swap-space")
    seed: int = _knob(0, "engine seed (requests without a seed draw from it)")
    load_mtp: bool = _knob(True, "load the checkpoint's MTP head when present")
    compile_cache_dir: str | None = _knob(None, "persistent XLA compilation cache ('' = off; default: "
                                          "$ATLAS_JAX_HOME/xla_cache)")
    enable_prompt_logprobs: bool = _knob(False, "serve prompt_logprobs (reserves one sequence's pages and a "
                                         "recurrent slot for scoring prompts; compiles the scoring buckets)")
    enable_prefix_caching: bool = _knob(False, "reuse the KV pages and recurrent-state snapshots of earlier "
                                        "requests' prefixes (multi-turn chat, shared system prompts, n > 1)")
    prefix_snapshot_bytes: int | None = _knob(None, "device memory for recurrent-state snapshots of cached prefixes "
                                              "(default: 4 per running sequence, at least 16, within 2 GiB)")
    enable_lora: bool = _knob(False, "serve LoRA adapters (PEFT format) beside the base model")
    max_loras: int = _knob(1, "LoRA adapters resident on the device at once (slots of the adapter pool)")
    max_lora_rank: int = _knob(16, "the largest LoRA rank served (smaller ranks are zero-padded)")
    max_cpu_loras: int | None = _knob(None, "LoRA adapters kept in host memory (default: max_loras)")
    async_scheduling: bool = _knob(True, "schedule and dispatch step t+1 while step t runs (the host reads a step's "
                                   "tokens one step late; outputs unchanged); with speculation only for mtp without the prefix cache")
    speculative: dict | None = _knob(None, "speculative decoding: METHOD[:NUM_DRAFTS] (mtp, self, ngram; e.g. "
                                     "'mtp:2') or a JSON object {\"method\": ..., \"num_drafts\": ...}")

    def engine_kwargs(self) -> dict:
        """Everything but the model path, as LLM's keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            text = f.metadata["help"] if "default" in f.metadata["help"] else f"{f.metadata['help']} (default: {f.default})"
            kw = dict(dest=f.name, default=f.default, help=text.replace("%", "%%"))     # argparse %-formats help
            if base is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif base is dict:
                kw["type"] = str                            # parsed in from_cli
            else:
                kw["type"] = base
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
            parser.add_argument(flag, **kw)
        return parser

    @classmethod
    def from_cli(cls, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> "EngineArgs":
        """The fields present in parsed CLI args (skip: names the CLI uses for something else, as
        add_cli_args' skip); raises ValueError naming a bad --speculative."""
        from .speculative import SpeculativeConfig
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if hasattr(args, f.name) and f.name not in skip}
        if isinstance(values.get("speculative"), str):
            try:
                values["speculative"] = SpeculativeConfig.from_cli(values["speculative"])
            except ValueError as e:
                raise ValueError(f"--speculative: {e}") from None
        return cls(**values)
