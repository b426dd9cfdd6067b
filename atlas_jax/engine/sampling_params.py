"""SamplingParams (vLLM's names and defaults) with validation at construction.

Invalid values raise ValueError naming the field and its allowed range; the engine refuses
such a request before it touches any state.
"""
from __future__ import annotations

import dataclasses
import math

from .sampler import MAX_LOGPROBS

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1                          # completions per prompt
    max_tokens: int = 16
    temperature: float = 1.0            # 0 = greedy
    top_k: int = 0                      # 0 (or -1) = off
    top_p: float = 1.0                  # (0, 1]
    min_p: float = 0.0                  # [0, 1]
    repetition_penalty: float = 1.0     # > 0; 1 = off
    presence_penalty: float = 0.0       # [-2, 2]
    frequency_penalty: float = 0.0      # [-2, 2]
    seed: int | None = None             # per-request RNG stream; None = drawn by the engine
    stop: tuple[str, ...] = ()          # stop strings (not included in the text unless asked)
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None         # None = off; n >= 0: the sampled token's logprob + top n
    skip_special_tokens: bool = True
    output_kind: str = "cumulative"     # what AsyncLLM streams: cumulative, delta, final_only

    def __post_init__(self):
        def bad(field, allowed):
            raise ValueError(f"{field} must be {allowed}, got {getattr(self, field)!r}")
        if not _is_int(self.n) or self.n < 1:
            bad("n", "an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not (_finite(self.temperature) and self.temperature >= 0.0):
            bad("temperature", ">= 0")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (or -1 for off)")
        if not (_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            bad("top_p", "in (0, 1]")
        if not (_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            bad("min_p", "in [0, 1]")
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            bad("repetition_penalty", "> 0")
        for f in ("presence_penalty", "frequency_penalty"):
            if not (_finite(getattr(self, f)) and -2.0 <= getattr(self, f) <= 2.0):
                bad(f, "in [-2, 2]")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**32):
            bad("seed", "an integer in [0, 2**32)")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"one of {OUTPUT_KINDS}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", "a non-empty string or a list of them")
        object.__setattr__(self, "stop", stop)
        try:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        except (TypeError, ValueError):
            bad("stop_token_ids", "a list of integers")

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
