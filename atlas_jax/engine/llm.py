"""LLM: the offline, vLLM-shaped API.

    llm = LLM("path/to/hf_checkpoint")            # or LLM() for the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

`generate` runs a static-batch loop: admit up to max_num_seqs requests whose pages and slot
fit, prefill them in chunks, decode until all finish, free, repeat. The continuous-batching
scheduler replaces `_run_batch` (the seam) without changing this API.
"""
from __future__ import annotations

import itertools
import os
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..state.allocator import BlockAllocator, SlotAllocator
from ..tokenizer import Tokenizer
from ..weights import load_model_params
from .outputs import CompletionOutput, RequestOutput
from .runner import ModelRunner, RowInput
from .sampling_params import SamplingParams
from .sequence import Sequence

_DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32,
           "float16": jnp.float16, "fp16": jnp.float16}
KERNELS = ("auto", "xla", "pallas")


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
    def __init__(self, model: str | None = None, *, dtype="auto", kernels: str = "auto", page_size: int = 16,
                 num_pages: int | None = None, max_num_seqs: int = 8, max_model_len: int | None = None,
                 max_prefill_chunk: int = 256, seed: int = 0, load_mtp: bool = True):
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        if kernels == "pallas":
            raise NotImplementedError("kernels='pallas' is not available yet; use 'xla' or 'auto'")
        if model is None:
            from ..default_model import default_model_path
            model = default_model_path()
        self.model_path = os.fspath(model)
        self.cfg = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        self.dtype = resolve_dtype(dtype)
        self.params, self.num_mtp_layers = load_model_params(self.model_path, self.cfg, self.dtype, load_mtp)

        self.max_model_len = int(max_model_len or min(self.cfg.max_position_embeddings, 4096))
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_chunk = max_prefill_chunk
        max_pages_per_seq = -(-self.max_model_len // page_size)
        self.num_pages = int(num_pages or max_num_seqs * max_pages_per_seq)
        self.blocks = BlockAllocator(self.num_pages, page_size)
        self.slots = SlotAllocator(max_num_seqs)
        self.runner = ModelRunner(self.cfg, self.params, num_pages=self.num_pages, page_size=page_size,
                                  num_slots=max_num_seqs, max_pages_per_seq=max_pages_per_seq, dtype=self.dtype)
        self._seed_rng = np.random.default_rng(seed)
        self._request_ids = itertools.count()

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    # ---- requests ---------------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_path} has no tokenizer.json; pass token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})")
        return None, ids

    def _make_sequence(self, prompt, params: SamplingParams) -> Sequence:
        text, ids = self._encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(the prompt must leave room for at least one new token)")
        seq = Sequence(request_id=str(next(self._request_ids)), prompt=text, prompt_ids=ids, params=params,
                       seed=params.seed if params.seed is not None else int(self._seed_rng.integers(2**32)),
                       max_len=min(self.max_model_len, len(ids) + params.max_tokens))
        if self.blocks.pages_for(seq.max_len) > self.num_pages:
            raise ValueError(f"request needs {self.blocks.pages_for(seq.max_len)} KV pages; the pool has "
                             f"{self.num_pages}")
        return seq

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None):
        """prompts: a str / token-id list, or a list of them. Returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        waiting = deque(seqs)
        while waiting:
            batch = self._admit(waiting)
            try:
                self._run_batch(batch)
            finally:
                self._release(batch)
        return [self._output(s) for s in seqs]

    # ---- static batch loop (the scheduler seam) ---------------------------------------------
    def _admit(self, waiting: deque) -> list[Sequence]:
        batch = []
        while waiting and len(batch) < self.max_num_seqs:
            seq = waiting[0]
            pages = self.blocks.allocate(self.blocks.pages_for(seq.max_len))
            if pages is None:
                break
            slot = self.slots.allocate(1)
            if slot is None:
                self.blocks.free(pages)
                break
            seq.pages, seq.slot = pages, slot[0]
            batch.append(waiting.popleft())
        assert batch, "an admissible request could not be admitted into an empty pool"
        return batch

    def _release(self, batch: list[Sequence]) -> None:
        for seq in batch:
            self.blocks.free(seq.pages)
            self.slots.free([seq.slot])
            seq.pages = []

    def _row(self, seq: Sequence) -> RowInput:
        p = seq.params
        return RowInput(tokens=seq.next_tokens(self.max_prefill_chunk), start=seq.num_cached,
                        block_table=seq.pages, slot=seq.slot, temperature=p.temperature, top_k=p.top_k,
                        top_p=p.top_p, seed=seq.seed, step=len(seq.output_ids))

    def _run_batch(self, batch: list[Sequence]) -> None:
        while True:
            live = [s for s in batch if not s.finished]
            if not live:
                return
            prefill = [s for s in live if s.prefilling]
            group = prefill or live                    # prompt chunks first, then decode steps
            rows = [self._row(s) for s in group]
            sampled = self.runner.step(rows)
            for seq, row, tok in zip(group, rows, sampled):
                seq.num_cached += len(row.tokens)
                if not seq.prefilling:                 # the row's last token was its final prompt/decode token
                    seq.append(int(tok), self.cfg.eos_token_ids)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_ids) if self.tokenizer else ""
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_ids,
                             outputs=[CompletionOutput(0, text, list(seq.output_ids), seq.finish_reason)],
                             finished=True)

    # ---- scoring ----------------------------------------------------------------------------
    def prompt_logits(self, prompt, chunk: int | None = None) -> np.ndarray:
        """fp32 logits [len(prompt), V] of every prompt position, computed through the paged
        cache in chunks of `chunk` tokens (default: max_prefill_chunk)."""
        _, ids = self._encode(prompt)
        chunk = chunk or self.max_prefill_chunk
        pages = self.blocks.allocate(self.blocks.pages_for(len(ids)))
        slot = self.slots.allocate(1)
        if pages is None or slot is None:
            raise RuntimeError("no free pages / slot for scoring")
        try:
            out = []
            for s in range(0, len(ids), chunk):
                row = RowInput(tokens=ids[s:s + chunk], start=s, block_table=pages, slot=slot[0])
                out += self.runner.prompt_logits([row])
            return np.concatenate(out, axis=0)
        finally:
            self.blocks.free(pages)
            self.slots.free(slot)
