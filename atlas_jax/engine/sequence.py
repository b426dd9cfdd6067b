"""Sequence: one request's host-side life (tokens, pages, slot, stop check)."""
from __future__ import annotations

import dataclasses

from .sampling_params import SamplingParams


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                                  # resolved RNG seed
    max_len: int                               # prompt + generated tokens never exceed this
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0                        # tokens whose KV / recurrent state is in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = 0
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    def next_tokens(self, chunk: int) -> list[int]:
        """Tokens to feed next: a prompt chunk, or the last sampled token when decoding."""
        if self.prefilling:
            return self.prompt_ids[self.num_cached:self.num_cached + chunk]
        return self.output_ids[-1:]

    def append(self, token: int, eos_ids: tuple[int, ...]) -> None:
        self.output_ids.append(token)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= p.max_tokens or len(self.prompt_ids) + len(self.output_ids) >= self.max_len:
            self.finish_reason = "length"
