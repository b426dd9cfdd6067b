"""Whole-prompt scoring on the runner's device state: logits of every fed token (LLM.prompt_logits, the
research API) and vLLM's prompt_logprobs (top-k on the device). Rows run on pages and a slot the caller
owns (the scratch sequence for prompt_logprobs), fed in chunks with the recurrent state carried between
them, through `runner._run` like every device call."""
from __future__ import annotations

import numpy as np

from ..parallel.multihost import host_args, to_host
from .buckets import bucket
from .row import RowInput


class PromptScoring:
    def __init__(self, runner):
        self.runner = runner                  # its executables, grid, batch packing and `_run`

    def chunked_logits(self, ids: list[int], pages: list[int], slot: int, chunk: int) -> np.ndarray:
        """fp32 logits [len(ids), V] of a prompt fed in chunks on `pages` / `slot`, padded to power-of-two
        buckets compiled on demand (LLM.prompt_logits)."""
        out, state_idx = [], 0
        for s in range(0, len(ids), chunk):
            row = RowInput(tokens=ids[s:s + chunk], start=s, block_table=pages, slot=slot, state_idx=state_idx)
            out += self.logits([row])
            state_idx = min(len(row.tokens), self.runner.state_positions) - 1
        return np.concatenate(out, axis=0)

    def score_prompt(self, ids: list[int], pages: list[int], slot: int, chunk: int, top: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then per token {its id and the top `top` ids:
        logprob given the tokens before it}; fed in chunks on the scratch `pages` / `slot`, padded to the
        prefill token buckets (warm-up compiles them with score=True); top-k runs on the device."""
        r, entries, state_idx = self.runner, [None], 0
        for s in range(0, len(ids) - 1, chunk):
            fed = ids[s:min(s + chunk, len(ids) - 1)]
            row = RowInput(tokens=fed, start=s, block_table=pages, slot=slot, state_idx=state_idx)
            ((_, t),) = r.exes.choose("score", ((1, r.grid.prefill_shape(1, len(fed))[1]),))
            targets = np.zeros((1, t), np.int32)
            targets[0, :len(fed)] = ids[s + 1:s + 1 + len(fed)]
            tok, top_ids, top_lp = host_args(r._run("score", (r.batch.segment([row], 1, t),), targets))
            for j, target in enumerate(ids[s + 1:s + 1 + len(fed)]):
                entries.append({target: float(tok[0, j]), **{int(i): float(v) for i, v in
                                                             zip(top_ids[0, j, :top], top_lp[0, j, :top])}})
            state_idx = min(len(fed), r.state_positions) - 1
        return entries

    def logits(self, rows: list[RowInput]) -> list[np.ndarray]:
        """fp32 logits of every new token: one [len(tokens), V] per row (compiled on demand)."""
        t = bucket(max(len(row.tokens) for row in rows))
        (logits,) = self.runner._run("logits", (self.runner.batch.segment(rows, bucket(len(rows)), t),))
        logits = to_host(logits)
        return [logits[i, :len(row.tokens)] for i, row in enumerate(rows)]
