"""RowInput: one sequence's share of a step, as the host hands it to the runner (host only, no jax)."""
from __future__ import annotations

import dataclasses

from .sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass
class RowInput:
    """One sequence's share of a step (host side)."""
    tokens: list[int]          # new tokens, len >= 1
    start: int                 # tokens of this sequence already in the cache
    block_table: list[int]     # its pages, covering at least start + len(tokens) tokens
    slot: int                  # its recurrent-state / penalty-history slot
    params: SamplingParams = _GREEDY
    seed: int = 0
    step: int = 0              # tokens this request has sampled so far
    prompt_len: int = 0        # fed positions below this are prompt tokens (penalty history)
    state_idx: int = 0         # recurrent-state position to read (layers/gdn.py); -1: a chase row (steps.chase)
    next_token: int = -1       # MTP: the token after the last fed one when known (mid-prompt chunk), else -1
    draft_ok: bool = False     # MTP: the row may draft (its pages cover the draft positions)
    logit_adjust: tuple = ({}, False)   # Sequence.logit_adjustments(): ({token id: added logit}, only those)
    adapter: int = 0           # LoRA adapter slot (0 = the base model)
    rank: int = 0              # data-parallel rank whose pages and slot these are (local ids)


def row_of(seq, n: int, draft_ok: bool = False) -> RowInput:
    """A Sequence's next n tokens as a row (draft_ok: the MTP head drafts from it, SchedulerOutput.draft_ok)."""
    end = seq.num_cached + n
    return RowInput(tokens=seq.next_tokens(n), start=seq.num_cached, block_table=seq.pages, slot=seq.slot,
                    params=seq.params, seed=seq.seed, step=seq.num_generated, prompt_len=len(seq.prompt_ids),
                    state_idx=-1 if seq.slack else seq.state_idx, next_token=seq.token_at(end) if end < seq.num_tokens else -1,
                    logit_adjust=seq.logit_adjustments() if seq.params.adjusts_logits else ({}, False),
                    adapter=seq.adapter_slot or 0, draft_ok=draft_ok, rank=seq.dp_rank)


def row_logprobs(seq, out, i: int) -> dict[int, float] | None:
    """Row i's logprobs entry from a step's host outputs (None: the request asked for none)."""
    k = seq.params.logprobs
    if k is None:
        return None
    lp = {int(t): float(v) for t, v in zip(out["top_ids"][i][:k], out["top_logprobs"][i][:k])}
    lp[int(out["tokens"][i])] = float(out["logprob"][i])
    return lp
